"""Scheduled runs: what one slot of a schedule does, and the schedule's state in Redis.

A slot (a time the schedule's cadence names, in UTC) submits the files matching the schedule's inputs as one
batch whose id comes from the schedule's name and the slot (`nightly-20261130T020000Z`), waits for it to
finish, and exports its results to the output template. The timer itself is RQ's cron scheduler
(producer.cron); this module is the part that does not depend on RQ:

- one run per slot however many schedulers run the schedule: a slot is claimed with SET NX before anything
  is submitted (and the submit itself is idempotent per batch id);
- restarts: the last slot run and each slot's record live in Redis; a run whose scheduler died before its
  export is taken over (compare-and-set on the slot's claim) by the next scheduler that starts;
- missed slots (no scheduler was up at their time) are recorded as `missed` and logged, never run late.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import re
import string
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import orjson
from croniter import croniter
from redis import exceptions as redis_exceptions
from redis.exceptions import WatchError

from producer.client import DEFAULT_COMPLETION_WINDOW_S, Client
from producer.jsonl import parse_lines, read_lines, written_whole
from shared.errors import (
    KevlayaError,
    RedisUnavailableError,
    StoreError,
    SubmissionError,
    ValidationError,
    shown,
)
from shared.job import Job
from shared.wrongtype import expecting

log = logging.getLogger("kevlaya.schedule")

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")  # part of batch ids (shared.keys.BATCH_ID_RE) and key names
NAME_CHARS = "letters, digits, '_' and '-'"
SLOT_CLAIM_TTL_S = 30 * 24 * 3600  # a slot's claim outlives any sensible batch window
MISSED_LIST_CAP = 1000  # slots enumerated when reporting a long outage (the count beyond is still logged)
RUNS_KEPT = 500  # slot records kept per schedule
START_GRACE_S = 5.0  # at start, a slot younger than this may still be being claimed by a live scheduler
STAMP_FORMAT = "%Y%m%dT%H%M%SZ"


def parse_every(text: str) -> int:
    """`30s`, `15m`, `2h`, `1d` (or plain seconds) -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        seconds = int(number) * units[unit]
    except ValueError:
        raise ValidationError(f"--every {text!r}: expected a whole number with s, m, h or d (e.g. 2s, 15m)") from None
    if seconds < 1:
        raise ValidationError(f"--every {text!r}: must be at least 1 s")
    return seconds


@dataclass(frozen=True)
class Cadence:
    """When a schedule's slots are: a cron expression (UTC; a sixth field is seconds) or every N seconds,
    counted from the Unix epoch so every scheduler of the schedule names the same slots."""

    cron: str | None = None
    every_s: int | None = None

    def __post_init__(self) -> None:
        if (self.cron is None) == (self.every_s is None):
            raise ValidationError("give exactly one of --cron and --every")
        if self.every_s is not None and self.every_s < 1:  # parse_every's bound, for a spec read back from Redis
            raise ValidationError(f"--every {self.every_s} s: must be at least 1 s")
        if self.cron is not None and not croniter.is_valid(self.cron):
            raise ValidationError(f"--cron {self.cron!r} is not a valid cron expression")
        try:  # valid syntax is not enough: `0 0 30 2 *` names no date, `--every 99999999d` none before year 9999
            self.next_after(datetime.now(timezone.utc))
        except (ValueError, OverflowError):  # croniter's CroniterBadDateError is a ValueError
            raise ValidationError(f"{self.describe()} names no slot from now on") from None

    def describe(self) -> str:
        return f"cron {self.cron!r} (UTC)" if self.cron is not None else f"every {self.every_s} s"

    def next_after(self, t: datetime) -> datetime:
        """The first slot strictly after t."""
        if self.cron is not None:
            return croniter(self.cron, t).get_next(datetime)
        assert self.every_s is not None
        return _utc(math.floor(t.timestamp() / self.every_s) * self.every_s + self.every_s)

    def at_or_before(self, t: datetime) -> datetime:
        """The latest slot at or before t."""
        if self.cron is not None:
            return croniter(self.cron, t + timedelta(microseconds=1)).get_prev(datetime)
        assert self.every_s is not None
        return _utc(math.floor(t.timestamp() / self.every_s) * self.every_s)

    def between(self, after: datetime, before: datetime) -> Iterator[datetime]:
        """Slots s with after < s < before, oldest first."""
        s = self.next_after(after)
        while s < before:
            yield s
            s = self.next_after(s)


