"""A fake engine for fast worker tests: answers instantly, with behaviour chosen by the prompt text.

- a prompt containing POISON raises SimulatedCrash (a BaseException, so it passes the worker's per-batch
  `except Exception` and ends the process's `work()`, as a CUDA crash ends a real worker);
- `crash_once` crashes the first batch that runs (an operator's `kill -9` mid-batch);
- a prompt containing "unsure" answers with confidence 0.1 (Laya escalates under the default rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.job import Job
from worker.config import config_from_toml
from worker.outputs import RowOutput

# Every known model with its shipped defaults (Laya escalates to Kev below 0.7); nothing is loaded.
FAKE_CONFIG = config_from_toml('[base]\npath = "fake"\n')


class SimulatedCrash(BaseException):
    """The worker process dies here."""


class FakeEngine:
    def __init__(self, *, rows: int = 256, crash_once: bool = False, config: Any = FAKE_CONFIG) -> None:
        self.config = config
        self.rows = rows
        self.crash_once = crash_once
        self.calls: list[list[str]] = []  # custom_ids of every batch run, in order
        self.answered: list[str] = []  # custom_ids of every row answered (runs that did not crash)

    def run(self, jobs: Sequence[Job], *, time_limit_s: float | None = None) -> list[RowOutput]:
        self.calls.append([j.custom_id for j in jobs])
        if self.crash_once:
            self.crash_once = False
            raise SimulatedCrash("killed mid-batch")
        if any("POISON" in (j.prompt or "") for j in jobs):
            raise SimulatedCrash("poison job")
        self.answered += [j.custom_id for j in jobs]
        return [self._answer(j) for j in jobs]

    @staticmethod
    def _answer(job: Job) -> RowOutput:
        unsure = "unsure" in (job.prompt or "") and job.parent is None
        return RowOutput(
            text=f"answer to {job.custom_id}",
            decision="approve",
            confidence=0.1 if unsure else 0.95,
            prompt_tokens=3,
            completion_tokens=2,
        )

    def prepare(self, jobs: Sequence[Job]) -> None:
        """Nothing to prepare: `run` is called without `encoded`."""
        return None

    def capacity(self, model: str) -> int:
        return self.rows

    def expect(self, job: Job) -> None:
        pass
