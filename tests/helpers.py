"""Test helpers that act like the worker, through the shared contract (never by poking keys)."""

from __future__ import annotations

from redis import Redis

from shared.keys import Keys, job_id
from shared.result import Result
from shared.store import record_result


def answer(redis: Redis, batch: str, custom_id: str, model: str = "laya", text: str = "approve") -> bool:
    """Record a final answer for one item exactly the way the worker does."""
    result = Result(
        custom_id=custom_id,
        model=model,
        job_id=job_id(batch, custom_id),
        batch=batch,
        text=text,
        decision=text,
        confidence=0.9,
        usage={"prompt_tokens": 10, "completion_tokens": 2},
    )
    return record_result(redis, Keys(), result)
