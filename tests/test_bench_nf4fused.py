"""The candidate fused NF4 matmul of `bench nf4fused`, run on the CPU by Triton's interpreter: x W^T equal to our
dequantise-then-matmul reference up to the order of summation, rows and features past a tile's edge masked, for
two block sizes; block sizes it cannot step by refused; and the pair permutation it reads x in."""

from __future__ import annotations

import pytest
import torch

from bench.nf4fused import Nf4Weight, Tiles, fused_matmul, nf4_code, pair_permuted
from tests.test_pointwise import run_interpreted


def test_pair_permuted_puts_each_blocks_even_columns_first() -> None:
    x = torch.arange(2 * 8, dtype=torch.float32).view(2, 8)
    assert pair_permuted(x, 4).tolist() == [[0, 2, 1, 3, 4, 6, 5, 7], [8, 10, 9, 11, 12, 14, 13, 15]]


@pytest.mark.parametrize(("shape", "blocksize"), [((8, 96), 48), ((8, 96), 16), ((8, 96), 64)])
def test_a_block_size_the_kernel_cannot_step_by_is_refused(shape: tuple[int, int], blocksize: int) -> None:
    weight = Nf4Weight.random((8, 192), 64, torch.device("cpu"))
    odd = Nf4Weight(weight.packed, weight.absmax, shape, blocksize)
    with pytest.raises(ValueError, match="does not fit"):
        fused_matmul(torch.zeros(2, shape[1]), odd, nf4_code(torch.device("cpu")), Tiles(16, 32, 4, 1))


def test_fused_matmul_equals_dequantise_then_matmul() -> None:
    out = run_interpreted("""
        import torch
        from bench.nf4fused import Nf4Weight, Tiles, fused_matmul, nf4_code, pair_permuted
        from worker.fastpath import nf4
        torch.manual_seed(0)
        code = nf4_code(torch.device("cpu"))
        for rows, shape, blocksize, tiles in (
            (5, (40, 256), 64, Tiles(rows=16, features=32, warps=4, stages=1)),
            (19, (70, 384), 128, Tiles(rows=16, features=64, warps=4, stages=2)),
        ):
            weight = Nf4Weight.random(shape, blocksize, torch.device("cpu"))
            x = torch.randn(rows, shape[1]).to(torch.float16)
            dense = nf4.dequantize(weight.packed, weight.absmax, nf4.code_table(code), shape=shape,
                                   blocksize=blocksize, dtype=torch.float32).to(torch.float16)
            want = x.float() @ dense.float().t()
            got = fused_matmul(pair_permuted(x, blocksize), weight, code, tiles).float()
            assert got.shape == want.shape
            error = float((got - want).abs().max() / want.abs().max())
            assert error < 2e-3, error
            # A weight scaled up breaks it: the check can fail.
            wrong = Nf4Weight(weight.packed, weight.absmax * 2, shape, blocksize)
            off = fused_matmul(pair_permuted(x, blocksize), wrong, code, tiles).float()
            assert float((off - want).abs().max() / want.abs().max()) > 0.5
        print("ok")
    """)
    assert out.strip() == "ok"
