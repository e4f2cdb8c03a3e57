"""The PNGs of `kevlaya eval`, `kevlaya calibrate` and `kevlaya train`: reliability diagrams, the cascade's curve,
a training loss curve.
matplotlib is imported when a plot is drawn (it is a dev extra, and slow to import)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reliability_png(bins: list[dict[str, float]], ece: float, title: str, path: Path) -> Path:
    """Accuracy against confidence per bin: a calibrated model's bars sit on the diagonal."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], "--", color="grey", lw=1)
    ax.bar([b["low"] + 0.05 for b in bins], [b["accuracy"] for b in bins], width=0.09, alpha=0.7, label="accuracy")
    ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], "o-", color="C1", label="per bin")
    for b in bins:
        ax.annotate(str(b["n"]), (b["low"] + 0.05, 0.02), ha="center", fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("confidence (bin counts at the bottom)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{title} (ECE {ece:.3f})")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def curve_png(report: dict[str, Any], path: Path, *, screen: str, expert: str) -> Path:
    """Cascade accuracy against escalation rate as the threshold moves, the chosen threshold marked."""
    plt = _pyplot()
    curve = report["curve"]
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    ax.plot([p["escalation_rate"] for p in curve], [p["accuracy"] for p in curve], "-", lw=1.5, label="cascade")
    for p in curve[::10]:
        ax.annotate(f"{p['threshold']:.1f}", (p["escalation_rate"], p["accuracy"]), fontsize=7)
    ax.axhline(report[screen]["accuracy"], color="C2", ls=":", label=f"{screen} alone")
    ax.axhline(report[expert]["accuracy"], color="C3", ls=":", label=f"{expert} alone")
    chosen = report["cascade"]
    ax.plot(
        [chosen["escalation_rate"]], [chosen["accuracy"]], "o", color="C1", label=f"threshold {chosen['threshold']}"
    )
    ax.set_xlabel("escalation rate")
    ax.set_ylabel("cascade accuracy")
    ax.set_title("threshold curve (labels: threshold)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def loss_png(report: Any, path: Path) -> None:
    """A training run's loss per optimizer step (a TrainReport), its skipped steps marked in red."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(report.losses) + 1), report.losses, lw=1)
    for skipped in report.skipped_steps:
        ax.axvline(skipped["step"], color="red", alpha=0.3, lw=0.8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (target tokens)")
    ax.set_title(f"{report.model}: loss ({len(report.skipped_steps)} skipped steps)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
