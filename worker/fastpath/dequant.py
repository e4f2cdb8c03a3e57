"""NF4 dequantisation as a Triton kernel, value for value bitsandbytes' own.

A decode step dequantises every 4-bit weight again (4 joint weights a layer, 112 calls a step for a
Qwen2.5-1.5B shape): on the H200 bitsandbytes' kernel took 14.6 us a call, ~1.6 ms of a 256-row step, writing
its bf16 output at ~1.6 TB/s. Here one program turns 1,024 packed bytes into 2,048 values: each byte's high
nibble first, then its low one (bitsandbytes' order), each the code table's entry times its block's float32
scale, rounded once to the output dtype, to nearest even --
bitsandbytes' arithmetic, so the weights are bit-identical (a test holds that against bitsandbytes on the CPU;
`bench kernels` on the GPU).

Only the NF4 layout with even block sizes and per-block float32 scales (the loop decodes double-quantised
scales once, `quant4.float_absmax`); FP4 and anything else stay with bitsandbytes. Triton is optional: without
it, or off CUDA, `available` says no. Under `TRITON_INTERPRET=1` the kernel runs on the CPU (the tests).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # CPU-only installs
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BYTES_PER_PROGRAM = 1024
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rounded(x, dtype: tl.constexpr, BF16: tl.constexpr):
        """float32 `x` in `dtype`, rounded to nearest even; to bfloat16 by its bits (finite values), as the GPU's
        conversion rounds: Triton's interpreter truncates that one."""
        if BF16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return x.to(dtype)

    # Not specialised on the size: one compile per output dtype and block size, at the engine's warm-up.
    @triton.jit(do_not_specialize=["n_bytes"])
    def _nf4_kernel(packed, absmax, code, out, n_bytes, BLOCK_BYTES: tl.constexpr, BYTES: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BYTES
        k = start + tl.arange(0, BYTES)
        inside = k < n_bytes
        byte = tl.load(packed + k, mask=inside, other=0).to(tl.int32)
        scale = tl.load(absmax + k // BLOCK_BYTES, mask=inside, other=0.0)
        dtype = out.dtype.element_ty
        bf16: tl.constexpr = dtype == tl.bfloat16
        high = _rounded(tl.load(code + (byte >> 4)) * scale, dtype, bf16)
        low = _rounded(tl.load(code + (byte & 15)) * scale, dtype, bf16)
        values = tl.reshape(tl.join(high, low), (2 * BYTES,))  # byte k's values at 2k (high) and 2k + 1 (low)
        index = 2 * start + tl.arange(0, 2 * BYTES)
        tl.store(out + index, values, mask=index < 2 * n_bytes)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernel serves this device and output dtype (CUDA; the CPU when interpreted)."""
    if triton is None or dtype not in DTYPES:
        return False
    return device.type == ("cpu" if INTERPRETED else "cuda")


def fits(quant_type: str, blocksize: int, shape: list[int], code: torch.Tensor | None, absmax: torch.Tensor) -> bool:
    """Whether `nf4` can dequantise this layout: NF4, an even block size and element count (a byte's two values
    share a block), a 16-entry float32 code table and float32 scales."""
    return (
        quant_type == "nf4"
        and blocksize % 2 == 0
        and len(shape) == 2
        and shape[0] * shape[1] % 2 == 0
        and code is not None
        and code.numel() == 16
        and code.dtype == torch.float32
        and absmax.dtype == torch.float32
    )


def nf4(
    packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, shape: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """The (out, in) weight in `dtype` from its packed bytes (two 4-bit codes a byte, high nibble first), its
    float32 per-block scales and its 16-entry code table."""
    n = shape[0] * shape[1]
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    n_bytes = n // 2
    grid = (triton.cdiv(n_bytes, BYTES_PER_PROGRAM),)
    _nf4_kernel[grid](
        packed.reshape(-1), absmax.contiguous(), code.contiguous(), out, n_bytes,
        BLOCK_BYTES=blocksize // 2, BYTES=BYTES_PER_PROGRAM,
    )  # fmt: skip
    return out
