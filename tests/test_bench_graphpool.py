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


def test_each_reading_gives_what_the_plans_own_terms_leave_uncovered() -> None:
    """A reading past its rows' estimate and the choice chunk sets aside the difference; one within them, nothing."""
    row, chunk = int(0.4 * MIB), 58 * MIB
    big = graphpool.PoolReading(rows=16, grew_bytes=76 * MIB, planned_row_bytes=row, planned_chunk_bytes=chunk)
    small = graphpool.PoolReading(rows=256, grew_bytes=160 * MIB, planned_row_bytes=row, planned_chunk_bytes=chunk)
    assert big.fixed_bytes == 76 * MIB - 16 * row - chunk
    assert small.fixed_bytes == 0
    text = graphpool.summary([big, small])
    assert text == (
        "16 rows: grew 76 MiB, planned 6 MiB for the rows + 58 MiB choice chunk, 12 MiB uncovered; "
        "256 rows: grew 160 MiB, planned 102 MiB for the rows + 58 MiB choice chunk, 0 MiB uncovered"
    )
