"""The CI-sized soak: jobs in waves while workers and Redis are killed at random -> nothing lost, nothing doubled."""

from __future__ import annotations

from pathlib import Path

from bench.soak import main


def test_short_soak_loses_nothing(tmp_path: Path) -> None:
    report = main(
        [
            "--jobs",
            "300",
            "--waves",
            "3",
            "--duration-s",
            "20",
            "--faults-every",
            "3,7",
            "--batch-rows",
            "64",
            "--out",
            str(tmp_path),
            "--no-results-row",
        ]
    )
    assert report["worker_kills"] + report["redis_restarts"] >= 2
    assert report["lost"] == 0
    assert report["duplicate_final_results"] == 0
    assert report["final_results"] == 300
    assert report["count_mismatches"] == 0 and report["unexpected_exits"] == 0
    assert report["hostile_writes"] > 0 and report["quarantined"] > 0
