"""No-op stand-ins for measuring the queue layer alone: an engine that answers instantly, and a plain
RQ job function for a stock RQ SimpleWorker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.job import Job
from worker.config import config_from_toml
from worker.outputs import RowOutput

NOOP_CONFIG = '[base]\npath = "noop"\n'  # every model with its shipped defaults; nothing is loaded


class NoopEngine:
    """Answers every job at once; everything else about the worker (Redis, bookkeeping) is real."""

    def __init__(self) -> None:
        self.config = config_from_toml(NOOP_CONFIG)

    def run(self, jobs: Sequence[Job], *, time_limit_s: float | None = None) -> list[RowOutput]:
        return [RowOutput(text="ok", decision="ok", confidence=1.0, prompt_tokens=1, completion_tokens=1) for _ in jobs]

    def prepare(self, jobs: Sequence[Job]) -> None:
        return None

    def capacity(self, model: str) -> int:
        return 256

    def expect(self, job: Job) -> None:
        pass


def noop_job(payload: dict[str, Any]) -> str:
    return "ok"
