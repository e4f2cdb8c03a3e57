"""No-op stand-ins for measuring the queue layer alone: an engine that answers instantly, and a plain
RQ job function for a stock RQ SimpleWorker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shared.job import Job
from worker.outputs import RowOutput


class NoopEngine:
    """Answers every job at once; everything else about the worker (Redis, bookkeeping) is real."""

    def run(self, jobs: Sequence[Job], *, time_limit_s: float | None = None) -> list[RowOutput]:
        return [RowOutput(text="ok", decision="ok", confidence=1.0, prompt_tokens=1, completion_tokens=1) for _ in jobs]

    def max_rows(self, model: str) -> int:
        return 256

    def expect(self, job: Job) -> None:
        pass

    def model_version(self, model: str) -> dict[str, str]:
        return {"base": "noop"}

    def escalation_rule(self, model: str) -> Any:
        return None

    def shares_base(self, a: str, b: str) -> bool:
        return True

    def peak_memory_bytes(self) -> int:
        return 0


def noop_job(payload: dict[str, Any]) -> str:
    return "ok"
