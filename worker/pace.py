"""Bulk takes paced for interactive work: short while interactive jobs are live, full batches otherwise.

An interactive job that arrives while a bulk take runs waits for that take to end (a take is never cut), so its
latency is about what is left of the bulk take plus its own. A full bulk take costs ~1 s on the capped H200:
too long to promise ~1 s. Interactive jobs arrive at any moment, so the next bulk take cannot be planned
around one that is not there yet; what can be known is that interactive work is *live*: one was seen in the
last `window_s`. While it is, each bulk take is sized to finish in about `take_s`; once the window passes
with none, takes are full again (a bulk-only run never pays for this).

The size comes from what takes measured, not from a cost model: a take's seconds are roughly fixed costs plus
a per-row part, and both change with prompt lengths, answer lengths and the card. Each spell of live
interactive work starts from the model's last full take scaled to the target; after each paced take the
estimate moves by the ratio of the target to the time it took (damped, so one slow take -- one that captured
a graph -- moves it at most 1.4x). The estimate itself is kept unrounded: the limit handed out is rounded to a
step, and feeding the rounded rows back would stick at a step the damped ratio cannot leave. Rows never fall
below `min_fraction` of a full take: a batch of a few rows costs nearly what a full one does, and bulk would
crawl. Times are monotonic seconds (a wall clock stepped back would keep pacing on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Paced limits are multiples of an eighth of a full take: the limit moves take by take, and each new row count
# can mean a new decode graph (captured, its buffers held); coarse steps keep paced takes on one or two graphs.
PACE_STEPS = 8


@dataclass(frozen=True)
class TakeTime:
    """One finished bulk take: its rows and the seconds from its first row run to its last result written."""

    rows: int
    seconds: float


@dataclass
class BulkPace:
    """Row limits for bulk takes while interactive work is live (`take_s` or `window_s` 0: never paced)."""

    take_s: float
    window_s: float
    min_fraction: float = 0.25
    last_interactive_at: float = field(default=-math.inf, init=False)
    _estimate: dict[str, float] = field(default_factory=dict, init=False)  # per model: rows making `take_s`
    _full: dict[str, TakeTime] = field(default_factory=dict, init=False)  # per model: its last full take

    def saw_interactive(self, now: float) -> None:
        if not self.live(now):
            self._estimate.clear()  # a new spell: start again from the last full take
        self.last_interactive_at = now

    def live(self, now: float) -> bool:
        return self.take_s > 0 and self.window_s > 0 and now - self.last_interactive_at <= self.window_s

    def limit(self, model: str, capacity: int, now: float) -> int:
        """Rows for this model's next bulk take: `capacity` unless interactive work is live."""
        if not self.live(now):
            return capacity
        rows = self._estimate.get(model)
        if rows is None:
            full = self._full.get(model)
            if full is None:
                return capacity  # nothing measured yet: this take measures
            rows = full.rows * self.take_s / full.seconds
        step = max(1, capacity // PACE_STEPS)
        return max(self._floor(capacity), min(capacity, round(rows / step) * step))

    def record(self, model: str, took: TakeTime, *, allowed: int, paced: bool) -> None:
        """A bulk take of `model` alone finished: it was allowed `allowed` rows (sized by `limit` when `paced`).
        A take the queue's end (or a peer sharing it) cut short says little about a full one: not counted."""
        if took.rows <= 0 or took.seconds <= 0 or allowed <= 0 or took.rows < 0.9 * allowed:
            return
        if not paced:
            self._full[model] = took
            return
        ratio = min(2.0, max(0.5, self.take_s / took.seconds)) ** 0.5
        estimate = self._estimate.get(model, float(took.rows)) * ratio
        # Kept near what a take can be, so a run of fast (or slow) takes does not wind it up past recovery: at most
        # one damped step above the rows this take was allowed.
        self._estimate[model] = min(max(estimate, self._floor(allowed)), allowed * 2**0.5)

    def _floor(self, capacity: int) -> int:
        return max(1, math.ceil(capacity * self.min_fraction))
