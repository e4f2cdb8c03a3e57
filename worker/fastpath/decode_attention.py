"""The decode step's attention over the static cache, reading only each row's own columns.

A take's rows share one static cache of `length` columns, every prompt right-aligned at the batch's width, so a
row's keys are the columns from `width - its prompt length` to the step's `cache_pos` -- one run of columns.
SDPA with the boolean mask reads every column of every row: for Laya's 60-300-word prompts in a 512-column cache
about half the K/V bytes it reads are masked out. Here one program takes a row's KV head: the query heads that
share it as the rows of one tile (grouped-query attention without copying K/V), its columns from the row's
first to `cache_pos` in blocks, online softmax in float32, the probabilities rounded to the compute dtype before
they multiply V (as flash attention does). Where Triton is missing, the device is not CUDA (the CPU when
interpreted, the tests), the batch is too small to fill the GPU (`MIN_PROGRAMS`) or the kernel failed once
(logged), the caller's SDPA runs.
"""

from __future__ import annotations

import torch

from worker.fastpath import pointwise
from worker.fastpath.ops import KernelSwitch
from worker.fastpath.pointwise import INTERPRETED, Launcher, triton

# Columns a program reads per iteration, and the query tile's rows (`tl.dot` takes at least 16).
BLOCK_N = 64
MIN_QUERY_ROWS = 16
# Programs (rows x KV heads) below which SDPA runs instead: a program walks its row's columns alone, so with
# fewer programs than about two per SM the GPU idles where cuDNN splits the columns. On the H200 (28 layers
# graph-replayed, 512 columns, ~half of them a row's): 256 rows 1.24 ms against SDPA's 1.68, 128 rows 0.82
# against 1.02; 64 rows at 1,152 columns 1.54 against 1.03, 16 rows 0.64 against 0.61.
MIN_PROGRAMS = 256

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _block(query, k_row, v_row, cols, hi, sk_t, sv_t, best, total, acc, scale, d):
        """One block of a row's columns into the running softmax (its max `best`, sum `total`, output `acc`)."""
        inside = cols < hi
        keys = tl.load(k_row + cols[:, None] * sk_t + d[None, :], mask=inside[:, None], other=0.0)
        scores = tl.where(inside[None, :], tl.dot(query, tl.trans(keys)) * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        rescale = tl.exp(best - new_best)
        p = tl.exp(scores - new_best[:, None])
        values = tl.load(v_row + cols[:, None] * sv_t + d[None, :], mask=inside[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(values.dtype), values)
        return new_best, total * rescale + tl.sum(p, 1), acc

    # Sizes and strides specialised (Triton compiles a variant per pattern of values that are 1 or multiples of
    # 16): the cache's strides are multiples of the head size whatever its length, the queries' a model's joint
    # output widths, so the warm-up's captures meet every pattern; known multiples of 16, the K/V loads vectorise.
    @triton.jit
    def _decode_attention_kernel(
        q, k, v, first, last, out, groups, sq_r, sq_h, sk_r, sk_h, sk_t, sv_r, sv_h, sv_t, scale,
        G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)
        heads = tl.num_programs(1)
        g = tl.arange(0, G)
        d = tl.arange(0, D)
        asked = g < groups
        query = tl.load(q + row * sq_r + head * sq_h + g[:, None] * D + d[None, :], mask=asked[:, None], other=0.0)
        lo = tl.load(first + row)
        hi = tl.load(last) + 1
        best = tl.full([G], float("-inf"), tl.float32)
        total = tl.zeros([G], tl.float32)
        acc = tl.zeros([G, D], tl.float32)
        k_row = k + row.to(tl.int64) * sk_r + head * sk_h
        v_row = v + row.to(tl.int64) * sv_r + head * sv_h
        if BLOCKS == 0:  # compiled: the row's own columns only
            for start in range(lo, hi, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                best, total, acc = _block(query, k_row, v_row, cols, hi, sk_t, sv_t, best, total, acc, scale, d)
        else:  # Triton's interpreter (the CPU tests) runs no loop bounded by runtime values: every block, masked
            for i in range(0, BLOCKS):
                cols = lo + i * BLOCK + tl.arange(0, BLOCK)
                best, total, acc = _block(query, k_row, v_row, cols, hi, sk_t, sv_t, best, total, acc, scale, d)
        result = acc / total[:, None]
        where = out + ((row * heads + head) * groups + g[:, None]) * D + d[None, :]
        tl.store(where, result.to(out.dtype.element_ty), mask=asked[:, None])

    DECODE_ATTENTION = Launcher(_decode_attention_kernel, outputs=(5,))


# Whether our kernel runs: off for good once it failed (logged once; SDPA with the mask from then on).
KERNEL = KernelSwitch(on=True)


def serves(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these: our kernels on this device and dtype, enough rows x KV heads to
    fill the GPU (`MIN_PROGRAMS`; the CPU's interpreter any), a power-of-two head size, the query heads of a KV
    head side by side (as a view of the joint q/k/v output has them)."""
    dim = q.shape[-1]
    return (
        KERNEL.on
        and (q.device.type == "cpu" or q.shape[0] * q.shape[1] >= MIN_PROGRAMS)
        and pointwise.available(q.device, q.dtype)
        and dim >= 16
        and dim & (dim - 1) == 0
        and q.stride(-1) == 1
        and q.stride(2) == dim
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    first: torch.Tensor,
    last: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor | None:
    """Attention of one query token per row: `q` (rows, kv_heads, groups, D) -- the query heads sharing a KV
    head as its rows -- over `k_cache`/`v_cache` (rows, kv_heads, length, D) at the columns `first[row]` ..
    `last[0]` of each row (both device tensors: a captured graph reads them by address). Returns a fresh
    (rows, kv_heads, groups, D) tensor, or None where the kernel failed (then off: the caller's SDPA runs)."""
    rows, kv_heads, groups, dim = q.shape
    out = torch.empty_like(q)

    def launch() -> None:
        DECODE_ATTENTION(
            (rows, kv_heads), q, k_cache, v_cache, first, last, out, groups, q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), scale, G=max(MIN_QUERY_ROWS, pointwise.next_power_of_2(groups)), D=dim, BLOCK=BLOCK_N,
            BLOCKS=pointwise.cdiv(k_cache.shape[2], BLOCK_N) if INTERPRETED else 0,
        )  # fmt: skip

    if not pointwise.launched(launch, q.device, "decode attention"):
        KERNEL.on = False
        return None
    return out
