"""Matmuls in row blocks (worker/fastpath/gemm.py): the same values as one matmul, at row counts drawn from the
block's multiples only. Run on the CPU with the block given (on a GPU `linear` picks it)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from worker.fastpath import gemm

BLOCK = 8


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16, 17, 23, 40, 41])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_linear_matches_one_matmul(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 12, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
    bias = torch.randn(5, dtype=torch.float64) if with_bias else None
    out = gemm.blocked_linear(x, w, bias, BLOCK)
    assert out.shape == (rows, 5)
    torch.testing.assert_close(out, F.linear(x, w, bias))


def test_blocked_linear_keeps_leading_dims_and_reads_strided_inputs() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 11, 6, dtype=torch.float64).transpose(0, 1)  # (11, 4, 6): 44 rows, not contiguous
    w = torch.randn(3, 6, dtype=torch.float64)
    out = gemm.blocked_linear(x, w, None, BLOCK)
    assert out.shape == (11, 4, 3)
    torch.testing.assert_close(out, F.linear(x, w))


def test_row_counts_come_from_the_blocks_multiples(blocked_rows: list[int]) -> None:
    w = torch.randn(4, 3)
    counts = random.Random(0).sample(range(BLOCK + 1, 20 * BLOCK), 60)
    for rows in counts:
        gemm.blocked_linear(torch.randn(rows, 3), w, None, BLOCK)
    seen = set(blocked_rows)
    assert seen and all(m % BLOCK == 0 for m in seen)
    assert len(seen) <= 20  # 60 distinct counts, at most one shape per multiple of the block


@pytest.mark.parametrize("rows", [3, 8, 13, 16, 29])
def test_blocked_add_matmul_adds_each_row_once(rows: int) -> None:
    torch.manual_seed(rows)
    result = torch.randn(rows, 7, dtype=torch.float64)
    low, b = torch.randn(rows, 2, dtype=torch.float64), torch.randn(2, 7, dtype=torch.float64)
    expected = result + low @ b
    out = gemm.blocked_add_matmul_(result, low, b, BLOCK)
    assert out is result
    torch.testing.assert_close(result, expected)


def test_blocks_only_inside_row_blocks_and_never_on_the_cpu() -> None:
    x, on_gpu = torch.zeros(300, 4), SimpleNamespace(is_cuda=True)
    assert gemm.block_of(x) is None and gemm.block_of(on_gpu) is None  # outside prefill: whole
    with gemm.row_blocks():
        assert gemm.block_of(on_gpu) is None  # gradients on: autograd refuses writes into an output's slices
        with torch.inference_mode():
            assert gemm.block_of(x) is None  # the CPU: whole
            assert gemm.block_of(on_gpu) == gemm.ROW_BLOCK
    with torch.inference_mode():
        assert gemm.block_of(on_gpu) is None
    w = torch.randn(2, 4)
    torch.testing.assert_close(gemm.linear(torch.ones(300, 4), w), F.linear(torch.ones(300, 4), w))


def test_the_counts_to_warm_are_the_steps_below_the_block_then_its_multiples() -> None:
    step = gemm.row_step(gemm.ROW_BLOCK)
    assert step == gemm.ROW_BLOCK // 8
    counts = gemm.row_counts(8192, torch.device("cuda"))
    small = [c for c in counts if c < gemm.ROW_BLOCK]
    assert small == list(range(step, gemm.ROW_BLOCK, step))
    large = counts[len(small) :]
    assert large[0] == gemm.ROW_BLOCK and large[-1] == 8192
    assert all(b - a == gemm.ROW_BLOCK for a, b in itertools.pairwise(large))
    # Up to the count the most rows run at: 100 rows run at 128.
    assert gemm.row_counts(100, torch.device("cuda")) == [c for c in small if c <= 128] == [32, 64, 96, 128]
    assert gemm.row_counts(8192, torch.device("cpu")) == []


SMALL_BLOCK = 64  # its step: 8 rows


@pytest.mark.parametrize("rows", [1, 7, 8, 13, 40, 63])
@pytest.mark.parametrize("with_bias", [False, True])
def test_below_the_block_a_matmul_runs_at_its_rows_rounded_up_to_the_step(
    blocked_rows: list[int], rows: int, with_bias: bool
) -> None:
    """Without room, the input is copied into rows that hold it; the values are the plain matmul's."""
    torch.manual_seed(rows)
    step = gemm.row_step(SMALL_BLOCK)
    padded = gemm.padded_rows(rows, SMALL_BLOCK)
    assert padded % step == 0 and rows <= padded < rows + step
    x, w = torch.randn(rows, 12, dtype=torch.float64), torch.randn(5, 12, dtype=torch.float64)
    bias = torch.randn(5, dtype=torch.float64) if with_bias else None
    out = gemm.blocked_linear(x, w, bias, SMALL_BLOCK)
    assert blocked_rows == ([] if padded == rows else [padded])  # a count of its own runs as it is
    assert out.shape == (rows, 5)
    torch.testing.assert_close(out, F.linear(x, w, bias))


