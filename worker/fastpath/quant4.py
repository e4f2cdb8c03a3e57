"""4-bit weights: the only module that calls bitsandbytes' ops (`torch.ops.bitsandbytes`); our own NF4 kernel,
which reads bitsandbytes' packing, is `nf4`.

bitsandbytes' `Linear4bit.forward` spends ~150 us of Python per call and decodes double-quantised scales on
every call; the loop instead keeps each weight's scales in float32 (decoded once) and calls the two ops it
needs -- dequantise, and the 4-bit matmul -- directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.fastpath import nf4


@torch.no_grad()
def float_absmax(state: Any) -> torch.Tensor | None:
    """A 4-bit weight's per-block scales in float32, computed once as bitsandbytes computes them per call:
    with double quantisation they are themselves 8-bit, and decoding them costs two kernels every time.
    None for a layout bitsandbytes itself does not run (nested scales in blocks other than 256)."""
    if len(state.shape) != 2:
        return None
    if not state.nested:
        return state.absmax
    if state.state2.blocksize != 256:
        return None
    absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
        state.absmax, state.state2.absmax, state.state2.code, 256, torch.float32
    )
    return absmax + state.offset


@dataclass(frozen=True)
class Layout4bit:
    """How bitsandbytes reads a packed 4-bit weight (one projection's, or a group's joint buffer), and its two
    ops on it, called directly: without decoding the scales again or bitsandbytes' ~150 us of Python a call."""

    absmax: torch.Tensor  # float32 per-block scales
    blocksize: int
    quant_type: str
    shape: list[int]  # (out, in) of the unpacked weight
    dtype: torch.dtype  # compute dtype
    code: torch.Tensor | None = None  # the 4-bit type's code table for our kernel (`nf4.code_table`)

    def folds(self) -> bool:
        """Whether `dense_with` runs here: our NF4 kernel (`nf4`) serves this layout on this device."""
        return self.code is not None and nf4.serves(self.absmax.device, self.dtype, self.quant_type, self.blocksize)

    def dense_with(self, packed: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor | None:
        """The weight dequantised by our kernel, bit-equal to `dense`, with `extra` rows appended below it (`folds`
        first); None where the kernel failed."""
        assert self.code is not None
        return nf4.dequantize(
            packed, self.absmax, self.code, shape=(self.shape[0], self.shape[1]), blocksize=self.blocksize,
            dtype=self.dtype, extra=extra,
        )  # fmt: skip

    def dense(self, packed: torch.Tensor) -> torch.Tensor:
        """The weight dequantised as bitsandbytes' dequantise-then-linear path does it for large inputs."""
        return torch.ops.bitsandbytes.dequantize_4bit.default(
            packed, self.absmax, self.blocksize, self.quant_type, self.shape, self.dtype
        )

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """bitsandbytes' own 4-bit matmul op (its kernel choice by batch size), as `Linear4bit.forward` calls it."""
        out = torch.ops.bitsandbytes.gemm_4bit.default(
            x.to(self.dtype), packed, self.shape, self.absmax, self.blocksize, self.quant_type, bias=bias
        )
        return out.to(x.dtype)
