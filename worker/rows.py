"""A batch's rows as the engine runs them: a job encoded as one row (`Item`), and what running a sub-batch of
rows on one resident base needs besides the rows (`BaseCall`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.job import Job
from worker.loading import LoadedBase, select_adapters

if TYPE_CHECKING:
    import torch

FaultHook = Callable[[str, int], None]  # (phase, rows): lets tests inject faults


@dataclass(frozen=True)
class Item:
    """One job encoded: its place in the engine's batch, its prompt's token ids, its own new-token limit and the
    adapter that serves its model (None: the bare base)."""

    index: int
    job: Job
    ids: list[int]
    max_new: int
    adapter: str | None


@dataclass(frozen=True, kw_only=True)
class BaseCall:
    """What one generation or scoring call on one base needs besides its rows."""

    base: LoadedBase
    device: torch.device
    stop_ids: list[int]  # the first one ends an answer (a scored choice ends with it too)
    deadline: float | None  # time.monotonic() after which generation stops
    fault: FaultHook

    def adapters(self, rows: Sequence[str | None]) -> contextlib.AbstractContextManager[dict[str, Any]]:
        """The adapter selection for rows of these adapter names (see `select_adapters`)."""
        return select_adapters(self.base, rows)