def test_below_the_block_an_input_with_room_is_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = torch.full((16, 12), float("nan"), dtype=torch.float64)  # the room's values never reach a row
    x = buffer[:13]
    x.copy_(torch.randn(13, 12, dtype=torch.float64))
    inputs: list[torch.Tensor] = []
    real = gemm._matmul_into
    monkeypatch.setattr(gemm, "_matmul_into", lambda out, a, w, b: inputs.append(a) or real(out, a, w, b))
    w = torch.randn(5, 12, dtype=torch.float64)
    out = gemm.blocked_linear(x, w, None, SMALL_BLOCK)
    assert [a.shape[0] for a in inputs] == [16] and inputs[0].data_ptr() == x.data_ptr()
    torch.testing.assert_close(out, F.linear(x, w))
    # The output keeps its room: a sum into it over the padded rows, where it owns them, adds each row once.
    low, b = torch.randn(13, 2, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    expected = out + low @ b
    gemm.blocked_add_matmul_(out, low, b, SMALL_BLOCK, owns_rows=True)  # low has no room: at its own count
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("rows", [9, 17, 23, 41])
@pytest.mark.parametrize("with_bias", [False, True])
def test_an_input_with_room_runs_as_one_matmul_over_its_padded_rows(
    blocked_rows: list[int], rows: int, with_bias: bool
) -> None:
    torch.manual_seed(rows)
    padded = gemm.padded_rows(rows, BLOCK)
    assert padded % BLOCK == 0 and rows < padded < rows + BLOCK
    buffer = torch.full((padded, 12), float("nan"), dtype=torch.float64)  # the room's values never reach a row
    x = buffer[:rows]
    x.copy_(torch.randn(rows, 12, dtype=torch.float64))
    w = torch.randn(5, 12, dtype=torch.float64)
    bias = torch.randn(5, dtype=torch.float64) if with_bias else None
    out = gemm.blocked_linear(x.view(1, rows, 12), w, bias, BLOCK)
    assert blocked_rows == [padded]
    assert out.shape == (1, rows, 5)
    torch.testing.assert_close(out[0], F.linear(x, w, bias))
    # Its output keeps the room: the next matmul over it runs as one too.
    gemm.blocked_linear(out, torch.randn(3, 5, dtype=torch.float64), None, BLOCK)
    assert blocked_rows == [padded, padded]


def test_an_input_without_room_or_with_strided_rows_runs_in_two(blocked_rows: list[int]) -> None:
    w = torch.randn(5, 12, dtype=torch.float64)
    gemm.blocked_linear(torch.randn(23, 12, dtype=torch.float64), w, None, BLOCK)  # its storage ends at its rows
    assert blocked_rows == [16, 8]
    strided = torch.randn(40, 24, dtype=torch.float64)[:23, :12]  # room, but rows 24 apart
    out = gemm.blocked_linear(strided, w, None, BLOCK)
    assert blocked_rows == [16, 8, 16, 8]
    torch.testing.assert_close(out, F.linear(strided, w))


@pytest.mark.parametrize("rows", [13, 29])
def test_add_matmul_with_room_adds_each_row_once(rows: int) -> None:
    torch.manual_seed(rows)
    padded = gemm.padded_rows(rows, BLOCK)
    result = torch.zeros(padded, 7, dtype=torch.float64)[:rows]
    result.copy_(torch.randn(rows, 7, dtype=torch.float64))
    low = torch.full((padded, 2), float("nan"), dtype=torch.float64)[:rows]
    low.copy_(torch.randn(rows, 2, dtype=torch.float64))
    b = torch.randn(2, 7, dtype=torch.float64)
    expected = result + low @ b
    assert gemm.blocked_add_matmul_(result, low, b, BLOCK, owns_rows=True) is result
    torch.testing.assert_close(result, expected)


def test_add_matmul_never_writes_past_its_rows_unless_it_owns_them(blocked_rows: list[int]) -> None:
    """A view into a larger tensor: the rows after it are someone else's data, and stay as they were."""
    torch.manual_seed(0)
    big = torch.randn(16, 7, dtype=torch.float64)
    after = big[13:].clone()
    result = big[:13]
    low, b = torch.randn(13, 2, dtype=torch.float64), torch.randn(2, 7, dtype=torch.float64)
    low_room = torch.full((16, 2), float("nan"), dtype=torch.float64)  # its room: garbage
    low_room[:13] = low
    expected = result + low @ b
    gemm.blocked_add_matmul_(result, low_room[:13], b, BLOCK)
    torch.testing.assert_close(result, expected)
    assert torch.equal(big[13:], after)


def test_empty_rows_hold_room_only_inside_row_blocks_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    with gemm.row_blocks(), torch.inference_mode():
        t = gemm.empty_rows(3, 100, 4, dtype=torch.float32, device=cpu)
        assert t.shape == (3, 100, 4) and t.untyped_storage().nbytes() == 300 * 4 * 4  # the CPU: none
    # The allocation a GPU gets, on the CPU: 300 rows hold room up to 512 (the block's next multiple).
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *shape, device, **kw: real_empty(*shape, **kw))
    gpu = torch.device("cuda")
    with gemm.row_blocks(), torch.inference_mode():
        t = gemm.empty_rows(3, 100, 4, dtype=torch.float32, device=gpu)
        assert t.shape == (3, 100, 4) and t.is_contiguous()
        assert t.untyped_storage().nbytes() == gemm.padded_rows(300, gemm.ROW_BLOCK) * 4 * 4 == 512 * 16
        assert gemm.empty_rows(2, 128, 4, dtype=torch.float32, device=gpu).untyped_storage().nbytes() == 256 * 16
    with torch.inference_mode():
        assert gemm.empty_rows(3, 100, 4, dtype=torch.float32, device=gpu).untyped_storage().nbytes() == 300 * 16


