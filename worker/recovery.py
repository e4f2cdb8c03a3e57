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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

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
