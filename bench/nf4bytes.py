"""A candidate for our NF4 dequantise (`worker/fastpath/nf4.py`), not yet the worker's: written in the twenty-sixth
session, bit-equal to it on the CPU (Triton's interpreter) and compiled for sm_90 there, but never timed on a GPU
(no machine started for it). `python -m bench kernels --only dequant` times it beside the worker's kernel and
bitsandbytes'; where it is faster, it replaces the worker's kernel (bench/RESULTS.md, twenty-sixth session).

The worker's kernel takes a weight a lane: each packed byte is loaded by itself, twice (by both of its weights),
and a scale is looked up per weight -- in its PTX for sm_90, 32 one-byte loads and 64 four-byte loads a thread for
32 weights, besides the stores. Here a lane takes whole bytes, loaded 16 at a time, both weights of a byte from the
16-entry code table, and a scale block's scale once; the two weights of each byte are joined back into element
order for 16-byte stores (2 vector loads, 64 table lookups and 1 scale for 64 weights a thread). The arithmetic is
bitsandbytes' and the worker kernel's: the code's float32 value times the block's float32 scale, rounded once.
"""

from __future__ import annotations

import torch

from worker.fastpath.nf4 import Target
from worker.fastpath.pointwise import Launcher, cdiv, triton

BYTES = 4096  # packed bytes a program reads (twice as many weights written)
WARPS = 4

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["main"])
    def _nf4_bytes_kernel(packed, absmax, code, extra, out, n_out, n_bytes, n_extra, main, ROWS: tl.constexpr,
                          HALF: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        if pid < main:
            # ROWS scale blocks of HALF bytes each: a block's scale loaded once and broadcast along its bytes.
            block = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
            at = block[:, None] * HALF + tl.arange(0, HALF)[None, :]
            b = tl.load(packed + at, mask=at < n_bytes, other=0).to(tl.int32)  # masked by bytes: 16-byte loads
            scale = tl.load(absmax + block, mask=2 * HALF * block < n_out, other=0.0)[:, None]
            first = (tl.load(code + (b >> 4)) * scale).to(out.dtype.element_ty)  # a byte's first: its high nibble
            second = (tl.load(code + (b & 15)) * scale).to(out.dtype.element_ty)
            pair = tl.reshape(tl.join(first, second), (ROWS, 2 * HALF))
            to = block[:, None] * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
            tl.store(out + to, pair, mask=to < n_out)
        else:  # the rows appended: a plain copy, as many elements a program as the others write
            # (names of their own: Triton types a variable once for both branches of the `if`)
            copied = (pid - main).to(tl.int64) * (2 * ROWS * HALF) + tl.arange(0, 2 * ROWS * HALF)
            within = copied < n_extra
            tl.store(out + n_out + copied, tl.load(extra + copied, mask=within), mask=within)

    NF4_BYTES = Launcher(_nf4_bytes_kernel, outputs=(4,), num_warps=WARPS)


def serves(blocksize: int) -> bool:
    """Scale blocks of a power of two of whole bytes (bitsandbytes' are 32 to 4,096 weights)."""
    return blocksize >= 2 and blocksize & (blocksize - 1) == 0


def dequantize(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    table: torch.Tensor,
    *,
    shape: tuple[int, int],
    blocksize: int,
    dtype: torch.dtype,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """As `worker.fastpath.nf4.dequantize`: the (out, in) weight `shape` (`table`: `nf4.code_table`), with `extra`
    (rows, in) appended below it, an (out + rows, in) tensor in `dtype`. Raises where the kernel fails."""
    assert serves(blocksize), blocksize
    t = Target.of(shape, dtype, packed.device, extra)
    half = blocksize // 2
    blocks = max(1, BYTES // half)  # scale blocks a program
    main = cdiv(cdiv(t.n_out, blocksize), blocks)
    NF4_BYTES(
        (main + cdiv(t.n_extra, blocks * blocksize), 1), packed, absmax, table, t.source, t.out, t.n_out,
        cdiv(t.n_out, 2), t.n_extra, main, ROWS=blocks, HALF=half,
    )  # fmt: skip
    return t.out
