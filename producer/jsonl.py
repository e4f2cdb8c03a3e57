"""Parse a JSONL submission into validated jobs, collecting one error per bad line; write an export file whole."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

import orjson

from producer.json_keys import refuse_duplicate_keys
from producer.openai_format import ENVELOPE, from_openai, is_openai_line
from shared.errors import SubmissionError, ValidationError
from shared.job import DEFAULT_LIMITS, Job, Limits


def parse_lines(
    lines: Iterable[bytes],
    *,
    default_model: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    escalate: bool | None = None,
    model_map: Mapping[str, str] | None = None,
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
            job = parse_line(raw, number, default_model=default_model, limits=limits, model_map=model_map)
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


def parse_line(
    raw: bytes,
    number: int,
    *,
    default_model: str | None,
    limits: Limits,
    model_map: Mapping[str, str] | None = None,
) -> Job:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(f"invalid UTF-8 at byte {exc.start}") from exc
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"invalid JSON: {exc}") from exc
    refuse_duplicate_keys(text, obj)
    if is_openai_line(obj):
        obj = from_openai(obj, model_map=model_map)
    elif isinstance(obj, dict) and {"method", "url"} & set(obj) and set(obj) <= ENVELOPE:
        raise ValidationError("an OpenAI Batch line needs a 'body' (the request)", field="body")
    if isinstance(obj, dict) and "custom_id" not in obj:
        obj = {**obj, "custom_id": f"line-{number}"}
    return Job.from_dict(obj, limits=limits, default_model=default_model)


@contextlib.contextmanager
def written_whole(path: Path) -> Iterator[BinaryIO]:
    """A file written beside `path` and renamed onto it once complete: readers never see half of it, and a write
    that fails part-way leaves `path` as it was (and no temporary file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as fh:
            yield fh
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
