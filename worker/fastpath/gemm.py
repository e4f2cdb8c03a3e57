"""Prefill's matmuls at row counts the math library has already seen.

A prefill chunk's matmuls run at M = rows x span tokens, a count a live stream seldom repeats, and on the H200
cuBLAS pays ~1-2.5 ms the first time it meets a matmul at a new M (`python -m bench shapes`: a layer's four
matmuls cost 4.4 ms the first time at a new M between 4096 and 8192 tokens, 0.82 ms again). Every new chunk size
paid that once per projection shape, 0.06-0.14 s of a workload's first takes. Here a prefill matmul of M rows,
M past a block and not a multiple of it, runs as two: its first rows up to the last multiple of the block, then
the block of rows ending at its last row (overlapping the first part; those rows are written twice with the same
values). Both have a count drawn from the multiples of the block, so a worker meets at most (most rows / block)
shapes per projection, whatever its prompts, and the warm-up meets them first (`row_counts`). The cost is one
launch and at most a block of rows more per matmul: cuBLAS computes its rows in tiles of 64-256 anyway.

Where the input's storage already holds rows up to the next multiple of the block -- prefill's transient
activations are allocated so (`empty_rows`: the MLP's normed input, SiLU x up's output and every blocked matmul's
output) -- the matmul runs as one, over those padded rows, and their outputs are dropped: a chunk's layer step
launches two matmuls fewer (gate/up and down), each tens of microseconds of host time while the GPU waits on the
host (`python -m bench gaps`). The states held between layers (the next layer's normed input) hold no room: the
planner counts them exactly, and q/k/v's matmul runs in two, as does the output projection's (its input is the
attention's own output).

Below a block, a matmul runs at its rows rounded up to an eighth of the block (`row_step`: 32 of 256): the last
layer's read columns (a chunk's rows, times its choice tokens when scoring), the LM head's first-token logits and
scoring slices. An input without room for them is copied into rows that hold it (a few MiB at most). Those counts
are warmed too, so a fresh worker's first takes meet no new count there either (the first run of a scoring take
left the GPU waiting ~2 ms on each such matmul, `python -m bench gaps`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from worker.memory import PREFILL_ROW_BLOCK

# Rows per block: a multiple of cuBLAS's row tiles, small beside a prefill chunk (4096-8192 tokens); the planner
# counts a chunk's room for its padded rows (`worker.memory.prefill_chunk_bytes`).
ROW_BLOCK = PREFILL_ROW_BLOCK

# Whether matmuls run in row blocks here: inside prefill (`row_blocks`). A decode step's matmuls meet their few
# row counts once, when its graph is captured.
_blocks: ContextVar[bool] = ContextVar("row_blocks", default=False)


@contextlib.contextmanager
def row_blocks() -> Iterator[None]:
    """Matmuls inside run in row blocks on a GPU (`linear`, `add_matmul_`)."""
    token = _blocks.set(True)
    try:
        yield
    finally:
        _blocks.reset(token)


def block_of(x: torch.Tensor) -> int | None:
    """The row block a matmul of `x` runs in (`block_on` its device)."""
    return block_on(x.is_cuda)


def block_on(is_cuda: bool) -> int | None:
    """The row block matmuls run in here: `ROW_BLOCK` on a GPU inside `row_blocks` with gradients off (the
    blocks write into slices of one output, which autograd refuses), else None (whole; the CPU's libraries
    choose per call at no such cost)."""
    return ROW_BLOCK if is_cuda and _blocks.get() and not torch.is_grad_enabled() else None


# Below the block, row counts are rounded up to the block over this (`row_step`).
ROW_STEPS = 8


def row_step(block: int) -> int:
    """What a matmul's rows below `block` are rounded up to: an eighth of it (1 for blocks under 8: none)."""
    return max(1, block // ROW_STEPS)


def row_counts(most_rows: int, device: torch.device) -> list[int]:
    """Every row count that `linear` runs matmuls of up to `most_rows` rows at: the steps below the block, then
    the block's multiples (none off a GPU)."""
    if device.type != "cuda":
        return []
    step = row_step(ROW_BLOCK)
    small = range(step, min(ROW_BLOCK, padded_rows(most_rows, ROW_BLOCK) + 1), step)
    return [*small, *range(ROW_BLOCK, most_rows + 1, ROW_BLOCK)]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, its rows in blocks on a GPU (`blocked_linear`)."""
    return blocked_linear(x, weight, bias, block_of(x))


def body_rows(rows: int, block: int | None) -> int | None:
    """Where a matmul of `rows` rows splits: the rows up to the last multiple of `block` (then the `block` rows
    ending at the last one run apart), or None where it runs whole -- at most a block, a multiple of it, or no
    block."""
    if block is None or rows <= block or rows % block == 0:
        return None
    return rows - rows % block


def padded_rows(rows: int, block: int | None) -> int:
    """The rows a matmul of `rows` rows runs over, and an activation of them holds room for: below `block`, up to
    the next step (`row_step`); past it, up to the next multiple of `block` where the matmul splits (`body_rows`);
    else `rows`."""
    if block is None:
        return rows
    if rows < block:
        step = row_step(block)
        return -(-rows // step) * step
    body = body_rows(rows, block)
    return rows if body is None else body + block


def empty_rows(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh tensor of `shape` (its rows all but the last dimension), its storage holding rows up to the next
    multiple of the block inside `row_blocks` on a GPU (`padded_rows`): a matmul over it runs as one."""
    features = shape[-1]
    rows = math.prod(shape[:-1])
    room = padded_rows(rows, block_on(device.type == "cuda"))
    if room == rows:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty(room, features, dtype=dtype, device=device)[:rows].view(shape)


def with_room(flat: torch.Tensor, rows: int) -> torch.Tensor | None:
    """`flat` (M, features) as (rows, features), rows >= M, where its rows are contiguous and its storage holds
    the rows past M (their values are whatever is there: only their own outputs read them); else None."""
    features = flat.shape[1]
    if flat.stride() != (features, 1):
        return None
    if flat.untyped_storage().nbytes() < (flat.storage_offset() + rows * features) * flat.element_size():
        return None
    return flat.as_strided((rows, features), (features, 1))


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block: int | None) -> torch.Tensor:
    """x W^T (+ bias) over x's last dimension, as (M rows) one matmul where M is a row count of its own
    (`padded_rows` gives M back); else over x's padded rows as one where its storage holds them (`with_room`) or
    M is below the block (x copied into rows that hold them), or as the rows up to the last multiple of `block`
    and the `block` rows ending at the last one. The output holds the padded rows' room."""
    features = x.shape[-1]
    rows = x.numel() // max(1, features)
    padded = padded_rows(rows, block)
    if block is None or padded == rows:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, features)
    out = flat.new_empty(padded, weight.shape[0])
    whole = with_room(flat, padded)
    if whole is None and rows < block:
        whole = flat.new_empty(padded, features)
        whole[:rows].copy_(flat)
    if whole is not None:
        _matmul_into(out, whole, weight, bias)
    else:
        body = rows - rows % block
        _matmul_into(out[:body], flat[:body], weight, bias)
        _matmul_into(out[rows - block : rows], flat[rows - block :], weight, bias)
    return out[:rows].view(*x.shape[:-1], weight.shape[0])


