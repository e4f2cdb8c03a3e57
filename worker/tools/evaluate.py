"""`kevlaya eval` and `kevlaya calibrate`: run the models over labelled held-out items and measure.

eval: accuracy of the screening model (Laya) alone, the expert (Kev) alone and the cascade; Laya's
calibration (ECE of the raw and the served confidence, reliability PNGs); the accuracy / escalation-rate
curve over thresholds (PNG), and the threshold that meets a target (worker.tools.cascade).
calibrate: Laya's raw confidences against correctness, fitted (worker.calibration) and written into the
models config under `[models.NAME.calibration]`.

The held-out JSONL has the training format: `prompt` (or `input` fields), the gold label under `label` or
`category`, and optionally `choices` (then the screening model scores those labels instead of generating,
and its confidence is the normalised probability of the best one). A decision is compared lower-cased.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from shared.job import Job
from shared.models import MODEL_DEFAULTS
from worker.calibration import Calibration, fit, reliability
from worker.config import ModelsConfig
from worker.engine import Engine
from worker.outputs import RowOutput
from worker.tools import cascade, plots

# The screening model and the one it escalates to (Laya -> Kev): models are data, not names in code.
SCREEN, EXPERT = next((name, d.escalates_to) for name, d in MODEL_DEFAULTS.items() if d.escalates_to)
MAX_CHOICES = 32


@dataclass(frozen=True, kw_only=True)
class Heldout:
    """One labelled item."""

    job_fields: dict[str, Any]  # prompt / input
    gold: str
    choices: tuple[str, ...] | None


def read_heldout(path: Path, *, as_choices: bool = False) -> list[Heldout]:
    """Labelled rows of PATH. as_choices: rows without their own `choices` are scored among the file's
    distinct gold labels (2..32 of them), so choice-mode confidence can be measured and calibrated too."""
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    rows = [r for r in rows if isinstance(r, dict) and (r.get("label") or r.get("category"))]
    rows = [r for r in rows if isinstance(r.get("prompt"), str) or isinstance(r.get("input"), dict)]
    labels = tuple(sorted({_norm(str(r.get("label") or r.get("category"))) or "" for r in rows}))
    default = labels if as_choices and 2 <= len(labels) <= MAX_CHOICES else None
    return [
        Heldout(
            job_fields={k: r[k] for k in ("prompt", "input") if k in r},
            gold=_norm(str(r.get("label") or r.get("category"))) or "",
            choices=tuple(r["choices"]) if isinstance(r.get("choices"), list) else default,
        )
        for r in rows
    ]


def run_model(engine: Engine, model: str, rows: list[Heldout], *, choices: bool = True) -> list[RowOutput]:
    """One batch call: every row as a job of MODEL (choice rows scored when `choices`)."""
    jobs = [
        Job(custom_id=str(i), model=model, choices=r.choices if choices else None, **r.job_fields)
        for i, r in enumerate(rows)
    ]
    return engine.run(jobs)


def score(engine: Engine, rows: list[Heldout]) -> list[cascade.Item]:
    """Both models on every item (the cascade is then computed for any threshold without re-running)."""
    screen = run_model(engine, SCREEN, rows)
    expert = run_model(engine, EXPERT, rows, choices=False)
    items = [
        cascade.Item(
            gold=r.gold,
            screen=_norm(s.decision),
            confidence=s.confidence or 0.0,
            raw_confidence=_raw(s),
            text=s.text or "",
            expert=_norm(e.decision),
        )
        for r, s, e in zip(rows, screen, expert, strict=True)
    ]
    return cascade.with_rule(items, engine.config.models[SCREEN].escalation)


def calibration_report(confidences: list[float], raw: list[float], correct: list[bool]) -> dict[str, Any]:
    before, bins_before = reliability(raw, correct)
    after, bins_after = reliability(confidences, correct)
    return {
        "ece_before": before,
        "ece_after": after,
        "bins_before": [b.__dict__ for b in bins_before],
        "bins_after": [b.__dict__ for b in bins_after],
    }


def evaluate(
    engine: Engine,
    heldout: Path,
    out_dir: Path,
    *,
    target_escalation: float | None = None,
    target_accuracy: float | None = None,
) -> dict[str, Any]:
    """The report `kevlaya eval` prints (and `--json` dumps)."""
    items = score(engine, read_heldout(heldout))
    n = max(len(items), 1)
    rule = engine.config.models[SCREEN].escalation
    calibration = engine.config.models[SCREEN].calibration
    report: dict[str, Any] = {
        "items": len(items),
        "data": str(heldout),
        SCREEN: {"accuracy": sum(it.screen_correct for it in items) / n},
        EXPERT: {"accuracy": sum(it.expert == it.gold for it in items) / n},
        "calibration": {
            "method": calibration.method if calibration else None,
            **calibration_report(
                [it.confidence for it in items],
                [it.raw_confidence for it in items],
                [it.screen_correct for it in items],
            ),
        },
    }
    threshold = rule.threshold if rule else 0.0
    if target_escalation is not None or target_accuracy is not None:
        chosen = cascade.pick(items, target_escalation=target_escalation, target_accuracy=target_accuracy)
        threshold = chosen.point.threshold
        report["target"] = {"kind": chosen.target, "value": chosen.value, "met": chosen.met}
    point = cascade.at(items, threshold)
    report["threshold"] = threshold
    report["cascade"] = {"accuracy": point.accuracy, "escalation_rate": point.escalation_rate, "threshold": threshold}
    report["curve"] = [p.__dict__ for p in cascade.curve(items)]
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = [
        *reliability_pngs(report["calibration"], SCREEN, out_dir),
        str(plots.curve_png(report, out_dir / "threshold-curve.png", screen=SCREEN, expert=EXPERT)),
    ]
    return report


def reliability_pngs(summary: dict[str, Any], model: str, out_dir: Path) -> list[str]:
    """MODEL's reliability diagrams of the raw and the calibrated confidence."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        str(plots.reliability_png(summary[f"bins_{when}"], summary[f"ece_{when}"], f"{model} {label}", path))
        for when, label, path in (
            ("before", "raw", out_dir / f"{model}-reliability-before.png"),
            ("after", "calibrated", out_dir / f"{model}-reliability-after.png"),
        )
    ]


