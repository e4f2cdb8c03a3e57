"""`python -m bench shapes` on the CPU's tiny shape: both passes run at the counts drawn, the bucketed counts are
the drawn ones rounded up, and its row lands in the results file (here a temporary one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.common
from bench import shapes


def test_both_passes_run_and_write_their_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(bench.common, "RESULTS_MD", results)
    args = ["--device", "cpu", "--shape", "tiny", "--counts", "5", "--low", "10", "--high", "40", "--bucket", "16"]
    report = shapes.main([*args, "--out", str(tmp_path / "out")])
    assert report["counts"] == 5 and 1 <= report["distinct_buckets"] <= 3  # 16, 32, 48
    for kind in ("exact", "bucketed"):
        assert all(report[kind][k] > 0 for k in ("first_ms", "again_ms", "first_median_ms", "again_median_ms"))
    (row,) = results.read_text().splitlines()
    assert row.startswith("| shapes | CPU") and "5 token counts in 10-40" in row and "rounded up to 16" in row
    assert json.loads((tmp_path / "out" / "shapes.json").read_text())["bucket"] == 16


def test_counts_outside_the_range_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        shapes.main(["--device", "cpu", "--shape", "tiny", "--counts", "50", "--low", "10", "--high", "20"])
