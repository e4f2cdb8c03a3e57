"""The cascade's arithmetic: a threshold picked for a target meets it on the data it was picked on."""

from __future__ import annotations

import random

import pytest

from worker.config import EscalationRule
from worker.tools import cascade


def items(n: int = 500, *, seed: int = 0) -> list[cascade.Item]:
    """A screening model right with probability = its confidence, an expert right 90% of the time."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        conf = round(rng.uniform(0.3, 1.0), 3)  # rounded: ties between items, as real confidences have
        screen_right = rng.random() < conf
        out.append(
            cascade.Item(
                gold="a",
                screen="a" if screen_right else "b",
                confidence=conf,
                raw_confidence=conf,
                text="a",
                expert="a" if rng.random() < 0.9 else "b",
            )
        )
    return out


@pytest.mark.parametrize("target", [0.0, 0.05, 0.2, 0.3, 0.5, 1.0])
def test_threshold_for_a_target_escalation_rate_meets_it(target: float) -> None:
    data = items()
    chosen = cascade.pick(data, target_escalation=target)
    assert chosen.met
    measured = cascade.at(data, chosen.point.threshold)
    assert measured == chosen.point
    assert measured.escalation_rate <= target
    # The budget is spent: also escalating the least confident answer kept would exceed the target.
    kept = [it.confidence for it in data if it.confidence >= chosen.point.threshold]
    if kept and min(kept) < 1.0:  # a threshold is at most 1: answers of confidence 1 never escalate by it
        assert cascade.at(data, min(kept) + 1e-9).escalation_rate > target


def test_threshold_for_a_target_accuracy_is_the_cheapest_reaching_it() -> None:
    data = items()
    chosen = cascade.pick(data, target_accuracy=0.85)
    assert chosen.met and cascade.at(data, chosen.point.threshold).accuracy >= 0.85
    cheaper = [t for t in cascade.candidates(data) if t < chosen.point.threshold]
    assert all(cascade.at(data, t).accuracy < 0.85 for t in cheaper)


def test_an_unreachable_accuracy_is_reported_not_met() -> None:
    chosen = cascade.pick(items(), target_accuracy=0.999)
    assert not chosen.met
    data = items()
    assert chosen.point.accuracy == max(cascade.at(data, t).accuracy for t in cascade.candidates(data))


def test_picked_threshold_is_a_short_decimal_with_the_same_cut() -> None:
    data = items()
    chosen = cascade.pick(data, target_escalation=0.2)
    assert len(repr(chosen.point.threshold)) <= 6  # e.g. 0.511, not 0.51137...


def test_rule_phrases_escalate_whatever_the_threshold() -> None:
    unsure = cascade.Item(gold="a", screen="b", confidence=0.99, raw_confidence=0.99, text="not sure", expert="a")
    sure = cascade.Item(gold="a", screen="a", confidence=0.99, raw_confidence=0.99, text="a", expert="b")
    marked = cascade.with_rule([unsure, sure], EscalationRule())
    assert cascade.at(marked, 0.0) == cascade.Point(threshold=0.0, escalation_rate=0.5, accuracy=1.0)
    assert len(cascade.curve(marked)) == cascade.GRID + 1