def uncalibrated(config: ModelsConfig) -> ModelsConfig:
    """The config with every model's calibration off: a fit must see the models' own probabilities."""
    return replace(config, models={name: replace(spec, calibration=None) for name, spec in config.models.items()})


def calibrate(engine: Engine, model: str, heldout: Path, *, method: str = "auto") -> tuple[Calibration, dict[str, Any]]:
    """Fit MODEL's calibration on HELDOUT. The engine must serve raw confidences (`uncalibrated`).
    Generation confidences fit the temperature (or isotonic map); every row is also scored among its
    choices (or the file's labels), which fits the choice-mode temperature."""
    if engine.config.models[model].calibration is not None:
        raise ValueError("calibrate needs an engine serving raw confidences: Engine(uncalibrated(config))")
    rows = read_heldout(heldout, as_choices=True)
    generated = run_model(engine, model, rows, choices=False)
    scored = run_model(engine, model, [r for r in rows if r.choices], choices=True)
    raw = [_raw(o) for o in generated]
    correct = [_norm(o.decision) == r.gold for o, r in zip(generated, rows, strict=True)]
    fitted = fit(
        raw,
        correct,
        method=method,
        choice_distributions=[{_norm(k): p for k, p in (o.choices or {}).items()} for o in scored],
        choice_gold=[r.gold for r in rows if r.choices],
        fitted_on=f"{heldout.name}, {len(rows)} items",
    )
    summary = calibration_report([fitted.confidence(p) for p in raw], raw, correct)
    return fitted, {"items": len(rows), "accuracy": sum(correct) / max(len(rows), 1), **summary}


def check(engine: Engine, model: str, heldout: Path, calibration: Calibration | None = None) -> dict[str, Any]:
    """MODEL's calibration on HELDOUT (a split not used for fitting): ECE of the raw confidence and of the
    calibrated one: CALIBRATION applied to the raw, or else the confidence the engine serves."""
    rows = read_heldout(heldout)
    outputs = run_model(engine, model, rows, choices=False)
    correct = [_norm(o.decision) == r.gold for o, r in zip(outputs, rows, strict=True)]
    raw = [_raw(o) for o in outputs]
    served = [calibration.confidence(p) for p in raw] if calibration else [o.confidence or 0.0 for o in outputs]
    return {"items": len(rows), "data": str(heldout), **calibration_report(served, raw, correct)}


def _raw(out: RowOutput) -> float:
    raw = out.raw_confidence if out.raw_confidence is not None else out.confidence
    return raw or 0.0


def _norm(decision: str | None) -> str | None:
    return decision.strip().strip(".").lower() if decision else None