def test_the_last_layers_read_columns_hold_room_for_their_padded_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where matmuls pad (a GPU, inside prefill's row blocks) the gathered columns hold room up to the next step,
    so the output projection after them runs as one matmul without a copy; elsewhere they hold none."""
    from worker.fastpath.prefill import read_columns

    torch.manual_seed(0)
    states = torch.randn(5, 9, 4)
    columns = torch.tensor([[0, 3, 8]] * 5)
    want = torch.stack([states[r, [0, 3, 8]] for r in range(5)])
    torch.testing.assert_close(read_columns(states, columns), want)
    monkeypatch.setattr(gemm, "block_on", lambda is_cuda: 64)  # the block a GPU gets, on the CPU: steps of 8
    with torch.inference_mode():
        got = read_columns(states, columns)
    assert got.shape == (5, 3, 4) and got.is_contiguous()
    assert got.untyped_storage().nbytes() == 16 * 4 * 4  # 15 rows rounded up to the step
    torch.testing.assert_close(got, want)


def test_a_delta_into_one_row_of_a_joint_outputs_slice_never_takes_the_other_members_for_its_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One row of a member's slice of a joint q/k/v output counts as contiguous (a size-1 dimension's stride is
    ignored), but the bytes after it are the other members' outputs, not its room: the sum may not run over
    padded rows there. A whole fresh output's rows may."""
    from worker.fastpath import weights

    owned: list[bool] = []
    real = weights.add_matmul_
    monkeypatch.setattr(
        weights, "add_matmul_", lambda r, low, b, owns_rows=False: owned.append(owns_rows) or real(r, low, b)
    )
    torch.manual_seed(0)
    joint = torch.randn(1, 1, 10, dtype=torch.float64)
    q, others = joint[..., :4], joint[..., 4:].clone()
    assert q.is_contiguous()
    x, a, b = (torch.randn(*shape, dtype=torch.float64) for shape in ((1, 1, 6), (2, 6), (4, 2)))
    want = q + F.linear(F.linear(x, a), b)
    with torch.inference_mode():
        weights.fused_delta(q, x, a, b, None)
        weights.fused_delta(torch.zeros(1, 1, 4, dtype=torch.float64), x, a, b, None)
    torch.testing.assert_close(q, want)
    assert torch.equal(joint[..., 4:], others)
    assert owned == [False, True]
