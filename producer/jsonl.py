"""Parse a JSONL submission into validated jobs, collecting one error per bad line."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import orjson

from shared.errors import SubmissionError, ValidationError
from shared.job import DEFAULT_LIMITS, Job, Limits

_OPENAI_ENVELOPE = frozenset({"custom_id", "method", "url", "body"})


def parse_lines(
    lines: Iterable[bytes],
    *,
    default_model: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    escalate: bool | None = None,
) -> list[Job]:
    """Validate every line first; raise SubmissionError listing all bad lines (so nothing is enqueued).

    Blank lines are skipped. Lines may be kevlaya jobs or OpenAI Batch-style `{"custom_id", "body"}`.
    Items without a custom_id get `line-N`. `escalate=False` switches escalation off for every item.
    """
    jobs: list[Job] = []
    errors: list[ValidationError] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            job = parse_line(raw, number, default_model=default_model, limits=limits)
        except ValidationError as exc:
            errors.append(exc.at_line(number))
            continue
        if job.custom_id in seen:
            errors.append(
                ValidationError(
                    f"duplicate custom_id {job.custom_id!r} (first on line {seen[job.custom_id]})",
                    field="custom_id",
                    line=number,
                )
            )
            continue
        seen[job.custom_id] = number
        if escalate is False:
            job = replace(job, escalate=False)
        jobs.append(job)
    if errors:
        raise SubmissionError(errors)
    return jobs


def parse_line(raw: bytes, number: int, *, default_model: str | None, limits: Limits) -> Job:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(f"invalid UTF-8 at byte {exc.start}") from exc
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"invalid JSON: {exc}") from exc
    if isinstance(obj, dict) and "body" in obj and set(obj) <= _OPENAI_ENVELOPE:
        obj = from_openai(obj)
    if isinstance(obj, dict) and "custom_id" not in obj:
        obj = {**obj, "custom_id": f"line-{number}"}
    return Job.from_dict(obj, limits=limits, default_model=default_model)


def from_openai(line: dict[str, Any]) -> dict[str, Any]:
    """Map an OpenAI Batch line (chat or completions body) onto the kevlaya job format."""
    body = line.get("body")
    if not isinstance(body, dict):
        raise ValidationError("'body' must be an object", field="body")
    job: dict[str, Any] = {"custom_id": line.get("custom_id")}
    if "model" in body:
        job["model"] = body["model"]
    if "messages" in body:
        job["prompt"] = _messages_to_prompt(body["messages"])
    elif "prompt" in body:
        job["prompt"] = body["prompt"]
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        job["max_new_tokens"] = limit
    for key in ("temperature", "seed", "choices", "escalate", "meta"):
        if key in body:
            job[key] = body[key]
    if "metadata" in body:
        job["meta"] = body["metadata"]
    return job


def _messages_to_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise ValidationError("'body.messages' must be a non-empty list", field="body.messages")
    parts = []
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, str):
            raise ValidationError("every message needs a string 'content'", field="body.messages")
        parts.append(content)
    # Only the user's words reach the model; the model's own template supplies system/role framing.
    return "\n\n".join(parts)