OUTPUT_FIELDS = frozenset({"date", "time", "slot", "name", "batch"})


def _check_fields(template: str) -> None:
    """KeyError for a field that is not one of OUTPUT_FIELDS as it stands: `{date.year}` failed at start with
    an AttributeError traceback, `{name.__class__}` or `{date!r}` put Python's spelling into the path."""
    for _, field_name, _, conversion in string.Formatter().parse(template):
        if field_name is not None and (field_name not in OUTPUT_FIELDS or conversion is not None):
            raise KeyError(field_name + (f"!{conversion}" if conversion else ""))


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


def stamp(slot: datetime) -> str:
    return slot.astimezone(timezone.utc).strftime(STAMP_FORMAT)


def from_stamp(text: str) -> datetime:
    return datetime.strptime(text, STAMP_FORMAT).replace(tzinfo=timezone.utc)


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """What a schedule runs: plain JSON-able fields (it travels as the cron job's args and is kept in Redis)."""

    name: str
    cron: str | None = None
    every_s: int | None = None
    inputs: tuple[str, ...]
    output: str
    model: str | None = None
    escalate: bool = True
    expires_in_s: float = DEFAULT_COMPLETION_WINDOW_S

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ValidationError(f"schedule name {self.name!r}: use 1-64 {NAME_CHARS}", field="name")
        if not self.inputs:
            raise ValidationError("a schedule needs at least one --input", field="input")
        try:
            _check_fields(self.output)
            self.output_path(datetime.now(timezone.utc), "b")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValidationError(
                f"--output {self.output!r}: unknown field {exc}; use {{date}}, {{time}}, {{slot}}, {{name}}, {{batch}}",
                field="output",
            ) from None
        self.cadence  # noqa: B018 (validates the cadence)

    @property
    def cadence(self) -> Cadence:
        return Cadence(cron=self.cron, every_s=self.every_s)

    def batch_id(self, slot: datetime) -> str:
        """Deterministic: every scheduler of this schedule submits a slot into the same batch."""
        return f"{self.name}-{stamp(slot)}"

    def output_path(self, slot: datetime, batch: str) -> Path:
        slot = slot.astimezone(timezone.utc)
        return Path(
            self.output.format(
                date=slot.strftime("%Y-%m-%d"),
                time=slot.strftime("%H%M%S"),
                slot=stamp(slot),
                name=self.name,
                batch=batch,
            )
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "inputs": list(self.inputs)}

    @classmethod
    def from_dict(cls, data: Any) -> ScheduleSpec:
        """The spec a scheduler saved; ValidationError for anything else some other writer left there (a field
        of another type failed only when the spec was used: `--every "60"` in `schedule --list`)."""
        problem = _shape_problem(data, _SPEC_FIELDS)
        if problem is None and not all(isinstance(i, str) for i in data.get("inputs", ())):
            problem = "inputs: not a list of strings"
        if problem is not None:
            raise ValidationError(f"schedule spec in Redis: {problem}")
        return cls(**{**data, "inputs": tuple(data["inputs"])})


_NONE = type(None)
# The JSON types of a saved spec's and slot record's fields (bool is an int to isinstance: kept out by hand).
_SPEC_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "cron": (str, _NONE),
    "every_s": (int, _NONE),
    "inputs": (list,),
    "output": (str,),
    "model": (str, _NONE),
    "escalate": (bool,),
    "expires_in_s": (int, float),
}
_RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "slot": (str,),
    "status": (str,),
    "batch": (str, _NONE),
    "owner": (str, _NONE),
    "files": (list,),
    "items": (int, _NONE),
    "output": (str, _NONE),
    "counts": (dict, _NONE),
    "error": (str, _NONE),
    "at": (int, float),
}


def _shape_problem(data: Any, types: dict[str, tuple[type, ...]]) -> str | None:
    """What keeps `data` (untrusted JSON) from being a record of these field types, or None."""
    if not isinstance(data, dict):
        return f"not a JSON object but {type(data).__name__}"
    for name, value in data.items():
        allowed = types.get(name)
        if allowed is None:
            return f"unknown field {shown(name)}"
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            return f"{name}: {shown(value)} is not {' or '.join(t.__name__ for t in allowed)}"
    return None


