"""`python -m bench prefill` on the CPU's tiny models: every variant runs every workload without an error, the
same prompts in each, and its row lands in the results file (here a temporary one)."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.common
from bench import prefill


def test_every_variant_runs_every_workload_and_writes_its_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(bench.common, "RESULTS_MD", results)
    args = ["--device", "cpu", "--shape", "tiny", "--rows", "8", "--chunks", "256,512", "--groups", "0,1024"]
    report = prefill.main([*args, "--ops", "compiled", "--repeats", "1", "--out", str(tmp_path / "out")])
    runs = report["runs"]
    assert {(r["chunk_tokens"], r["group_tokens"]) for r in runs} == {(256, 0), (256, 1024), (512, 0), (512, 1024)}
    for workload in ("nightly", "long", "choices"):
        mine = [r for r in runs if r["workload"] == workload]
        assert len(mine) == 4 and len({r["prompt_tokens"] for r in mine}) == 1  # the same prompts in every variant
        assert all(r["tokens_per_s"] > 0 and r["alloc_retries"] == 0 for r in mine)
    long = [r for r in runs if r["workload"] == "long"]
    assert all(r["prompt_tokens"] == r["rows"] * 1024 for r in long)  # cut at the input limit
    assert all("prefill" in r["phases_s"] for r in runs if r["workload"] != "choices")
    (row,) = results.read_text().splitlines()
    assert row.startswith("| prefill | CPU") and "long compiled 512/1024" in row
    assert (tmp_path / "out" / "RESULTS-rows.md").read_text().strip() == row


def test_our_kernels_are_refused_where_they_do_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.common, "RESULTS_MD", tmp_path / "RESULTS.md")
    with pytest.raises(SystemExit, match="not available"):
        prefill.main(["--device", "cpu", "--shape", "tiny", "--rows", "4", "--ops", "kernels", "--out", str(tmp_path)])
