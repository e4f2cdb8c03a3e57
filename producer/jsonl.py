"""Parse a JSONL submission into validated jobs, collecting one error per bad line; write an export file whole."""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from producer.json_keys import keys_may_repeat, unique_pairs
from producer.openai_format import ENVELOPE, from_openai, is_openai_line
from shared.errors import SubmissionError, ValidationError, shown
from shared.job import DEFAULT_LIMITS, Job, Limits

MIB = 1024 * 1024
# The longest line read whole. No valid job comes near it: under the default limits, a job with every field at its
# limit and every byte \u-escaped is under 1 MiB. A longer line is skipped in pieces of this size, so a wrong file
# (a multi-GB export without newlines) costs this much memory, not four times its size, before its one-line answer.
MAX_LINE_BYTES = 16 * MIB


@dataclass(frozen=True)
class LongLine:
    """A line over the reader's limit, skipped unread: only its size (without the newline) is known."""

    size: int
    limit: int


def read_lines(fh: BinaryIO, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes | LongLine]:
    """The lines of a binary file, each at most `max_line_bytes` long (its newline not counted); a longer one
    comes as a LongLine, read past in pieces of that size and never held whole."""
    while line := fh.readline(max_line_bytes + 1):
        if len(line) <= max_line_bytes or line.endswith(b"\n"):
            yield line
            continue
        size, piece = len(line), line
        while not piece.endswith(b"\n") and (piece := fh.readline(max_line_bytes)):
            size += len(piece)
        yield LongLine(size=size - piece.endswith(b"\n"), limit=max_line_bytes)


def parse_lines(
    lines: Iterable[bytes | LongLine],
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
        if isinstance(raw, LongLine):
            message = f"the line is {raw.size} bytes; a line may have at most {raw.limit} (no job is that long)"
            errors.append(ValidationError(message, line=number))
            continue
        if number == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]  # a byte-order mark, as Windows editors write: not part of the JSON
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
    obj = _loads(text)
    if is_openai_line(obj):
        obj = from_openai(obj, model_map=model_map)
    elif isinstance(obj, dict) and {"method", "url"} & set(obj) and set(obj) <= ENVELOPE:
        raise ValidationError("an OpenAI Batch line needs a 'body' (the request)", field="body")
    if isinstance(obj, dict) and "custom_id" not in obj:
        obj = {**obj, "custom_id": f"line-{number}"}
    return Job.from_dict(obj, limits=limits, default_model=default_model)


# 2**64 has 20 digits: a line without a run of 20 digits holds no integer past 64 bits (the cheap test first).
_TWENTY_DIGITS = re.compile(r"\d{20}")


def _loads(text: str) -> Any:
    """The line's JSON value, by orjson, which settles two things silently: an integer past 64 bits it reads as a
    float, rounded (an id in `meta` came back as another number; a refusal echoed 99999999999999999999999999 as
    1e+26), and of a key given twice in one object it keeps the last (a second `"model"` ran the job on the other
    model). A line that may hold either (cheap tests first) is read again by Python's parser, which hands over
    every integer literal and every object's pairs as written, and refused naming what it holds."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"invalid JSON: {exc}") from exc
    wide, repeat = _TWENTY_DIGITS.search(text) is not None, keys_may_repeat(text, obj)
    if wide or repeat:
        _exact_checks(text, wide=wide, repeat=repeat)
    return obj


def _exact_checks(text: str, *, wide: bool, repeat: bool) -> None:
    """One parse of the (valid) JSON `text` by Python's parser: a key given twice refused as it is met
    (`repeat`), then an integer past 64 bits (`wide`)."""
    try:
        exact = json.loads(text, parse_int=_int_or_wide, object_pairs_hook=unique_pairs if repeat else None)
    except (RecursionError, ValueError) as exc:  # deeper, or longer numbers, than Python's parser takes
        if repeat:
            raise ValidationError(f"the line cannot be checked for a key given twice ({exc})") from None
        return  # nested deeper than any field allows: refused by the job's own checks
    if wide:
        _refuse_wide_integers(exact)


@dataclass(frozen=True)
class _Wide:
    """An integer literal past 64 bits (as the stdlib parser hands it over), by its number of digits."""

    digits: int


def _int_or_wide(literal: str) -> int | _Wide:
    # A literal of over 21 characters is past 64 bits, and int() of one over 4,300 digits raises: not converted.
    value = int(literal) if len(literal) <= 21 else None
    if value is not None and -(2**63) <= value < 2**64:
        return value
    return _Wide(len(literal.lstrip("-")))


def _refuse_wide_integers(obj: Any) -> None:
    """ValidationError naming the first integer past 64 bits (a `_Wide`) in `obj`, as Python's parser read it."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, _Wide):
            where = shown(path) if path else "the line"
            raise ValidationError(
                f"{where} is an integer of {node.digits} digits, past 64 bits: JSON readers round it "
                "(write it as a string to keep it exact)",
                field=path.split(".")[0].split("[")[0] or None,
            )
        if isinstance(node, dict):
            stack.extend(reversed([(f"{path}.{k}" if path else k, v) for k, v in node.items()]))
        elif isinstance(node, list):
            stack.extend(reversed([(f"{path}[{i}]", v) for i, v in enumerate(node)]))


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
