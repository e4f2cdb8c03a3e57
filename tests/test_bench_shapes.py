"""`python -m bench shapes` on the CPU's tiny shape: both passes run at counts drawn in the range, the blocked one
at the block's multiples, and its row lands in the results file (here a temporary one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.common
from bench import shapes


def test_both_passes_run_and_write_their_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(bench.common, "RESULTS_MD", results)
    args = ["--device", "cpu", "--shape", "tiny", "--counts", "5", "--low", "17", "--high", "40", "--block", "16"]
    report = shapes.main([*args, "--out", str(tmp_path / "out")])
    assert report["counts"] == 5 and 1 <= report["blocked_shapes"] <= 2  # every count past the block: 16 and 32
    for kind in ("exact", "blocked"):
        assert all(report[kind][k] > 0 for k in ("first_ms", "again_ms", "first_median_ms", "again_median_ms"))
    (row,) = results.read_text().splitlines()
    assert row.startswith("| shapes | CPU") and "5 token counts in 17-40" in row and "in blocks of 16 rows" in row
    assert json.loads((tmp_path / "out" / "shapes.json").read_text())["block"] == 16


def test_counts_outside_the_range_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        shapes.main(["--device", "cpu", "--shape", "tiny", "--counts", "50", "--low", "10", "--high", "20"])
