"""`kevlaya eval`: accuracy of Laya alone, Kev alone and the cascade on a held-out split, the escalation
rate, Laya's calibration (reliability diagram + expected calibration error) and a threshold sweep.

The held-out JSONL has the training format (`prompt`, and the gold label under `category` or `label`).
A model's decision is its `decision` field (the line after "Decision:", or its first line), lower-cased.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from shared.job import Job
from worker.config import ModelsConfig
from worker.engine import Engine
from worker.escalation import escalation_reason

BINS = 10


@dataclass(frozen=True)
class Scored:
    gold: str
    laya: str | None
    laya_confidence: float
    laya_text: str
    kev: str | None


def read_heldout(path: Path) -> list[dict[str, Any]]:
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return [r for r in rows if isinstance(r.get("prompt"), str) and (r.get("label") or r.get("category"))]


def score(engine: Engine, rows: list[dict[str, Any]]) -> list[Scored]:
    """Both models on every item (the cascade is then computed for any threshold without re-running)."""
    laya = engine.run([Job(custom_id=str(i), model="laya", prompt=r["prompt"]) for i, r in enumerate(rows)])
    kev = engine.run([Job(custom_id=str(i), model="kev", prompt=r["prompt"]) for i, r in enumerate(rows)])
    return [
        Scored(
            gold=str(r.get("label") or r.get("category")).lower(),
            laya=_norm(lo.decision),
            laya_confidence=lo.confidence or 0.0,
            laya_text=lo.text or "",
            kev=_norm(ko.decision),
        )
        for r, lo, ko in zip(rows, laya, kev, strict=True)
    ]


def _norm(decision: str | None) -> str | None:
    return decision.strip().strip(".").lower() if decision else None


def cascade(items: list[Scored], config: ModelsConfig, threshold: float | None = None) -> tuple[float, float]:
    """(accuracy, escalation rate) of Laya escalating to Kev under the rule (or another threshold)."""
    rule = config.models["laya"].escalation
    correct = escalated = 0
    for it in items:
        reason = escalation_reason(
            rule, text=it.laya_text, confidence=it.laya_confidence, job_setting=threshold, batch_off=False
        )
        answer = it.kev if reason else it.laya
        escalated += reason is not None
        correct += answer == it.gold
    return correct / len(items), escalated / len(items)


def calibration(items: list[Scored]) -> tuple[float, list[dict[str, float]]]:
    """Expected calibration error of Laya's confidence, and the reliability-diagram bins."""
    bins = []
    ece = 0.0
    for b in range(BINS):
        lo, hi = b / BINS, (b + 1) / BINS
        members = [it for it in items if lo <= it.laya_confidence < hi or (b == BINS - 1 and it.laya_confidence == 1.0)]
        if not members:
            continue
        conf = sum(it.laya_confidence for it in members) / len(members)
        acc = sum(it.laya == it.gold for it in members) / len(members)
        ece += len(members) / len(items) * abs(acc - conf)
        bins.append({"low": lo, "high": hi, "n": len(members), "confidence": conf, "accuracy": acc})
    return ece, bins


def evaluate(engine: Engine, heldout: Path, out_dir: Path) -> dict[str, Any]:
    items = score(engine, read_heldout(heldout))
    n = len(items)
    acc, rate = cascade(items, engine.config)
    ece, bins = calibration(items)
    sweep = [
        {
            "threshold": t / 20,
            **dict(zip(("accuracy", "escalation_rate"), cascade(items, engine.config, t / 20 or None), strict=True)),
        }
        for t in range(1, 21)
    ]
    report = {
        "items": n,
        "laya": {"accuracy": sum(it.laya == it.gold for it in items) / n},
        "kev": {"accuracy": sum(it.kev == it.gold for it in items) / n},
        "cascade": {
            "accuracy": acc,
            "escalation_rate": rate,
            "threshold": engine.config.models["laya"].escalation.threshold,
        },
        "calibration": {"ece": ece, "bins": bins},
        "sweep": sweep,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    _plots(report, out_dir)
    report["plots"] = [str(out_dir / "reliability.png"), str(out_dir / "threshold-sweep.png")]
    return report


def _plots(report: dict[str, Any], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = report["calibration"]["bins"]
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "--", color="grey", lw=1)
    ax.bar([b["low"] + 0.05 for b in bins], [b["accuracy"] for b in bins], width=0.09, alpha=0.7, label="accuracy")
    ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], "o-", color="C1", label="per bin")
    ax.set_xlabel("Laya confidence")
    ax.set_ylabel("accuracy")
    ax.set_title(f"Laya reliability (ECE {report['calibration']['ece']:.3f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "reliability.png", dpi=90)
    plt.close(fig)
    sweep = report["sweep"]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot([s["escalation_rate"] for s in sweep], [s["accuracy"] for s in sweep], "o-")
    for s in sweep[::4]:
        ax.annotate(f"{s['threshold']:.2f}", (s["escalation_rate"], s["accuracy"]), fontsize=7)
    ax.axhline(report["laya"]["accuracy"], color="C2", ls=":", label="Laya alone")
    ax.axhline(report["kev"]["accuracy"], color="C3", ls=":", label="Kev alone")
    ax.set_xlabel("escalation rate")
    ax.set_ylabel("cascade accuracy")
    ax.set_title("threshold sweep")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "threshold-sweep.png", dpi=90)
    plt.close(fig)
