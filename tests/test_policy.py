"""The batching policy, table-driven: stay while there is work, switch when empty, starving, or the other
queue holds a full take and this one does not."""

from __future__ import annotations

import pytest

from worker.policy import QueueState, choose_model

Q = QueueState


@pytest.mark.parametrize(
    ("current", "kev", "laya", "expected"),
    [
        (None, Q(0, 0), Q(0, 0), None),
        (None, Q(5, 10), Q(0, 0), "kev"),
        (None, Q(5, 10), Q(9, 500), "laya"),  # first pick: the oldest head
        ("laya", Q(5, 900), Q(9, 50), "laya"),  # stay: kev has waited, but not over max_wait
        ("laya", Q(5, 1500), Q(9, 50), "kev"),  # kev's head waited over max_wait: switch
        ("laya", Q(5, 10), Q(0, 0), "kev"),  # current empty: switch
        ("kev", Q(1, 0), Q(1000, 999), "kev"),  # a deep queue alone does not force a switch
        ("kev", Q(0, 0), Q(0, 0), None),
        (None, Q(3, 100), Q(7, 100), "laya"),  # tie on age: the deeper queue
        ("kev", Q(5, 10, take=64), Q(200, 50, take=256), "kev"),  # laya deep, but not a full take: stay
        ("kev", Q(5, 10, take=64), Q(300, 50, take=128), "laya"),  # laya holds a full take, kev does not: switch
        ("kev", Q(64, 10, take=64), Q(300, 50, take=128), "kev"),  # both full: no reason to switch
        ("kev", Q(5, 10), Q(300, 50), "kev"),  # takes unknown: never counted as full
    ],
)
def test_choose_model(current, kev, laya, expected) -> None:
    assert choose_model(current, {"kev": kev, "laya": laya}, max_wait_ms=1000) == expected


def test_never_starves_under_constant_load() -> None:
    """Simulated: laya always has fresh work; kev's single job must still be served once it waits."""
    current, waited = "laya", 0.0
    for _ in range(100):
        current = choose_model(current, {"kev": Q(1, waited), "laya": Q(500, 10)}, max_wait_ms=1000)
        if current == "kev":
            break
        waited += 200
    assert current == "kev" and waited <= 1200
