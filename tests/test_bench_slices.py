"""The candidate of `bench slices`, run on the CPU by Triton's interpreter: the decode step's folded 4-bit matmul
a row slice at a time equal to the worker's whole one (bias, both adapters' masked deltas; float32, up to
summation order), its slices whole multiples of 128 rows that start scale blocks, with a short last one."""

from __future__ import annotations

import pytest

from tests.test_pointwise import run_interpreted

pytest.importorskip("triton")


def test_the_folded_matmul_in_row_slices_is_the_workers_whole_one() -> None:
    out = run_interpreted("""
        import torch
        import bitsandbytes.functional as bnb
        from bench import slices
        from worker.fastpath import nf4, weights
        from worker.fastpath.quant4 import Layout4bit
        torch.manual_seed(0)
        rows, cols, dtype = 600, 128, torch.float32
        packed, state = bnb.quantize_4bit(torch.randn(rows, cols), blocksize=64, quant_type="nf4")
        layout = Layout4bit(absmax=state.absmax.float(), blocksize=64, quant_type="nf4", shape=[rows, cols],
                            dtype=dtype, code=nf4.code_table(state.code))
        loras = [(n, torch.randn(8, cols) * 0.1, torch.randn(rows, 8) * 0.1) for n in ("kev", "laya")]
        x = torch.randn(5, 1, cols)
        kev = torch.tensor([1.0, 0, 1, 0, 1]).view(5, 1, 1)
        masks = [("kev", kev), ("laya", 1 - kev)]
        spans = slices.row_spans((rows, cols), 4, 64, 128 * cols * 4)  # slices of 128 rows of float32
        assert [(s.first, s.count) for s in spans] == [(0, 128), (128, 128), (256, 128), (384, 128), (512, 88)]
        assert slices.row_spans((rows, cols), 4, 64, rows * cols * 4) == (slices.RowSpan(0, rows),)
        assert slices.row_spans((rows, cols), 4, 64, 0) == (slices.RowSpan(0, rows),)
        # Each slice within the budget, even where rounding up to 128 rows would pass it: down's (1536, 8960) in
        # bf16 at 6.55 MB takes six slices of 256 rows, not four of 384.
        down = slices.row_spans((1536, 8960), 2, 64, 6_553_600)
        assert [(s.first, s.count) for s in down] == [(256 * i, 256) for i in range(6)]
        # 40 columns, blocks of 64: a slice starts a block every 8 rows (within the 128-row alignment).
        assert all(s.first * 40 % 64 == 0 for s in slices.row_spans((1000, 40), 2, 64, 300 * 40 * 2))
        for bias in (torch.randn(rows), None):
            fold = weights.Fold.of(loras, bias)
            whole = weights.folded_matmul(x, layout, packed, fold, masks)
            got = slices.sliced_matmul(x, layout, packed, fold, masks, spans)
            assert got.shape == whole.shape == (5, 1, rows)
            torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
            want = x @ bnb.dequantize_4bit(packed, state).t() + (0 if bias is None else bias)
            for (_, a, b), (_, mask) in zip(loras, masks):
                want = want + mask * ((x @ a.t()) @ b.t())
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        print("ok")
    """)
    assert out.strip() == "ok"
