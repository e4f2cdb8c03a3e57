"""Which lane to take from next: interactive work first, bulk never starved (pure; tests/test_lanes.py).

Each model has two queues, its `interactive` and `bulk` lanes. A take serves one lane:
- interactive work waiting anywhere is taken first, on its own: an interactive take holds no bulk rows, so
  it is as short as its own jobs (it never waits behind a bulk row's 512 tokens); interactive work is served
  *between* bulk takes, never by cutting one in flight (while it is live, bulk takes are shorter: worker.pace);
- the model is chosen within the lane by worker.policy (stay while it has work, no model starves);
- bulk is not starved: once `bulk_every_takes` takes in a row went to interactive work while bulk waited,
  the next take is bulk's. So under any interactive load bulk gets at least one take in every
  `bulk_every_takes + 1`.
The take in flight is never interrupted: an interactive job waits at most for it to end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shared.keys import BULK, INTERACTIVE, QueueRef
from worker.policy import QueueState, choose_model


def choose_queue(
    current: str | None,
    states: Mapping[QueueRef, QueueState],
    *,
    max_wait_ms: float,
    bulk_due: bool,
    escalates_to: Mapping[str, str | None] | None = None,
) -> QueueRef | None:
    """The queue to take from next, or None when every queue is empty. `current`: the model served last;
    `escalates_to`: each model's escalation target (worker.policy's feeders-first rule)."""
    interactive = {r.model: s for r, s in states.items() if r.lane == INTERACTIVE}
    bulk = {r.model: s for r, s in states.items() if r.lane == BULK}
    bulk_waits = any(s.depth > 0 for s in bulk.values())
    if any(s.depth > 0 for s in interactive.values()) and not (bulk_due and bulk_waits):
        model = choose_model(current, interactive, max_wait_ms=max_wait_ms, escalates_to=escalates_to)
        return None if model is None else QueueRef(model, INTERACTIVE)
    model = choose_model(current, bulk, max_wait_ms=max_wait_ms, escalates_to=escalates_to)
    return None if model is None else QueueRef(model, BULK)


@dataclass
class BulkTurn:
    """Counts the takes bulk was passed over for while it waited; bulk is due after `every` of them."""

    every: int
    passed: int = 0

    @property
    def due(self) -> bool:
        return self.passed >= self.every

    def record(self, served: QueueRef, *, bulk_waiting: bool) -> None:
        if served.lane == BULK:
            self.passed = 0
        elif bulk_waiting:
            self.passed += 1
