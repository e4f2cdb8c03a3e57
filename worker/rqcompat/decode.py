"""Reading RQ's job hashes and timestamps without trusting a byte of them."""

from __future__ import annotations

import contextlib
import re
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from shared.errors import NotAllowedError, PayloadError
from shared.jobfunc import check_allowed
from shared.keys import JOB_ID_RE
from shared.quarantine import printable
from shared.serializer import serializer

CALLBACK_FIELDS = ("success_callback_name", "failure_callback_name", "stopped_callback_name")
ATTEMPTS_FIELD = "kevlaya_attempts"
CRASHES_FIELD = "kevlaya_crashes"  # how many times a worker died while running this job
# Set when a worker records the job as failed; a job taken while it is set was requeued after failing (`rq
# requeue`, or retry-failed) and runs again -- unlike a job whose answer was written before a crash.
FAILED_FIELD = "kevlaya_failed"
# The started entry ('<job id>:<execution id>') of the take that last took this job: while that entry stands, a copy
# of the id met in a queue is dropped, not run a second time (worker.rqcompat.scripts).
TAKEN_FIELD = "kevlaya_taken"
MAX_DATA_BYTES = 4 << 20  # a job's inflated payload; real ones are < 200 KiB (shared.job.Limits)


# RQ's timestamp shape, as strptime's "%Y-%m-%dT%H:%M:%S.%fZ" takes it (1-6 digits of the second's fraction).
RQ_TIME_RE = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{1,6}Z", re.ASCII)


def rq_now() -> str:
    """RQ's timestamp format (UTC, microseconds, 'Z')."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rq_time(value: bytes | str | None) -> float | None:
    if not value:
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    if not RQ_TIME_RE.fullmatch(text):
        return None
    try:
        # fromisoformat on RQ's shape, not strptime: ~20x less host time, for every job a take loads.
        return datetime.fromisoformat(text[:-1]).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def _int(value: bytes | None) -> int:
    """A counter field read from Redis; garbage reads as 0, and so does a negative count (a crash count of -10**9
    would let a poison job crash-loop its workers that many times before it is dead-lettered)."""
    try:
        return max(int(value or 0), 0)
    except ValueError:
        return 0


def valid_id(raw: bytes | str) -> str | None:
    """The id as text if it is one kevlaya or RQ could have written, else None."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        return None
    return text if JOB_ID_RE.match(text) else None


@dataclass(frozen=True)
class RawJob:
    """A job as found in Redis: its id, the decoded payload (or the reason it could not be decoded)."""

    id: str
    payload: dict[str, Any] | None
    problem: PayloadError | None
    attempts: int
    crashes: int
    enqueued_at: float | None
    failed_before: bool = False  # recorded as failed, then requeued (FAILED_FIELD)


def decode_job(job_id: str, raw: dict[bytes, bytes]) -> RawJob:
    """Decode one job hash without importing or calling anything it names. A refused job keeps whatever
    payload could be read, so its error can still be written to its batch item. No field is trusted."""
    attempts = _int(raw.get(ATTEMPTS_FIELD.encode())) if raw else 0
    crashes = _int(raw.get(CRASHES_FIELD.encode())) if raw else 0
    enqueued = parse_rq_time(raw.get(b"enqueued_at")) if raw else None
    failed = bool(raw.get(FAILED_FIELD.encode())) if raw else False
    payload: dict[str, Any] | None = None
    try:
        func, payload = _unpack(raw)
        _check(raw, func, payload)
    except PayloadError as problem:
        return RawJob(job_id, payload, problem, attempts, crashes, enqueued, failed)
    return RawJob(job_id, payload, None, attempts, crashes, enqueued, failed)


def _unpack(raw: dict[bytes, bytes]) -> tuple[Any, dict[str, Any] | None]:
    """(function name, payload dict or None) from RQ's `data` field: zlib-compressed JSON."""
    if not raw:
        raise PayloadError("job hash is missing (deleted or expired)")
    if b"data" not in raw:
        raise PayloadError("job hash has no 'data' field")
    data = raw[b"data"]
    # RQ stores data zlib-compressed; an uncompressed one is still JSON-checked below. Capped: a few bytes
    # of hostile zlib can expand to gigabytes.
    with contextlib.suppress(zlib.error):
        inflater = zlib.decompressobj()
        data = inflater.decompress(data, MAX_DATA_BYTES)
        if inflater.unconsumed_tail:
            raise PayloadError(f"job data inflates past {MAX_DATA_BYTES} bytes")
    decoded = serializer.loads(data)
    if not isinstance(decoded, list) or len(decoded) != 4:
        raise PayloadError("job data is not [func, instance, args, kwargs]")
    func, instance, args, kwargs = decoded
    shaped = instance is None and not kwargs and isinstance(args, list) and len(args) == 1
    return func, args[0] if shaped and isinstance(args[0], dict) else None


def _check(raw: dict[bytes, bytes], func: Any, payload: dict[str, Any] | None) -> None:
    """The function name first: a job naming anything else is refused before its arguments are looked at."""
    check_allowed(func if isinstance(func, str) else printable(func))
    for name in CALLBACK_FIELDS:
        if raw.get(name.encode()):
            value = raw[name.encode()].decode(errors="replace")
            raise NotAllowedError(f"job sets {name}={value!r}; callbacks are refused")
    if payload is None:
        raise PayloadError("job must call the allowlisted function with exactly one JSON-object argument")
