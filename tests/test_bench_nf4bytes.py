"""The candidate NF4 dequantise of `bench/nf4bytes.py`, run on the CPU by Triton's interpreter: bit-equal to the
worker's kernel (`worker/fastpath/nf4.py`, itself bit-equal to bitsandbytes) in fp16 and fp32, in blocks of 64,
128 and 4,096 (one block a program), with a partial last program, an odd-sized last block, and rows appended."""

from __future__ import annotations

import pytest

from tests.test_pointwise import run_interpreted

pytest.importorskip("triton")


def test_candidate_dequantise_is_the_workers_kernel_bit_for_bit() -> None:
    out = run_interpreted("""
        import torch
        import bitsandbytes.functional as bnb
        from bench import nf4bytes
        from worker.fastpath import nf4
        torch.manual_seed(0)
        cases = ((96, 128, 64, 5), (24, 320, 128, 0), (3, 64, 64, 1), (5, 24, 64, 0), (2, 4096, 4096, 2))
        for dtype in (torch.float16, torch.float32):
            for rows, cols, blocksize, more in cases:
                weight = torch.randn(rows, cols, dtype=dtype) * 3
                packed, state = bnb.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4")
                absmax, table = state.absmax.float(), nf4.code_table(state.code)
                extra = torch.randn(more, cols, dtype=dtype) if more else None
                kw = {"shape": (rows, cols), "blocksize": blocksize, "dtype": dtype, "extra": extra}
                want = nf4.dequantize(packed, absmax, table, **kw)
                got = nf4bytes.dequantize(packed, absmax, table, **kw)
                assert got.shape == (rows + more, cols)
                assert torch.equal(got, want), (dtype, rows, cols, blocksize)
        assert nf4bytes.serves(64) and nf4bytes.serves(4096) and not nf4bytes.serves(48)
        print("ok")
    """)
    assert out.strip() == "ok"
