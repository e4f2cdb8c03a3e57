"""The cascade's arithmetic: accuracy and escalation rate at a threshold, the curve over thresholds, and
the threshold that meets a target. Pure functions over already-scored items (no engine), so any
threshold costs nothing to try.

An item escalates when the screening model's (calibrated) confidence is under the threshold, or when the
rest of its escalation rule fires (an unsure phrase, an overlong answer): exactly worker.escalation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from worker.config import EscalationRule
from worker.escalation import escalation_reason

GRID = 100  # the printed / plotted curve: thresholds 0.00, 0.01, ..., 1.00


@dataclass(frozen=True, kw_only=True)
class Item:
    """One held-out item answered by both models."""

    gold: str
    screen: str | None  # the screening model's (Laya's) decision
    confidence: float  # its confidence as served (calibrated when the config calibrates it)
    raw_confidence: float  # the model's own token probability
    text: str  # its answer text (the rule's phrases and length look at it)
    expert: str | None  # the expert's (Kev's) decision on the same input
    other_reason: bool = False  # the rule escalates it whatever the threshold (phrase, length)

    @property
    def screen_correct(self) -> bool:
        return self.screen == self.gold


@dataclass(frozen=True, kw_only=True)
class Point:
    threshold: float
    escalation_rate: float
    accuracy: float


@dataclass(frozen=True, kw_only=True)
class Pick:
    """The threshold chosen for a target, and whether the target was met."""

    point: Point
    target: str  # "escalation" | "accuracy"
    value: float
    met: bool


def with_rule(items: Sequence[Item], rule: EscalationRule | None) -> list[Item]:
    """Mark the items the rule escalates for reasons other than the threshold (phrases, length)."""
    if rule is None:
        return list(items)
    no_threshold = replace(rule, enabled=True, threshold=0.0)
    return [
        replace(
            it,
            other_reason=escalation_reason(
                no_threshold, text=it.text, confidence=it.confidence, job_setting=None, batch_off=False
            )
            is not None,
        )
        for it in items
    ]


def at(items: Sequence[Item], threshold: float) -> Point:
    """Cascade accuracy and escalation rate when answers under THRESHOLD go to the expert."""
    escalated = correct = 0
    for it in items:
        up = it.other_reason or it.confidence < threshold
        escalated += up
        correct += (it.expert if up else it.screen) == it.gold
    n = max(len(items), 1)
    return Point(threshold=threshold, escalation_rate=escalated / n, accuracy=correct / n)


def curve(items: Sequence[Item]) -> list[Point]:
    """The accuracy / escalation-rate curve on a 0.01 grid of thresholds."""
    return [at(items, t / GRID) for t in range(GRID + 1)]


def candidates(items: Sequence[Item]) -> list[float]:
    """Every threshold that changes the outcome: 0 (no escalation by confidence), each distinct confidence
    (escalates everything below it), and one above them all (everything), capped at 1 as the config is."""
    values = sorted({it.confidence for it in items})
    above = min(1.0, values[-1] + 1e-6) if values else 1.0
    return [0.0, *values, above]


def pick(
    items: Sequence[Item], *, target_escalation: float | None = None, target_accuracy: float | None = None
) -> Pick:
    """The threshold for a target escalation rate (the highest one escalating at most that share: the
    budget spent) or for a target accuracy (the lowest one reaching it: the fewest escalations).
    When the accuracy target cannot be reached, the most accurate threshold, marked not met."""
    if (target_escalation is None) == (target_accuracy is None):
        raise ValueError("give exactly one target: escalation rate or accuracy")
    points = [at(items, t) for t in candidates(items)]
    if target_escalation is not None:
        within = [p for p in points if p.escalation_rate <= target_escalation + 1e-12]
        best = max(within, key=lambda p: (p.escalation_rate, p.threshold)) if within else points[0]
        best = _readable(items, best)
        return Pick(point=best, target="escalation", value=target_escalation, met=bool(within))
    assert target_accuracy is not None
    reaching = [p for p in points if p.accuracy >= target_accuracy - 1e-12]
    if reaching:
        best = min(reaching, key=lambda p: (p.escalation_rate, p.threshold))
        return Pick(point=_readable(items, best), target="accuracy", value=target_accuracy, met=True)
    best = max(points, key=lambda p: (p.accuracy, -p.escalation_rate))
    return Pick(point=_readable(items, best), target="accuracy", value=target_accuracy, met=False)


def _readable(items: Sequence[Item], point: Point) -> Point:
    """The same cut with the shortest decimal threshold: any value above the next lower confidence and up
    to the chosen one escalates exactly the same items, so 0.6 is written instead of 0.60173..."""
    below = max((it.confidence for it in items if it.confidence < point.threshold), default=0.0)
    for digits in range(1, 7):
        scale = 10**digits
        value = math.floor(point.threshold * scale) / scale
        if below < value <= point.threshold or (point.threshold == 0.0 and value == 0.0):
            return replace(point, threshold=value)
    return point
