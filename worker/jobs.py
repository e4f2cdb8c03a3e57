"""The allowlisted job function name (shared.jobfunc.RUN_DECISION) points here.

kevlaya jobs are executed in batches by `kevlaya worker`, which never calls this function: it reads the
payload and runs it through the engine. A stock `rq worker` that picks such a job gets a clear failure
instead of loading a model per job.
"""

from __future__ import annotations

from typing import Any

from shared.errors import KevlayaError


def run_decision(payload: dict[str, Any]) -> None:
    raise KevlayaError("kevlaya jobs run in batches: start `kevlaya worker --config FILE`, not `rq worker`")
