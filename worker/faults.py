"""Fault injection for the fault-matrix tests, where a real fault cannot be produced on a CPU.

KEVLAYA_FAULT=crash_on_prompt:<text> makes the worker process die at once (os._exit, no cleanup) when it
is about to run a job whose prompt contains <text>: what a CUDA crash on one poison input looks like.
Unset (the default), nothing here does anything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from shared.job import Job

CRASH_EXIT_CODE = 86


def crash_marker() -> str | None:
    spec = os.environ.get("KEVLAYA_FAULT", "")
    kind, _, arg = spec.partition(":")
    return arg if kind == "crash_on_prompt" and arg else None


def maybe_crash(jobs: Sequence[Job]) -> None:
    marker = crash_marker()
    if marker and any(marker in (job.prompt or "") for job in jobs):
        os._exit(CRASH_EXIT_CODE)
