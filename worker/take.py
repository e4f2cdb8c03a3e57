"""One take: up to the engine's capacity of one model's jobs, shared at a queue's tail with the idle workers
(worker.tail), taken atomically (worker.rqcompat), topped up with the small tails of models on the same base; or
one suspect group (worker.recovery), in turns with normal takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shared.keys import BULK, QueueRef
from worker.config import ModelsConfig
from worker.policy import QueueState
from worker.rqcompat import RQBridge
from worker.settings import WorkerSettings
from worker.settle import Row


@dataclass(frozen=True)
class Take:
    """What one take got: rows to run, or (`dead`) a suspect group to write off."""

    rows: list[Row]
    dead: bool = False
    # A normal take: the rows it could have held (its capacity, paced), before a peer's share of the queue's tail
    # was taken off; 0 for a suspect group.
    allowed: int = 0
    exec_id: str = ""  # the execution id its started entries carry


class Taker:
    """Takes jobs for the loop; `bulk_limit(model, capacity)` is the rows a bulk take may hold now (worker.pace).
    The tail of a queue is shared with the other workers between takes (worker.tail) inside the take itself."""

    def __init__(
        self,
        bridge: RQBridge,
        config: ModelsConfig,
        settings: WorkerSettings,
        *,
        bulk_limit: Callable[[str, int], int] = lambda model, capacity: capacity,
    ) -> None:
        self.bridge = bridge
        self.config = config
        self.settings = settings
        self.bulk_limit = bulk_limit
        self.suspect_turn = True  # suspect groups and normal takes alternate: neither waits behind the other

    def take(
        self,
        ref: QueueRef,
        states: dict[QueueRef, QueueState],
        *,
        capacity: int,
        suspects: int,
        queued: int,
        exec_id: str | None = None,
        ahead: bool = False,
    ) -> Take:
        """A suspect group, or up to `capacity` rows (the engine's rows per batch for this model, as the loop
        measured it this step) of this queue, paced when bulk, shared at a queue's tail. `exec_id`: the take's
        execution id, when the caller made it first; `ahead`: a take made while another runs (worker.ahead: it
        marks the id held before the take, and takes nothing while a peer is idle)."""
        exec_id = exec_id or self.bridge.begin_batch()
        ttl = self.settings.job_heartbeat_ttl_s
        group = None
        if suspects and (self.suspect_turn or not queued):
            group = self.bridge.take_group(ref, ttl_s=ttl, exec_id=exec_id)
        self.suspect_turn = group is None
        if group is not None:
            rows = [Row(ref.model, r, lane=ref.lane, exec_id=exec_id) for r in group.jobs]
            return Take(rows, dead=group.dead, exec_id=exec_id)
        if ref.lane == BULK:
            capacity = self.bulk_limit(ref.model, capacity)
        # The share is decided in the take's own script, from the queue and the idle set as they are then: decided
        # here, a peer taking in between would leave this take a stale depth and a peer counted idle though busy.
        live_s = self.settings.worker_ttl_s
        shared = self.bridge.take_share(ref, capacity, ttl_s=ttl, live_s=live_s, exec_id=exec_id, ahead=ahead)
        limit = shared.limit
        rows = [Row(ref.model, r, lane=ref.lane, exec_id=exec_id) for r in self.bridge.load(shared.ids)]
        for other in self._tail_queues(ref, len(rows), limit, states):
            room = limit - len(rows)
            taken = self.bridge.load(self.bridge.take(other, room, ttl_s=ttl, exec_id=exec_id))
            rows += [Row(other.model, r, lane=other.lane, exec_id=exec_id) for r in taken]
        return Take(rows, allowed=capacity, exec_id=exec_id)

    def _tail_queues(self, ref: QueueRef, n: int, limit: int, states: dict[QueueRef, QueueState]) -> list[QueueRef]:
        """The same lane of models on the same base whose whole queue fits the rest of this take, once this
        queue ends in it (a small tail): mixing them saves a switch for a few rows."""
        if not self.settings.mixed_tails or n >= limit or states[ref].depth > n:
            return []
        out, room = [], limit - n
        for other in self.config.names:
            tail = QueueRef(other, ref.lane)
            depth = states[tail].depth
            if other != ref.model and self.config.shares_base(ref.model, other) and 0 < depth <= room:
                out.append(tail)
                room -= depth
        return out