@dataclass
class SlotRun:
    """The record of one slot, JSON in the schedule's runs hash."""

    slot: str
    status: str  # submitting | submitted | exported | failed | no-input | missed
    batch: str | None = None
    owner: str | None = None
    files: list[str] = field(default_factory=list)
    items: int | None = None
    output: str | None = None
    counts: dict[str, int] | None = None
    error: str | None = None
    at: float = field(default_factory=time.time)

    def dumps(self) -> bytes:
        return orjson.dumps({k: v for k, v in asdict(self).items() if v not in (None, [])})

    @classmethod
    def loads(cls, raw: bytes) -> SlotRun | None:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None  # anything in Redis is untrusted: an unreadable record is left out
        if not isinstance(data, dict):
            return None
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        if _shape_problem(known, _RUN_FIELDS) is not None:
            return None
        try:
            return cls(**known)
        except TypeError:  # a required field missing
            return None


class ScheduleState:
    """A schedule's state in Redis: its spec, the last slot run, one record per slot."""

    def __init__(self, client: Client, name: str) -> None:
        self.redis = client.redis
        self.keys = client.keys
        self.name = name

    def save_spec(self, spec: ScheduleSpec) -> None:
        key = self.keys.schedule(self.name)
        raw = orjson.dumps(spec.to_dict())
        old = self.redis.hget(key, "spec")
        if old is not None and old != raw:
            log.warning("schedule %s: its spec changed since the last start; the new one applies", self.name)
        with self.redis.pipeline() as pipe:
            pipe.sadd(self.keys.schedules(), self.name)
            pipe.hset(key, "spec", raw)
            pipe.execute()

    def spec(self) -> ScheduleSpec | None:
        raw = self.redis.hget(self.keys.schedule(self.name), "spec")
        try:
            return None if raw is None else ScheduleSpec.from_dict(orjson.loads(raw))
        except (orjson.JSONDecodeError, TypeError, KeyError, KevlayaError):
            return None

    def last_slot(self) -> datetime | None:
        raw = self.redis.hget(self.keys.schedule(self.name), "last_slot")
        try:
            return None if raw is None else from_stamp(raw.decode())
        except (UnicodeDecodeError, ValueError):
            return None

    def mark_last(self, slot: datetime) -> None:
        last = self.last_slot()
        if last is None or slot > last:
            self.redis.hset(self.keys.schedule(self.name), "last_slot", stamp(slot))

    def claim(self, slot: datetime, owner: str) -> bool:
        return bool(
            self.redis.set(self.keys.schedule_slot(self.name, stamp(slot)), owner, nx=True, ex=SLOT_CLAIM_TTL_S)
        )

    def claimed(self, slot: datetime) -> bool:
        return bool(self.redis.exists(self.keys.schedule_slot(self.name, stamp(slot))))

    def take_over(self, slot: str, dead_owner: str, owner: str) -> bool:
        """Move a slot's claim from a dead scheduler to this one; False if another got there first."""
        key = self.keys.schedule_slot(self.name, slot)
        with self.redis.pipeline() as pipe:
            try:
                pipe.watch(key)
                if pipe.get(key) != dead_owner.encode():
                    return False
                pipe.multi()
                pipe.set(key, owner, ex=SLOT_CLAIM_TTL_S)
                pipe.execute()
                return True
            except WatchError:
                return False

    def record(self, run: SlotRun, *, only_if_absent: bool = False) -> bool:
        key = self.keys.schedule_runs(self.name)
        if only_if_absent:
            written = bool(self.redis.hsetnx(key, run.slot, run.dumps()))
        else:
            self.redis.hset(key, run.slot, run.dumps())
            written = True
        if written and self.redis.hlen(key) > RUNS_KEPT:
            oldest = sorted(f.decode() for f in self.redis.hkeys(key))[: -RUNS_KEPT or None]
            if oldest:
                self.redis.hdel(key, *oldest)
        return written

    def runs(self) -> list[SlotRun]:
        """Every kept slot record, oldest first."""
        raw = self.redis.hgetall(self.keys.schedule_runs(self.name))
        runs = [SlotRun.loads(v) for _, v in sorted(raw.items())]
        return [r for r in runs if r is not None]


