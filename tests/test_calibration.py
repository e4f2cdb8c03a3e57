"""Confidence calibration: fitting on synthetic scores of known miscalibration, applying it to outputs,
and the config table `kevlaya calibrate` writes round-tripping through the loader."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from shared.errors import ConfigError
from shared.result import ErrorInfo
from worker.calibration import (
    ISOTONIC,
    TEMPERATURE,
    Calibration,
    calibrated_output,
    ece,
    fit,
    fit_choices_temperature,
    fit_isotonic,
    fit_temperature,
)
from worker.config import load_config
from worker.outputs import RowOutput
from worker.tools.config_write import set_key, write_table


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def overconfident(n: int, temperature: float, *, seed: int = 0) -> tuple[list[float], list[bool]]:
    """Raw confidences sigmoid(z) of answers that are right with probability sigmoid(z / temperature):
    a model whose log-odds are `temperature` times too large."""
    rng = random.Random(seed)
    raw, correct = [], []
    for _ in range(n):
        z = rng.gauss(1.5, 2.0)
        raw.append(_sigmoid(z))
        correct.append(rng.random() < _sigmoid(z / temperature))
    return raw, correct


@pytest.mark.parametrize("true_t", [0.6, 1.0, 2.5])
def test_temperature_fit_recovers_a_known_temperature(true_t: float) -> None:
    raw, correct = overconfident(20_000, true_t)
    assert fit_temperature(raw, correct) == pytest.approx(true_t, rel=0.08)


def test_choice_temperature_fit_recovers_a_known_temperature() -> None:
    rng = random.Random(1)
    labels = ("approve", "reject", "review")
    dists, gold = [], []
    for _ in range(6_000):
        logits = [rng.gauss(0, 3) for _ in labels]
        raw = [math.exp(v) for v in logits]
        true = [math.exp(v / 2.0) for v in logits]
        dists.append({k: v / sum(raw) for k, v in zip(labels, raw, strict=True)})
        gold.append(rng.choices(labels, weights=true)[0])
    assert fit_choices_temperature(dists, gold) == pytest.approx(2.0, rel=0.08)


def test_fitted_temperature_brings_ece_down_and_auto_keeps_temperature_for_temperature_data() -> None:
    raw, correct = overconfident(4_000, 2.0)
    fitted = fit(raw, correct)
    assert fitted.method == TEMPERATURE  # the data is exactly temperature-miscalibrated: isotonic cannot win
    assert fitted.ece_before is not None and fitted.ece_before > 0.08
    assert fitted.ece_after is not None and fitted.ece_after < 0.03
    held_raw, held_correct = overconfident(4_000, 2.0, seed=9)  # a split not used for fitting
    assert ece([fitted.confidence(p) for p in held_raw], held_correct) < 0.03


def test_auto_picks_isotonic_when_no_temperature_can_fix_the_shape() -> None:
    # Right 90% of the time below 0.5 and 10% above: not monotone in the log-odds' scale, only in order.
    rng = random.Random(2)
    raw = [rng.random() for _ in range(4_000)]
    correct = [rng.random() < (0.2 + 0.6 * (p > 0.5)) for p in raw]
    fitted = fit(raw, correct)
    assert fitted.method == ISOTONIC
    assert fitted.ece_after is not None and fitted.ece_after < 0.02


def test_isotonic_map_is_monotone() -> None:
    raw, correct = overconfident(2_000, 1.7)
    knots = fit_isotonic(raw, correct)
    assert all(b[1] >= a[1] for a, b in itertools.pairwise(knots))
    cal = Calibration(method=ISOTONIC, isotonic=knots)
    values = [cal.confidence(x / 100) for x in range(101)]
    assert values == sorted(values)


def test_calibrated_output_keeps_the_raw_confidence_under_its_own_name() -> None:
    cal = Calibration(temperature=2.0, choices_temperature=2.0)
    generated = calibrated_output(RowOutput(text="approve", decision="approve", confidence=0.9), cal, scored=False)
    assert generated.raw_confidence == 0.9
    assert generated.confidence == pytest.approx(_sigmoid(math.log(9) / 2))
    probs = {"approve": 0.8, "reject": 0.15, "review": 0.05}
    scored = calibrated_output(
        RowOutput(text="approve", decision="approve", confidence=0.8, choices=probs), cal, scored=True
    )
    assert scored.raw_confidence == 0.8
    assert scored.choices is not None and sum(scored.choices.values()) == pytest.approx(1.0)
    assert scored.confidence == scored.choices["approve"] < 0.8
    failed = RowOutput(error=ErrorInfo(type="timeout", message="x"))
    assert calibrated_output(failed, cal, scored=False) is failed
    plain = RowOutput(text="a", confidence=0.5)
    assert calibrated_output(plain, None, scored=False) is plain


CONFIG = """# a user's config: comments and other tables must survive
[base]
path = "base"   # local

