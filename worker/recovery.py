"""What to do with the jobs of a worker that died while running them: a pure function, table-tested.

A worker that dies mid-batch cannot say which job killed it. The jobs it was running come back as one
group; every crash of a group splits it in halves, so a job that kills the worker every time is alone
after ceil(log2 n) crashes and is dead-lettered when it kills the worker once more running alone: a poison
job in a 256-row batch costs at most 9 crashes, and every other job of its batch is answered. A crash that
had nothing to do with the jobs (an operator's `kill -9`, a lost machine) costs one re-run of the batch as
two halves. A job that ran alone when its worker died is re-run alone once more before it is given up,
so one unlucky crash never fails an innocent job that was taken alone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.exceptions
from redis import Redis

from shared.keys import Keys, QueueRef
from shared.store import trim_indexes
from worker.notices import return_notices

if TYPE_CHECKING:
    from worker.rqcompat import Abandoned, RQBridge
    from worker.stats import WorkerStats

log = logging.getLogger("kevlaya.worker")

WORKER_INDEX_AGE_S = 86400  # workers unseen this long leave the `kevlaya status` index
STUCK_INTERMEDIATE_S = 30  # an id this long in RQ's intermediate list was left there by a stock worker

# A job is dead-lettered when its worker dies while running it alone and it has crashed this often.
MAX_CRASHES_ALONE = 2


@dataclass(frozen=True)
class SuspectGroup:
    """Jobs to run again together as one batch; `dead` groups are written off (`worker_died`) instead."""

    ids: tuple[str, ...]
    dead: bool = False


def plan_recovery(ids: Sequence[str], crashes: Mapping[str, int]) -> list[SuspectGroup]:
    """The groups a dead worker's jobs go back as. `ids` are the jobs one dead take was running, in take
    order; `crashes` counts, per job, the crashes it has been part of, this one included."""
    if not ids:
        return []
    if len(ids) == 1:
        (only,) = ids
        return [SuspectGroup((only,), dead=crashes.get(only, 1) >= MAX_CRASHES_ALONE)]
    half = (len(ids) + 1) // 2
    return [SuspectGroup(tuple(ids[:half])), SuspectGroup(tuple(ids[half:]))]


def max_crashes(batch_rows: int) -> int:
    """The most crashes one poison job can cause in a batch of `batch_rows` (README, "Guarantees")."""
    crashes, size = 1, batch_rows
    while size > 1:
        size = (size + 1) // 2
        crashes += 1
    return max(crashes, MAX_CRASHES_ALONE)


class RecoveryPass:
    """One sweep over the started registries: what dead workers left goes back as suspect groups, what we
    lost track of goes back to its queue, stuck intermediate entries are requeued, indexes are trimmed."""

    def __init__(self, redis: Redis, keys: Keys, bridge: RQBridge, models: Sequence[str], stats: WorkerStats) -> None:
        self.redis = redis
        self.keys = keys
        self.bridge = bridge
        self.models = models
        self.stats = stats

    def run(self, *, in_flight: set[str], others: bool, batch_ttl_s: float) -> None:
        for ref in self.bridge.refs:  # every lane of every model: recovered work keeps its lane
            entries = self.bridge.abandoned(ref, in_flight=in_flight, others=others)
            self.bridge.requeue_lost(ref, [e for e in entries if not e.crashed])
            takes: dict[str, list[Abandoned]] = {}
            for e in entries:
                if e.crashed:
                    takes.setdefault(e.exec_id, []).append(e)
            for dead_take in takes.values():
                self._recover_take(ref, dead_take)
            self.stats.recovered += len(self.bridge.unstick_intermediate(ref, older_than_s=STUCK_INTERMEDIATE_S))
        self.bridge.prune_held()
        self._return_dead_senders_notices()
        self.bridge.cleanup_registries()
        trim_indexes(self.redis, self.keys, batch_age_s=batch_ttl_s, worker_age_s=WORKER_INDEX_AGE_S)
        self.stats.quarantined = self.bridge.quarantine.count

    def _return_dead_senders_notices(self) -> None:
        try:
            senders = self.redis.smembers(self.keys.notice_senders())
        except redis.exceptions.ResponseError:
            return
        for raw in senders:
            name = raw.decode("utf-8", "replace")
            if not self.bridge.worker_alive(name):
                if return_notices(self.redis, self.keys, name):
                    log.warning("returned the notice worker %s was sending when it died", name)
                self.redis.srem(self.keys.notice_senders(), raw)

    def _recover_take(self, ref: QueueRef, entries: list[Abandoned]) -> None:
        ids = [e.job_id for e in entries]
        crashes = {i: c + 1 for i, c in self.bridge.crash_counts(ids).items()}
        groups = plan_recovery(ids, crashes)
        if self.bridge.to_suspects(ref, entries, crashes, groups):
            self.stats.recovered += len(ids)
            self.stats.crashes_survived += 1
            log.warning(
                "recovered %d job(s) of a dead worker as %s",
                len(ids),
                " + ".join(("dead " if g.dead else "") + str(len(g.ids)) for g in groups),
            )
