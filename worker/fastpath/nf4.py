"""NF4 weights dequantised by our own Triton kernel, with extra rows appended: the decode step's 4-bit matmuls.

A decode step dequantises every 4-bit weight it multiplies (bitsandbytes' `gemm_4bit` for more than one row is
dequantise, then a bf16 matmul): 112 launches a step for a 28-layer model, ~1.6 ms of a 256-row step on the
H200 (~2 TB/s, where the largest weights alone would run at ~4). Beside it, each adapter's LoRA costs two
small matmuls a projection -- the shrink `x A^T` and the expand -- each mostly launch latency. Here one kernel
dequantises a weight (as bitsandbytes does: the NF4 code's float32 value times the block's float32 scale,
rounded once to the compute dtype -- bit-equal to `dequantize_4bit`) into a buffer with rows to spare, and
copies the adapters' stacked A matrices into those rows in the same launch: one matmul then gives the base
output and every adapter's shrink side by side (`weights.Fold`), and only the expand remains.

bitsandbytes' packing, read as it writes it: a weight's elements in row-major order, two to a byte (the first
in the high nibble), one float32 scale (`absmax`, double quantisation decoded once: `quant4.float_absmax`) per
`blocksize` consecutive elements. Only NF4 (the default and the seed's type): FP4 keeps bitsandbytes' path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.fastpath import pointwise
from worker.fastpath.ops import KernelSwitch
from worker.fastpath.pointwise import INTERPRETED, Launcher, cdiv, triton

# Packed bytes a program reads (twice as many weights written) and its warps. Measured on an H100 (`bench kernels
# --only dequant`, a Qwen2.5-1.5B layer's four projections x 28 layers, each its own weights): 1.442 ms against
# 1.553 for the kernel before this one (a weight a lane: each byte loaded by itself, twice, and a scale per
# weight) and 1.777 for bitsandbytes'.
BYTES = 4096
WARPS = 4

if triton is not None:
    import triton.language as tl

    # The sizes are specialised (multiples of 16 give vectorised, unmasked-in-effect loads and stores; a model's
    # four projections share one pattern, compiled in the warm-up); `main` only splits the grid.
    @triton.jit(do_not_specialize=["main"])
    def _nf4_kernel(packed, absmax, code, extra, out, n_out, n_bytes, n_extra, main, ROWS: tl.constexpr,
                    HALF: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        if pid < main:
            # ROWS scale blocks of HALF packed bytes: whole bytes a lane (loads of 16 bytes, masked by bytes), a
            # block's scale loaded once and broadcast along its bytes, both weights of a byte from the 16-entry
            # code (64 bytes: a warp's lookups hit one or two cache lines), joined back into element order.
            block = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
            at = block[:, None] * HALF + tl.arange(0, HALF)[None, :]
            b = tl.load(packed + at, mask=at < n_bytes, other=0).to(tl.int32)
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

    NF4 = Launcher(_nf4_kernel, outputs=(4,), num_warps=WARPS)


# Whether our kernel runs: off for good once it failed (logged once; bitsandbytes' path from then on).
KERNEL = KernelSwitch(on=True)


def code_table(code: torch.Tensor) -> torch.Tensor:
    """The kernel's lookup table from a 4-bit type's 16 code values: float32, contiguous (the product with the
    float32 scale is bitsandbytes' arithmetic), a copy of our own (not the quantisation state's tensor)."""
    return code.to(dtype=torch.float32, copy=True).contiguous()


def serves(device: torch.device, dtype: torch.dtype, quant_type: str, blocksize: int) -> bool:
    """Whether `dequantize` takes a weight of this layout into `dtype` on `device`."""
    floats = (torch.bfloat16, torch.float16, *((torch.float32,) if INTERPRETED else ()))
    layout = quant_type == "nf4" and blocksize >= 2 and blocksize & (blocksize - 1) == 0  # whole bytes, 2^k
    return KERNEL.on and layout and dtype in floats and pointwise.available(device, dtype)


def blocks_a_program(blocksize: int) -> int:
    """Scale blocks a program of the kernel dequantises (`BYTES` packed bytes, or one block where it is larger)."""
    return max(1, BYTES // (blocksize // 2))


def dequantize(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    table: torch.Tensor,
    *,
    shape: tuple[int, int],
    blocksize: int,
    dtype: torch.dtype,
    extra: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The (out, in) weight `shape` dequantised (`table`: its type's `code_table`), with `extra` (rows, in)
    appended below it: an (out + rows, in) tensor in `dtype`. None where the kernel failed (then off: the caller's
    bitsandbytes path runs)."""
    t = Target.of(shape, dtype, packed.device, extra)
    half = blocksize // 2
    blocks = blocks_a_program(blocksize)
    main = cdiv(cdiv(t.n_out, blocksize), blocks)

    def launch() -> None:
        NF4(
            (main + cdiv(t.n_extra, blocks * blocksize), 1), packed, absmax, table, t.source, t.out, t.n_out,
            cdiv(t.n_out, 2), t.n_extra, main, ROWS=blocks, HALF=half,
        )  # fmt: skip

    if not pointwise.launched(launch, packed.device, "NF4 dequantise"):
        KERNEL.on = False
        return None
    return t.out


@dataclass(frozen=True)
class Target:
    """What a dequantise writes: the (out + rows, in) tensor, what its appended rows are copied from (the tensor
    itself where none are appended: an argument no program reads), and both parts' element counts."""

    out: torch.Tensor
    source: torch.Tensor
    n_out: int
    n_extra: int

    @classmethod
    def of(cls, shape: tuple[int, int], dtype: torch.dtype, device: torch.device, extra: torch.Tensor | None) -> Target:
        rows, cols = shape
        more = 0 if extra is None else extra.shape[0]
        out = torch.empty(rows + more, cols, dtype=dtype, device=device)
        source = out if extra is None else extra.to(dtype).contiguous()
        return cls(out=out, source=source, n_out=rows * cols, n_extra=more * cols)
