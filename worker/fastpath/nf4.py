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

# Weights a program writes (half as many packed bytes). Measured on the H200 (`probe` of 2026-12-03, every
# projection of a Qwen2.5-1.5B layer, L2 flushed): 57.9 us a layer against 64.1 for the kernel before this one
# (a byte a lane, both elements from a 256-entry table of pairs, 1,024 bytes a program, sizes unspecialised).
BLOCK = 8192

if triton is not None:
    import triton.language as tl

    # The sizes are specialised (multiples of 16 give vectorised, unmasked-in-effect loads and stores; a model's
    # four projections share one pattern, compiled in the warm-up); `main` only splits the grid.
    @triton.jit(do_not_specialize=["main"])
    def _nf4_kernel(packed, absmax, code, extra, out, n_out, n_extra, main, BLOCK: tl.constexpr,
                    BS: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        if pid < main:
            # One lane a weight: its byte (read twice, by it and its neighbour: cached), its nibble's value from
            # the 16-entry code (64 bytes, so a warp's lookups hit one or two cache lines), its block's scale.
            at = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            inside = at < n_out
            b = tl.load(packed + at // 2, mask=inside, other=0).to(tl.int32)
            nibble = tl.where(at % 2 == 0, b >> 4, b & 15)  # the first element of a byte in its high nibble
            value = tl.load(code + nibble)
            scale = tl.load(absmax + at // BS, mask=inside, other=0.0)
            tl.store(out + at, (value * scale).to(out.dtype.element_ty), mask=inside)
        else:  # the rows appended: a plain copy
            at = (pid - main).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            within = at < n_extra
            tl.store(out + n_out + at, tl.load(extra + at, mask=within), mask=within)

    NF4 = Launcher(_nf4_kernel, outputs=(4,), num_warps=8)


# Whether our kernel runs: off for good once it failed (logged once; bitsandbytes' path from then on).
KERNEL = KernelSwitch(on=True)


def code_table(code: torch.Tensor) -> torch.Tensor:
    """The kernel's lookup table from a 4-bit type's 16 code values: float32, contiguous (the product with the
    float32 scale is bitsandbytes' arithmetic), a copy of our own (not the quantisation state's tensor)."""
    return code.to(dtype=torch.float32, copy=True).contiguous()


def serves(device: torch.device, dtype: torch.dtype, quant_type: str, blocksize: int) -> bool:
    """Whether `dequantize` takes a weight of this layout into `dtype` on `device`."""
    floats = (torch.bfloat16, torch.float16, *((torch.float32,) if INTERPRETED else ()))
    layout = quant_type == "nf4" and blocksize % 2 == 0
    return KERNEL.on and layout and dtype in floats and pointwise.available(device, dtype)


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
    main = cdiv(t.n_out, BLOCK)

    def launch() -> None:
        NF4(
            (main + cdiv(t.n_extra, BLOCK), 1), packed, absmax, table, t.source, t.out, t.n_out, t.n_extra, main,
            BLOCK=BLOCK, BS=blocksize,
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
