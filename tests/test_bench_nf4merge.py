"""The candidate of `bench nf4merge`, run on the CPU by Triton's interpreter: a 4-bit weight dequantised with a
LoRA merged in by one kernel equal to the format's arithmetic then `addmm_`'s (the weight rounded to the compute
dtype, plus B A summed in float32, rounded once), in fp32 and fp16 (the interpreter multiplies bf16 tiles wrongly:
bf16 is checked on the GPU, tests/test_gpu.py), in blocks of 64 and 128, at ranks below, at and above one dot's
16, with partial tiles and blocks that straddle rows; and compiled for sm_90."""

from __future__ import annotations

import pytest

from tests.test_pointwise import run_interpreted
from tests.test_triton_compile import compiled

pytest.importorskip("triton")


def test_the_merged_dequantise_is_dequantise_then_addmm() -> None:
    out = run_interpreted("""
        import torch
        import bitsandbytes.functional as bnb
        from bench import nf4merge
        from worker.fastpath import nf4
        from worker.fastpath.quant4 import Layout4bit
        torch.manual_seed(0)
        for dtype in (torch.float32, torch.float16):
            for rows, cols, blocksize, rank in ((96, 128, 64, 16), (40, 320, 128, 24), (5, 24, 64, 8)):
                weight = torch.randn(rows, cols, dtype=dtype)
                packed, state = bnb.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4")
                layout = Layout4bit(absmax=state.absmax.float(), blocksize=blocksize, quant_type="nf4",
                                    shape=[rows, cols], dtype=dtype, code=nf4.code_table(state.code))
                b, a = torch.randn(rows, rank, dtype=dtype) * 0.1, torch.randn(rank, cols, dtype=dtype) * 0.1
                codes = torch.stack((packed.flatten().long() >> 4, packed.flatten().long() & 15), 1).flatten()
                scales = state.absmax.float().repeat_interleave(blocksize)[: rows * cols]
                dense = (state.code.float()[codes] * scales).to(dtype).view(rows, cols)
                want = (dense.float() + b.float() @ a.float()).to(dtype)
                for tile in ((16, 32), nf4merge.TILE):
                    got = nf4merge.dense_merged(layout, packed, b, a, tile)
                    assert got.shape == (rows, cols) and got.dtype == dtype
                    torch.testing.assert_close(got, want, rtol=2e-6 if dtype == torch.float32 else 1e-3, atol=1e-5)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_the_merged_dequantise_compiles() -> None:
    from bench import nf4merge

    pointers = {"packed": "*u8", "absmax": "*fp32", "code": "*fp32", "b": "*bf16", "a": "*bf16", "out": "*bf16"}
    for bm, bn in nf4merge.TILES:
        constexprs = {"BS": 64, "BM": bm, "BN": bn, "RP": 16}
        ptx = compiled(nf4merge._nf4_merge_kernel, pointers, constexprs, ("cols", "sa_r"), num_warps=nf4merge.WARPS)
        assert ".entry _nf4_merge_kernel" in ptx
