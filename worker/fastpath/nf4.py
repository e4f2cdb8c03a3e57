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

import torch

from worker.fastpath import pointwise
from worker.fastpath.ops import KernelSwitch
from worker.fastpath.pointwise import INTERPRETED, Launcher, cdiv, triton

# Packed bytes a program dequantises (2 x as many weights).
BLOCK = 1024

if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["n_bytes", "n_extra", "main"])
    def _nf4_kernel(packed, absmax, table, extra, out, n_bytes, n_extra, main, BLOCK: tl.constexpr,
                    BS: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        dtype = out.dtype.element_ty
        if pid < main:
            offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            inside = offs < n_bytes
            b = tl.load(packed + offs, mask=inside, other=0).to(tl.int32)
            scale = tl.load(absmax + (offs * 2) // BS, mask=inside, other=0.0)  # a byte's two share a block
            # One lookup a byte (`byte_table`): a 64-bit word holding both elements' code values.
            word = tl.load(table + b)
            hi = (word.to(tl.int32).to(tl.float32, bitcast=True) * scale).to(dtype)
            lo = ((word >> 32).to(tl.int32).to(tl.float32, bitcast=True) * scale).to(dtype)
            pairs = offs[:, None] * 2 + tl.arange(0, 2)[None, :]
            tl.store(out + pairs, tl.join(hi, lo), mask=inside[:, None])
        else:  # the rows appended: a plain copy
            at = (pid - main).to(tl.int64) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
            within = at < n_extra
            tl.store(out + n_bytes * 2 + at, tl.load(extra + at, mask=within), mask=within)

    NF4 = Launcher(_nf4_kernel, outputs=(4,))


# Whether our kernel runs: off for good once it failed (logged once; bitsandbytes' path from then on).
KERNEL = KernelSwitch(on=True)


def byte_table(code: torch.Tensor) -> torch.Tensor:
    """The kernel's lookup table from a 4-bit type's 16 code values (float32): for each byte, one int64 whose low
    32 bits are its high nibble's value and whose high 32 bits are its low nibble's (one lookup a byte, not two:
    bitsandbytes' own kernel and a first one of ours were bound by the lookups, ~2.2 TB/s on the H200)."""
    bits = code.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    byte = torch.arange(256, device=code.device)
    return bits[byte >> 4] | (bits[byte & 15] << 32)


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
    """The (out, in) weight `shape` dequantised (`table`: its type's `byte_table`), with `extra` (rows, in)
    appended below it: an (out + rows, in) tensor in `dtype`. None where the kernel failed (then off: the caller's
    bitsandbytes path runs)."""
    rows, cols = shape
    more = 0 if extra is None else extra.shape[0]
    out = torch.empty(rows + more, cols, dtype=dtype, device=packed.device)
    n_bytes = rows * cols // 2
    n_extra = more * cols
    main = cdiv(n_bytes, BLOCK)
    source = out if extra is None else extra.to(dtype).contiguous()

    def launch() -> None:
        NF4(
            (main + cdiv(n_extra, 2 * BLOCK), 1), packed, absmax, table, source, out, n_bytes, n_extra, main,
            BLOCK=BLOCK, BS=blocksize,
        )  # fmt: skip

    if not pointwise.launched(launch, packed.device, "NF4 dequantise"):
        KERNEL.on = False
        return None
    return out