class SlotRunner:
    """Runs the slots of one schedule for one scheduler (`owner`, its name in RQ's cron registry)."""

    def __init__(
        self, client: Client, spec: ScheduleSpec, *, owner: str, alive: Callable[[str], bool] = lambda _: True
    ) -> None:
        self.client = client
        self.spec = spec
        self.owner = owner
        self.alive = alive  # whether a scheduler of that name is still running (RQ's cron registry)
        self.state = ScheduleState(client, spec.name)
        self.threads: list[threading.Thread] = []

    # ---- start ------------------------------------------------------------------------------------------
    def start(self, now: datetime | None = None) -> None:
        """Before the first slot: save the spec, report slots missed while no scheduler ran, and take over
        the unfinished runs of schedulers that died."""
        now = now or datetime.now(timezone.utc)
        self.state.save_spec(self.spec)
        self.report_missed(before=now - timedelta(seconds=START_GRACE_S))
        for run in self.state.runs():
            orphan = run.status in ("submitting", "submitted") and run.owner and not self.alive(run.owner)
            if orphan and run.owner != self.owner and self.state.take_over(run.slot, run.owner, self.owner):
                log.warning("schedule %s: taking over slot %s from %s (gone)", self.spec.name, run.slot, run.owner)
                self._resume(run)

    def _resume(self, run: SlotRun) -> None:
        slot = from_stamp(run.slot)
        if run.status == "submitting":  # died mid-submit: submit again (idempotent per batch id)
            self._submit(slot)
        else:
            run = replace(run, owner=self.owner)
            self.state.record(run)
            self._finish_later(slot, run)

    # ---- one slot ---------------------------------------------------------------------------------------
    def run(self, slot: datetime) -> bool:
        """Run `slot` unless another scheduler claimed it; True if this one runs it. The wait for the batch
        and the export go on in a thread (the scheduler's loop keeps its time)."""
        self.report_missed(before=slot)
        if not self.state.claim(slot, self.owner):
            log.info("schedule %s: slot %s is run by another scheduler", self.spec.name, stamp(slot))
            return False
        self.state.mark_last(slot)
        self._submit(slot)
        return True

    def _submit(self, slot: datetime) -> None:
        spec, batch = self.spec, self.spec.batch_id(slot)
        files = sorted({f for pattern in spec.inputs for f in glob.glob(pattern)})
        run = SlotRun(slot=stamp(slot), status="submitting", batch=batch, owner=self.owner, files=files)
        if not files:
            self._record(replace(run, status="no-input", batch=None), "no input file matched")
            return
        self.state.record(run)
        try:
            jobs = self._read(files)
            if not jobs:
                self._record(replace(run, status="no-input", batch=None), "the input files hold no jobs")
                return
            handle = self.client.submit_batch(
                jobs, batch_id=batch, escalate=spec.escalate, completion_window_s=spec.expires_in_s
            )
        except StoreError:
            raise  # Redis failing is no fault of the slot: it stays `submitting`, submitted again when taken over
        except KevlayaError as exc:
            self._record(replace(run, status="failed", error=str(exc)), str(exc))
            return
        run = replace(run, status="submitted", items=len(jobs))
        self.state.record(run)
        log.info(
            "schedule %s: slot %s submitted %d item(s) from %d file(s) as batch %s (%d new)",
            spec.name, run.slot, len(jobs), len(files), batch, handle.enqueued,
        )  # fmt: skip
        self._finish_later(slot, run)

    def _read(self, files: list[str]) -> list[Job]:
        """Every file validated; custom_ids must be unique across the slot's files (they name the results)."""
        jobs: list[Job] = []
        seen: dict[str, str] = {}
        for path in files:
            try:
                with open(path, "rb") as fh:
                    parsed = parse_lines(
                        read_lines(fh), default_model=self.spec.model, escalate=None if self.spec.escalate else False
                    )
            except SubmissionError as exc:
                raise SubmissionError([ValidationError(f"{path}: {e}") for e in exc.errors]) from None
            except OSError as exc:
                raise KevlayaError(f"cannot read {path}: {exc}") from exc
            for job in parsed:
                if job.custom_id in seen:
                    raise KevlayaError(f"custom_id {job.custom_id!r} is in both {seen[job.custom_id]} and {path}")
                seen[job.custom_id] = path
            jobs += parsed
        return jobs

    def _record(self, run: SlotRun, problem: str) -> None:
        self.state.record(run)
        log.error("schedule %s: slot %s %s: %s", self.spec.name, run.slot, run.status, problem)

    def _finish_later(self, slot: datetime, run: SlotRun) -> None:
        thread = threading.Thread(target=self.finish, args=(slot, run), daemon=True, name=f"slot-{run.slot}")
        self.threads.append(thread)
        thread.start()

    def finish(self, slot: datetime, run: SlotRun) -> Path | None:
        """Wait until the slot's batch is finished, then export its results (input order) to the output. A
        Redis outage meanwhile is waited out (the batch goes on in the workers); any other failure is recorded."""
        delay = 1.0
        while True:
            try:
                return self._export(slot, run)
            except (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, RedisUnavailableError) as exc:
                log.warning(
                    "schedule %s: slot %s: redis unavailable (%s); retrying in %.0f s",
                    self.spec.name,
                    run.slot,
                    exc,
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
            except Exception as exc:  # the thread's end: record it (best effort)
                with contextlib.suppress(Exception):
                    self._record(replace(run, status="failed", error=f"export: {exc}"), str(exc))
                return None

    def _export(self, slot: datetime, run: SlotRun) -> Path:
        assert run.batch is not None
        record = self.client.wait(run.batch, poll_s=2.0)
        path = self.spec.output_path(slot, run.batch)
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(path) as fh:  # readers never see half a file
            for row in self.client.iter_results(run.batch):
                fh.write(orjson.dumps(row) + b"\n")
        counts = record.counts.to_dict()
        self.state.record(replace(run, status="exported", output=str(path), counts=counts))
        log.info("schedule %s: slot %s exported to %s (%s)", self.spec.name, run.slot, path, counts)
        return path

    # ---- missed slots -------------------------------------------------------------------------------------
    def report_missed(self, *, before: datetime) -> int:
        """Record (and log) the slots after the last one run and before `before` that nobody claimed: no
        scheduler was up at their time. They are not run late; `kevlaya schedule --list` shows them."""
        last = self.state.last_slot()
        if last is None:
            return 0
        missed = 0
        for n, slot in enumerate(self.spec.cadence.between(last, before)):
            if n >= MISSED_LIST_CAP:
                log.warning("schedule %s: more than %d slots missed; the rest are not listed", self.spec.name, n)
                break
            if self.state.claimed(slot):
                continue
            run = SlotRun(slot=stamp(slot), status="missed", owner=self.owner, error="no scheduler was running")
            if self.state.record(run, only_if_absent=True):
                missed += 1
                log.warning("schedule %s: slot %s was missed (no scheduler was running)", self.spec.name, run.slot)
        return missed


def overview(client: Client, now: datetime | None = None) -> list[dict[str, Any]]:
    """Every schedule known to this Redis: spec, last and next slot, missed count and recent runs."""
    now = now or datetime.now(timezone.utc)
    out = []
    with expecting(client.redis, {client.keys.schedules(): "set"}):
        names = sorted(client.redis.smembers(client.keys.schedules()))
    for raw in names:
        name = raw.decode("utf-8", "replace")
        state = ScheduleState(client, name)
        with expecting(client.redis, {client.keys.schedule(name): "hash", client.keys.schedule_runs(name): "hash"}):
            spec, last, runs = state.spec(), state.last_slot(), state.runs()
        out.append(
            {
                "name": name,
                "cadence": spec.cadence.describe() if spec else None,
                "inputs": list(spec.inputs) if spec else None,
                "output": spec.output if spec else None,
                "last_slot": stamp(last) if last else None,
                "next_slot": stamp(spec.cadence.next_after(now)) if spec else None,
                "missed": sum(r.status == "missed" for r in runs),
                "runs": [asdict(r) for r in runs[-10:]],
            }
        )
    return out


def run_slot(spec: dict[str, Any], slot: str, *, runner: SlotRunner) -> bool:
    """The scheduled function (producer.cron runs it at each slot): the schedule `spec` (JSON) at `slot`
    (its UTC stamp), run by this scheduler's runner. True if this scheduler ran it, False if another did."""
    if spec != runner.spec.to_dict():
        raise KevlayaError(f"slot {slot}: the spec does not match this scheduler's schedule {runner.spec.name!r}")
    return runner.run(from_stamp(slot))
