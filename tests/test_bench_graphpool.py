"""`python -m bench graphpool`: refused without CUDA in one line, and its row's figures from the readings."""

from __future__ import annotations

import pytest

from bench import graphpool
from worker.memory import MIB


def test_it_needs_a_cuda_device(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        graphpool.main(["--device", "cpu", "--rows", "16"])
    assert exc.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_each_reading_gives_the_fixed_part_the_plan_sets_aside() -> None:
    """A reading past its rows' estimate sets aside the difference; one within it sets nothing aside."""
    row = int(0.4 * MIB)
    big = graphpool.PoolReading(rows=16, grew_bytes=76 * MIB, planned_row_bytes=row)
    small = graphpool.PoolReading(rows=256, grew_bytes=100 * MIB, planned_row_bytes=row)
    assert big.fixed_bytes == 76 * MIB - 16 * row
    assert small.fixed_bytes == 0
    text = graphpool.summary([big, small])
    assert text == (
        "16 rows: grew 76 MiB, planned 6 MiB per row + 70 MiB fixed; "
        "256 rows: grew 100 MiB, planned 102 MiB per row + 0 MiB fixed"
    )
