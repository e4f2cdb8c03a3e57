"""Host work off the GPU's path: while the engine runs one take, a helper thread writes the take before it and
takes the next one ahead (taken, triaged, encoded), so the GPU waits for neither.

Between two takes the GPU sat idle ~75 ms on the H200 machine (600 choice jobs, two takes): results built and
written, the queues looked at, the next jobs taken, triaged and encoded. The helper does all of that except the
look at the queues and the memory (the loop's own step decides, as before, what runs next: a take made ahead
that it does not want is given back to the front of its queue).

Crash accounting stays exact. The jobs of a take answered but not yet written (from the moment its write is
deferred), and of a take made ahead (once triaged and encoded: a job that crashes that host code is charged like
any poison job), are in this worker's hands but not on its GPU: their execution ids are in its held set
(`Keys.held`) until they are written or start to run, and recovery returns a dead worker's held jobs to their
queue without counting a crash against them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from shared.keys import QueueRef
from worker.settle import Row, Triage
from worker.take import Take

T = TypeVar("T")

# How often the helper looks at the queue while waiting for jobs to take ahead (two round trips a look).
AHEAD_POLL_S = 0.01


@dataclass(frozen=True)
class InHand:
    """Jobs of one take in this worker's hands: their queue, the take's execution id, their ids (heartbeats keep
    their started entries alive; recovery leaves them alone)."""

    ref: QueueRef
    exec_id: str
    ids: tuple[str, ...]


def in_hand(rows: Sequence[Row]) -> list[InHand]:
    """Rows grouped by queue and take."""
    groups: dict[tuple[QueueRef, str], list[str]] = {}
    for row in rows:
        groups.setdefault((row.ref, row.exec_id or ""), []).append(row.raw.id)
    return [InHand(ref, exec_id, tuple(ids)) for (ref, exec_id), ids in groups.items()]


def exec_ids(rows: Sequence[Row]) -> list[str]:
    """The execution ids of these rows' takes."""
    return sorted({row.exec_id for row in rows if row.exec_id})


@dataclass(frozen=True)
class Prepared:
    """A take ready for the engine: taken, triaged (its settled rows written), its runnable rows encoded."""

    take: Take
    ref: QueueRef  # the queue it was taken for
    triage: Triage | None  # None: a suspect group to write off
    encoded: Any  # the engine's `prepare` of the runnable jobs (None: the engine encodes them itself)
    # The loop thread's time triaging it (its settled rows written, its jobs encoded): 0 when made ahead.
    triage_s: float
    ahead: bool = False  # made while another take ran: its execution id is in the held set until it runs
    take_s: float = 0.0  # the loop thread's time taking it (or fitting the take made ahead), triage aside

    @property
    def rows(self) -> list[Row]:
        return self.take.rows


@dataclass(frozen=True)
class Answered:
    """A take the engine answered, still to be written: its triage and the engine's outputs (index-aligned with
    its runnable rows), made into result rows by whoever writes them."""

    triage: Triage
    outputs: list[Any]
    engine_s: float

    @property
    def rows(self) -> list[Row]:
        return self.triage.runnable


class Helper(Generic[T]):
    """One helper thread running one piece of work at a time; `boundary` tells it the take it overlaps is over."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kevlaya-ahead")
        self._work: Future[T] | None = None
        self.boundary = threading.Event()
        # Set once the loop's thread waits for the GPU (the engine's `on_gpu_wait`), or at the boundary: the
        # helper's Python waits for it. Run while the loop's thread queues a prefill's kernels one by one, it held
        # the GIL that thread needs between two launches: nightly-2000's prefill took 4.2 s instead of 3.2.
        self.go = threading.Event()

    def start(self, fn: Callable[[], T]) -> None:
        assert self._work is None, "the helper's last work was not joined"
        self.boundary.clear()
        self.go.clear()
        self._work = self._pool.submit(fn)

    def release(self) -> None:
        """The loop's thread waits for the GPU now: the helper may run."""
        self.go.set()

    def join(self) -> T | None:
        """What the work returned (None: no work); raises what it raised."""
        work, self._work = self._work, None
        if work is None:
            return None
        self.boundary.set()
        self.go.set()
        return work.result()

    def close(self) -> None:
        """Waits for work under way, without its result (the loop is ending)."""
        self.boundary.set()
        self.go.set()
        self._pool.shutdown(wait=True)
        self._work = None
