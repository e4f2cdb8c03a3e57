"""`kevlaya demo`'s own path (submit the bundled decisions, a worker thread, the summary) on small demo models:
the CLI's demo is otherwise only run by `make demo`."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from worker.tools import demo
from worker.tools.demo_models import build_demo_models
from worker.tools.evaluate import EXPERT, SCREEN


def test_the_demo_answers_every_bundled_decision_and_prints_its_summary(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    toml = build_demo_models(tmp_path / "demo", train_rows=48, heldout_rows=12, check_rows=12, pretrain_steps=10)
    monkeypatch.setattr(demo, "prepare_models", lambda out: toml)
    demo.run_demo(tmp_path / "run", items=24, redis_url=redis_url)
    rows = [orjson.loads(line) for line in (tmp_path / "run" / "results.jsonl").read_bytes().splitlines()]
    assert len(rows) == 24 and len({r["custom_id"] for r in rows}) == 24
    summary = capsys.readouterr().out
    assert "kevlaya demo summary" in summary and "24 (24 answered, 0 failed)" in summary
    for line in (f"{SCREEN} alone", f"{EXPERT} alone", "cascade", f"{SCREEN} calibration"):
        assert line in summary
