"""The batching policy, table-driven: stay while there is work, switch when empty, starving, or the other
queue holds a full take and this one does not."""

from __future__ import annotations

import pytest

from worker.policy import QueueState, choose_model
from worker.settings import WorkerSettings

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


CASCADE = {"laya": "kev", "kev": None}


@pytest.mark.parametrize(
    ("current", "kev", "laya", "expected"),
    [
        # Neither full: laya's take escalates into kev's queue, so it goes first and kev's next take is fuller.
        ("kev", Q(107, 10, take=160), Q(176, 50, take=256), "laya"),
        ("kev", Q(107, 10, take=160), Q(1, 0, take=256), "laya"),
        ("laya", Q(107, 10, take=160), Q(176, 50, take=256), "laya"),  # laya feeds kev, not the other way
        ("kev", Q(160, 10, take=160), Q(176, 50, take=256), "kev"),  # kev holds a full take: stay
        ("kev", Q(107, 1500, take=160), Q(176, 50, take=256), "laya"),  # kev's own wait never keeps it
        ("kev", Q(107, 10, take=160), Q(0, 0, take=256), "kev"),  # nothing to feed kev: stay
        ("laya", Q(107, 1500, take=160), Q(176, 50, take=256), "kev"),  # kev starving: served whatever feeds it
        ("kev", Q(107, 10, take=160), Q(300, 50, take=256), "laya"),  # laya full: the old rule already switched
        # Kev's full take waits for laya's rest, whose escalations join it; not past max_wait, not when empty.
        ("laya", Q(200, 10, take=176), Q(176, 50, take=256), "laya"),
        ("laya", Q(200, 1500, take=176), Q(176, 50, take=256), "kev"),
        ("laya", Q(200, 10, take=176), Q(0, 0, take=256), "kev"),
        ("laya", Q(200, 10, take=176), Q(300, 50, take=256), "laya"),
    ],
)
def test_feeders_first(current, kev, laya, expected) -> None:
    got = choose_model(current, {"kev": kev, "laya": laya}, max_wait_ms=1000, escalates_to=CASCADE)
    assert got == expected


def test_feeders_first_saves_a_partial_take() -> None:
    """Simulated drain of a cascade (laya escalates a quarter into kev; takes of 256 laya / 170 kev rows):
    feeders first, kev's 500 follow-ups run in the fewest takes (3), where staying on a partial kev take
    spent a fourth on the last laya take's escalations."""

    def drain(escalates_to):
        depth, current, kev_takes, waited = {"laya": 2000, "kev": 0}, None, 0, 0.0
        take = {"laya": 256, "kev": 170}
        while depth["laya"] or depth["kev"]:
            queues = {m: Q(depth[m], waited if depth[m] else 0.0, take=take[m]) for m in depth}
            current = choose_model(current, queues, max_wait_ms=1e9, escalates_to=escalates_to)
            n = min(take[current], depth[current])
            depth[current] -= n
            if current == "laya":
                depth["kev"] += n // 4
            kev_takes += current == "kev"
            waited += 1
        return kev_takes

    assert drain(CASCADE) == 3
    assert drain(None) == 4


@pytest.mark.parametrize("kev_take", [96, 128, 160, 176, 208, 256])
@pytest.mark.parametrize("share", [0.1, 0.238, 0.4])
def test_a_cascade_drains_in_the_fewest_target_takes_whatever_the_take_sizes(kev_take: int, share: float) -> None:
    """Simulated drain of 2,000 laya rows (takes of 288, then 256; 0.6 s a take) with a share escalating into
    kev (1.2 s a take), under the worker's default max wait (10 s): kev runs ceil(follow-ups / its take) takes
    whatever its take size."""
    heads: dict[str, list[float]] = {"laya": [0.0] * 2000, "kev": []}  # each queued row's enqueue time
    take, cost = {"laya": 288, "kev": kev_take}, {"laya": 0.6, "kev": 1.2}
    now, current, kev_takes, escalated = 0.0, None, 0, 0
    while heads["laya"] or heads["kev"]:
        queues = {
            m: Q(len(q), (now - q[0]) * 1000 if q else 0.0, take=take[m]) for m, q in heads.items()
        }  # fmt: skip
        current = choose_model(current, queues, max_wait_ms=WorkerSettings().max_wait_ms, escalates_to=CASCADE)
        n = min(take[current], len(heads[current]))
        del heads[current][:n]
        now += cost[current]
        if current == "laya":
            follow = round((2000 - len(heads["laya"])) * share) - escalated
            heads["kev"] += [now] * follow
            escalated += follow
            take["laya"] = 256
        kev_takes += current == "kev"
    assert kev_takes == -(-escalated // kev_take)
