"""Which model's queue to drain next: a pure function, table-tested (tests/test_policy.py).

Stay on the current model while it has work, since every switch breaks a batch; switch when its queue is
empty, when another queue's oldest job has waited longer than `max_wait_ms` (no starvation), or when another
queue holds a full take while the current one does not (full batches are what make a GPU batch cheap per job).
Where neither holds a full take, a model whose unsure answers escalate into the current one goes first: its
take's follow-ups join the current queue, whose next take is then fuller (a partial Kev take served before
the last Laya take costs a second partial Kev take for that take's escalations: Kev's full answer length
decoded twice). For the same reason a full take of the model the current one escalates into does not call the
worker away from the current queue's rest (only its wait past `max_wait_ms` does): with Kev takes of 176 rows,
nightly-2000 switched to Kev with 176 Laya rows left, whose take (topped up with Kev's tail) and follow-ups cost
two more 128-step Kev decodes, 864 decode steps where 640 did.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueState:
    depth: int
    oldest_wait_ms: float  # how long the head job has waited (0 when unknown or empty)
    take: int = 0  # rows one take of this model holds (the engine's plan); 0: unknown, never counted as full

    @property
    def full(self) -> bool:
        return 0 < self.take <= self.depth


def choose_model(
    current: str | None,
    queues: Mapping[str, QueueState],
    *,
    max_wait_ms: float,
    escalates_to: Mapping[str, str | None] | None = None,
) -> str | None:
    """The model to serve next, or None when every queue is empty. `escalates_to`: each model's escalation
    target (the config's `escalates_to`), for the feeders-first rule."""
    waiting = {m: q for m, q in queues.items() if q.depth > 0}
    if not waiting:
        return None
    targets = escalates_to or {}
    starving = [m for m, q in waiting.items() if m != current and q.oldest_wait_ms > max_wait_ms]
    full = [m for m, q in waiting.items() if m != current and q.full]
    fed = targets.get(current) if current is not None else None
    calling = [m for m in full if m != fed]  # full takes that call the worker away from a partial one
    if current in waiting and not starving and (waiting[current].full or not calling):
        feeders = [m for m in waiting if m != current and targets.get(m) == current]
        if waiting[current].full or not feeders:
            return current
        return _first(feeders, waiting)
    return _first(starving or calling or full or list(waiting), waiting)


def _first(candidates: list[str], waiting: Mapping[str, QueueState]) -> str:
    # The longest-waiting head first; on a tie, the deeper queue (a bigger batch), then by name.
    return max(candidates, key=lambda m: (waiting[m].oldest_wait_ms, waiting[m].depth, m))