[models.laya]
max_new_tokens = 8

[models.laya.escalation]
threshold = 0.7
max_chars = 300

# Kev's settings
[models.kev]
max_new_tokens = 96
"""


def test_a_config_written_by_calibrate_round_trips_through_the_loader(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(CONFIG)
    raw, correct = overconfident(1_000, 1.8)
    fitted = fit(raw, correct, fitted_on="heldout.jsonl, 1000 items")
    write_table(path, "models.laya.calibration", fitted.to_table(), comment="written by a test")
    loaded = load_config(path, check_paths=False)
    assert loaded.models["laya"].calibration == Calibration.from_table(fitted.to_table(), "t")
    assert loaded.models["laya"].calibration.temperature == pytest.approx(fitted.temperature, rel=1e-5)
    assert loaded.models["kev"].calibration is None
    assert loaded.models["kev"].max_new_tokens == 96 and loaded.models["laya"].escalation.max_chars == 300
    assert "# Kev's settings" in path.read_text() and "# local" in path.read_text()
    # Written again (a re-fit) it replaces the table instead of adding a second one.
    iso = Calibration(method=ISOTONIC, isotonic=((0.2, 0.1), (0.9, 0.8)), temperature=1.5)
    write_table(path, "models.laya.calibration", iso.to_table())
    assert path.read_text().count("[models.laya.calibration]") == 1
    assert load_config(path, check_paths=False).models["laya"].calibration == iso


def test_a_threshold_written_by_eval_round_trips_and_keeps_the_rest_of_the_rule(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(CONFIG)
    set_key(path, "models.laya.escalation", "threshold", 0.45)
    rule = load_config(path, check_paths=False).models["laya"].escalation
    assert rule is not None and rule.threshold == 0.45 and rule.max_chars == 300


def test_a_layout_the_writer_cannot_edit_fails_loudly(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[base]\npath = "b"\n[models.laya]\nescalation = { threshold = 0.7 }\n')
    with pytest.raises(ConfigError):
        set_key(path, "models.laya.escalation", "threshold", 0.45)
    assert "0.7" in path.read_text()  # untouched


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ("method = 'platt'", "method must be one of"),
        ("temperature = 0", "temperatures must be positive"),
        ("method = 'isotonic'", "needs 'isotonic' knots"),
        ("temprature = 1.2", "unknown key(s) ['temprature']"),
    ],
)
def test_invalid_calibration_table_names_the_problem(tmp_path: Path, table: str, fragment: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(f'[base]\npath = "b"\n[models.laya.calibration]\n{table}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, check_paths=False)
    assert fragment in str(info.value)


def test_the_engine_serves_calibrated_confidences_and_keeps_the_raw_ones(tiny_models: Path) -> None:
    from dataclasses import replace

    from shared.job import Job
    from tests.conftest import tiny_config
    from worker.engine import Engine

    config = tiny_config(tiny_models, "none")
    cal = Calibration(temperature=3.0, choices_temperature=3.0)
    calibrated = replace(config, models={**config.models, "laya": replace(config.models["laya"], calibration=cal)})
    jobs = [
        Job(custom_id="g", model="laya", prompt="a case", max_new_tokens=4),
        Job(custom_id="c", model="laya", prompt="a case", choices=("approve", "reject")),
        Job(custom_id="k", model="kev", prompt="a case", max_new_tokens=4),
    ]
    raw = Engine(config, device="cpu", decode="eager").run(jobs)
    served = Engine(calibrated, device="cpu", decode="eager").run(jobs)
    assert served[0].raw_confidence == raw[0].confidence
    assert served[0].confidence == pytest.approx(cal.confidence(raw[0].confidence))
    assert served[1].raw_confidence == raw[1].confidence
    assert served[1].choices == pytest.approx(cal.choices(raw[1].choices))
    assert served[2] == raw[2]  # Kev is not calibrated in this config: untouched
