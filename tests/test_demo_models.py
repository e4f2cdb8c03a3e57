"""The demo-model pipeline end to end at a small size: task data, tokenizer, base, both adapters trained
with `kevlaya train`, a ready models.toml, and `kevlaya eval --json` on the held-out split."""

from __future__ import annotations

from pathlib import Path

import orjson
from click.testing import CliRunner

from producer.cli import cli
from worker.config import load_config
from worker.tools.demo_models import build_demo_models


def test_small_demo_models_build_and_evaluate(tmp_path: Path) -> None:
    toml = build_demo_models(tmp_path / "demo", train_rows=48, heldout_rows=12, check_rows=12, pretrain_steps=10)
    for name in ("kev", "laya"):
        assert (toml.parent / "adapters" / name / "adapter_model.safetensors").is_file()
        assert (toml.parent / "adapters" / name / "loss.png").is_file()
    assert (
        build_demo_models(tmp_path / "demo", train_rows=48, heldout_rows=12, check_rows=12, pretrain_steps=10) == toml
    )  # cached
    result = CliRunner().invoke(
        cli, ["eval", "--config", str(toml), "--json", "--device", "cpu"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    report = orjson.loads(result.stdout)
    assert report["items"] == 12
    for key in ("laya", "kev", "cascade"):
        assert 0.0 <= report[key]["accuracy"] <= 1.0
    assert 0.0 <= report["cascade"]["escalation_rate"] <= 1.0
    assert report["calibration"]["ece_before"] >= 0.0 and report["calibration"]["ece_after"] >= 0.0
    assert len(report["curve"]) == 101 and report["threshold"] == report["cascade"]["threshold"]
    assert all(Path(p).is_file() for p in report["plots"])
    # The build calibrated Laya and picked its threshold, and says so in cascade.json.
    config = load_config(toml)
    assert config.models["laya"].calibration is not None
    figures = orjson.loads((toml.parent / "cascade.json").read_bytes())
    assert figures["threshold"] == config.models["laya"].escalation.threshold
    assert {"fit", "check"} <= set(figures["calibration"])
    # ... and confirmed both on the second split, at the threshold it wrote.
    assert figures["check"]["items"] == 12 and figures["check"]["cascade"]["threshold"] == figures["threshold"]
    assert {"laya", "kev"} <= set(figures["check"])

    # `kevlaya calibrate` re-fits from the raw confidences, prints ECE on both splits, writes PNGs and config.
    result = CliRunner().invoke(
        cli,
        ["calibrate", "--config", str(toml), "--data", str(toml.parent / "heldout.jsonl"), "--check",
         str(toml.parent / "heldout-check.jsonl"), "--method", "isotonic", "--device", "cpu"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "ECE" in result.output and "not fitted on" in result.output
    assert all((toml.parent / "calibration" / f"laya-reliability-{w}.png").is_file() for w in ("before", "after"))
    assert load_config(toml).models["laya"].calibration.method == "isotonic"
