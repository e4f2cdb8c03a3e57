"""Which model's queue to drain next: a pure function, table-tested (tests/test_policy.py).

Stay on the current model while it has work, since every switch breaks a batch; switch when its queue is
empty, when another queue's oldest job has waited longer than `max_wait_ms` (no starvation), or when another
queue holds a full take while the current one does not (full batches are what make a GPU batch cheap per job).
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


def choose_model(current: str | None, queues: Mapping[str, QueueState], *, max_wait_ms: float) -> str | None:
    """The model to serve next, or None when every queue is empty."""
    waiting = {m: q for m, q in queues.items() if q.depth > 0}
    if not waiting:
        return None
    starving = [m for m, q in waiting.items() if m != current and q.oldest_wait_ms > max_wait_ms]
    full = [m for m, q in waiting.items() if m != current and q.full]
    if current in waiting and not starving and (waiting[current].full or not full):
        return current
    candidates = starving or full or list(waiting)
    # The longest-waiting head first; on a tie, the deeper queue (a bigger batch), then by name.
    return max(candidates, key=lambda m: (waiting[m].oldest_wait_ms, waiting[m].depth, m))