def _matmul_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def add_matmul_(result: torch.Tensor, low: torch.Tensor, b: torch.Tensor, *, owns_rows: bool = False) -> torch.Tensor:
    """`result += low @ b` in place, `result` (M, N) contiguous rows, `low` (M, R), `b` (R, N): in blocks of rows
    on a GPU as `blocked_linear` runs its matmuls -- the rows past the last multiple of the block take their sum
    from the block of rows ending at the last one, made apart and copied in (adding in place twice would count
    the overlap twice; one `addmm` rounds the sum once, as `addmm_` does). `owns_rows`: the rows past `result`'s
    in its storage are its own padding, nobody's data (a fresh matmul output), so the sum may run over them too."""
    return blocked_add_matmul_(result, low, b, block_of(result), owns_rows=owns_rows)


def blocked_add_matmul_(
    result: torch.Tensor, low: torch.Tensor, b: torch.Tensor, block: int | None, *, owns_rows: bool = False
) -> torch.Tensor:
    """`add_matmul_` with the row block given (None: one `addmm_`); over the padded rows as one where `result`
    owns the rows past its own (`owns_rows`: they are written) and both storages hold them (`with_room`)."""
    rows = result.shape[0]
    padded = padded_rows(rows, block)
    if block is None or padded == rows:
        return result.addmm_(low, b)
    whole = with_room(result, padded) if owns_rows else None
    low_whole = with_room(low, padded)
    if whole is not None and low_whole is not None:
        whole.addmm_(low_whole, b)
        return result
    body = body_rows(rows, block)
    if body is None:  # below the block, without room: at its own count
        return result.addmm_(low, b)
    result[:body].addmm_(low[:body], b)
    last = torch.addmm(result[rows - block :], low[rows - block :], b)
    result[body:] = last[block - (rows - body) :]
    return result
