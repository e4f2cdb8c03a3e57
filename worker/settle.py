"""From taken jobs to written results: triage before the engine, results after it, one write per batch.

A row is carried through the batch as one record (what was taken, its decoded job, its result), so nothing
is decoded twice. Writes go follow-ups first (one transaction per batch), then results, then RQ's
bookkeeping (one pipeline per queue): a crash in between re-runs a job, never loses one.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import redis.exceptions
from redis import Redis

from shared.enqueue import EnqueueSettings, Entry, enqueue_absent, queues_for
from shared.errors import BAD_PAYLOAD, CANCELLED, EXPIRED, WORKER_DIED, ValidationError
from shared.job import Job
from shared.keys import BATCH_ID_RE, Keys, QueueRef, followup_id, job_id
from shared.result import Result
from shared.store import BatchFlags, batch_flags, promote_step, record_results, reopen_failed
from worker.config import ModelsConfig
from worker.followups import escalates, follow_up
from worker.outputs import RowOutput
from worker.rqcompat import RawJob, RQBridge

log = logging.getLogger("kevlaya.worker")

# Which of one batch's items hold an answer: in its results, or (ARGV[1] '1': a model that escalates, whose
# escalated step is an answer too) in its steps. ARGV[2..]: (custom id, job id) a job. One call a batch a take, not
# one a job. A job of a model that escalates whose item's final answer is its own follow-up's, with no step of its
# own recorded, is not done: it was killed after enqueuing the follow-up and before writing its step, and the
# follow-up answered first; it runs again to record its step (the follow-up exists: none is enqueued again), and
# answers 2 so that step is recorded as escalated whatever the re-run answers (its item's answer is Kev's already).
_ANSWERED_LUA = """
local out = {}
for i = 2, #ARGV, 2 do
  local cid, job = ARGV[i], ARGV[i + 1]
  local found = 0
  if ARGV[1] == '1' then
    found = redis.call('HEXISTS', KEYS[2], cid)
    if found == 0 then
      local raw = redis.call('HGET', KEYS[1], cid)
      if raw then
        found = 1
        local ok, row = pcall(cjson.decode, raw)
        if ok and type(row) == 'table' and row['escalated_from'] == job then found = 2 end
      end
    end
  else
    found = redis.call('HEXISTS', KEYS[1], cid)
  end
  out[#out + 1] = found
end
return out
"""


_DIGEST_RE = re.compile(r"[0-9a-f]{20}")


@dataclass(frozen=True)
class Row:
    """One taken job through its batch. `result` None with `job` None: only RQ bookkeeping is left."""

    model: str
    raw: RawJob
    job: Job | None = None
    result: Result | None = None
    lane: str = field(kw_only=True)  # the lane it was taken from: its started entry is in that queue's registry
    exec_id: str | None = field(default=None, kw_only=True)  # its take's execution id (None: the bridge's last)
    # A job of another configured model, found on this queue (an id pushed where it does not belong): moved to its
    # own queue, never answered from here.
    foreign: bool = field(default=False, kw_only=True)
    # Its follow-up answered its item before its own step was written (it was killed in between): this run records
    # that step as escalated, whatever it answers now (a calibration, threshold or unseeded draw may differ).
    followed: bool = field(default=False, kw_only=True)

    @property
    def ref(self) -> QueueRef:
        return QueueRef(self.model, self.lane)


@dataclass(frozen=True)
class Triage:
    settled: list[Row]  # refused, already answered, cancelled: written without running
    runnable: list[Row]
    flags: dict[str, BatchFlags]


@dataclass(frozen=True)
class Written:
    follow_ups: list[Entry]
    duplicates: int


class Settler:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        config: ModelsConfig,
        bridge: RQBridge,
        *,
        versions: Mapping[str, dict[str, str]],
        enqueue: EnqueueSettings,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.config = config
        self.bridge = bridge
        self.versions = versions
        self.enqueue = enqueue
        self.queues = queues_for(redis, keys, config.names)
        # Sent by its SHA (EVALSHA), not its text a job: the result or the step of a job, read at once.
        self._answered = redis.register_script(_ANSWERED_LUA)

    # ---- before the engine --------------------------------------------------------------------
    def triage(self, taken: Sequence[Row]) -> Triage:
        decoded = self._own(self._once([self.decode(row) for row in taken]))
        jobs = [row for row in decoded if row.job is not None and row.result is None]
        self._reopen_requeued(jobs)
        states = self.answer_states(jobs)  # one read a batch: done (1), or to run and record its step (2)
        done = {jid for jid, state in states.items() if state == 1}
        flags = self._flags({row.job.batch for row in jobs if row.job and row.job.batch})
        settled: list[Row] = []
        runnable: list[Row] = []
        for row in decoded:
            job = row.job
            if row.result is not None:
                settled.append(row)
            elif job is None or row.raw.id in done:
                settled.append(replace(row, job=None))  # answered before a crash: bookkeeping only
            elif flags.get(job.batch or "", BatchFlags()).cancelled:
                settled.append(self._closed(row, job, CANCELLED, "batch cancelled before this item ran"))
            elif flags.get(job.batch or "", BatchFlags()).expired:
                message = "the batch's completion window ended before this item ran"
                settled.append(self._closed(row, job, EXPIRED, message))
            else:
                runnable.append(replace(row, followed=states.get(row.raw.id) == 2))
        self._mark_running(runnable)
        return Triage(settled, runnable, flags)

    def decode(self, row: Row) -> Row:
        """The row with its job, or with an error result for a job that cannot run (hostile, malformed, or on
        another model's queue). Logs a refusal only for a payload the bridge could not read (`RawJob.problem`)."""
        raw = row.raw
        payload = raw.payload or {}
        if raw.problem is not None:
            log.warning("refusing job %s: %s", raw.id, raw.problem)
            return replace(row, result=self.failure_from(row, raw.problem.type, str(raw.problem)))
        try:
            job = Job.from_dict(payload, allow_system=True)
        except ValidationError as exc:
            return replace(row, result=self.failure_from(row, BAD_PAYLOAD, f"invalid payload: {exc}"))
        except Exception as exc:  # any bytes can be in Redis: whatever the validator trips on fails this job only
            return replace(row, result=self.failure_from(row, BAD_PAYLOAD, f"unreadable payload: {type(exc).__name__}"))
        if job.batch is not None and not names_this_job(raw.id, job):
            # Another item's payload in this job's hash: run, it answered that item (run a second time) and this one
            # never. Its own item is found from its id (the payload read as none) and ends with this error.
            message = f"its payload is item {job.custom_id!r}'s of batch {job.batch}, not this job's"
            return replace(
                row, result=self.failure_from(replace(row, raw=replace(raw, payload=None)), BAD_PAYLOAD, message)
            )
        if job.model != row.model:
            if job.model in self.config.models:  # its own queue runs it; an error here would end its item
                return replace(row, job=job, foreign=True)
            msg = f"job for {job.model!r} found on the {row.model} queue"
            return replace(row, result=self.failure_from(row, BAD_PAYLOAD, msg))
        return replace(row, job=job)

    @staticmethod
    def _once(rows: Sequence[Row]) -> list[Row]:
        """Each job once per take: an id queued twice and taken twice in one take shares one started entry (its
        id and the take's execution id), so its copies are one job, run once; the later copies are dropped."""
        seen: set[tuple[QueueRef, str | None, str]] = set()
        out = []
        for row in rows:
            key = (row.ref, row.exec_id, row.raw.id)
            if key in seen:
                log.warning("job %s was taken twice in one take; running it once", row.raw.id)
                continue
            seen.add(key)
            out.append(row)
        return out

    def _own(self, rows: Sequence[Row]) -> list[Row]:
        """Rows whose job belongs to another model's queue go there (to its front, out of this queue's started
        registry, atomically), recorded in the quarantine list; the rest stay."""
        out = []
        for row in rows:
            if row.foreign and row.job is not None:
                target = row.job.queue
                self.quarantine_put(row, f"job for {row.job.model!r} found on the {row.ref} queue; moved to {target}")
                self.bridge.move_to(row.ref, target, row.raw.id, exec_id=row.exec_id)
            else:
                out.append(row)
        return out

    def quarantine_put(self, row: Row, reason: str) -> None:
        self.bridge.quarantine.put(self.bridge.queues[row.ref].key, reason, row.raw.id)

    def _reopen_requeued(self, rows: Sequence[Row]) -> None:
        """Jobs recorded as failed and then requeued (`rq requeue`, retry-failed) run again: their failure is
        taken back from the batch first, so the new run's result is the one recorded."""
        requeued = [row for row in rows if row.raw.failed_before and row.job is not None]
        for row in requeued:
            job = row.job
            assert job is not None
            try:
                if job.batch and reopen_failed(self.redis, self.keys, job.batch, job.custom_id, row.raw.id):
                    log.info("job %s was requeued after failing: running it again", row.raw.id)
            except redis.exceptions.ResponseError:
                pass  # a batch key of the wrong type: writing this job's result refuses it (and quarantines)
        self.bridge.clear_failed([row.raw.id for row in requeued])

    def already_done(self, rows: Sequence[Row]) -> set[str]:
        """Jobs whose result was written before a crash: a finished job never runs again."""
        return {jid for jid, state in self.answer_states(rows).items() if state == 1}

    def answer_states(self, rows: Sequence[Row]) -> dict[str, int]:
        """Per job id: 1 its result was written before a crash (a finished job never runs again), 2 its follow-up
        answered its item but its own step is missing (it runs to record it), 0 not answered."""
        # Per batch (and whether its model escalates: an escalated step is done too), (job id, custom id) pairs.
        groups: dict[tuple[str, bool], list[tuple[str, str]]] = {}
        for row in rows:
            job = row.job
            assert job is not None
            if job.batch is not None:
                escalates = bool(self.config.models[job.model].escalates_to)
                groups.setdefault((job.batch, escalates), []).append((row.raw.id, job.custom_id))
        if not groups:
            return {}
        with self.redis.pipeline(transaction=False) as pipe:
            for (batch, escalates), members in groups.items():
                keys = [self.keys.batch_results(batch), self.keys.batch_steps(batch)]
                pairs = [x for jid, cid in members for x in (cid, jid)]
                self._answered(keys=keys, args=["1" if escalates else "0", *pairs], client=pipe)
            found = pipe.execute(raise_on_error=False)  # a wrong-typed batch key reads as "not done"
        states: dict[str, int] = {}
        for members, answer in zip(groups.values(), found, strict=True):
            if isinstance(answer, list):
                states.update((jid, int(f)) for (jid, _), f in zip(members, answer, strict=True))
        return states

    def _flags(self, batches: set[str]) -> dict[str, BatchFlags]:
        return {b: batch_flags(self.redis, self.keys, b) for b in batches}

    def _mark_running(self, rows: Sequence[Row]) -> None:
        """Add runnable jobs to their batch's running set (writing the result removes them), so `kevlaya
        status` counts what is running."""
        with self.redis.pipeline(transaction=False) as pipe:
            for batch, ids in by_batch(rows).items():  # one SADD and one EXPIRE a batch, not a job
                pipe.sadd(self.keys.batch_running(batch), *ids)  # fails alone (this batch) if not a set
                pipe.expire(self.keys.batch_running(batch), self.enqueue.ttl_s)
            pipe.execute(raise_on_error=False)

    def unmark_running(self, rows: Sequence[Row]) -> None:
        """Jobs given back to their queue before they ran (worker.ahead): out of their batch's running set."""
        with self.redis.pipeline(transaction=False) as pipe:
            for batch, ids in by_batch(rows).items():
                pipe.srem(self.keys.batch_running(batch), *ids)
            pipe.execute(raise_on_error=False)

    def _closed(self, row: Row, job: Job, error_type: str, message: str) -> Row:
        """A job of a cancelled or expired batch. A follow-up whose parent's answer exists ends the item with
        that answer (computed work is kept); anything else ends with `error_type`."""
        keeps_parent = job.parent is not None and job.batch is not None
        if keeps_parent and promote_step(self.redis, self.keys, job.batch or "", job.custom_id, reason=error_type):
            return replace(row, job=None)
        return replace(row, job=job, result=self.failure(row, job, error_type, message))

    # ---- results ------------------------------------------------------------------------------
    def failure_from(self, row: Row, error_type: str, message: str) -> Result:
        payload = row.raw.payload or {}
        cid, batch, meta = payload.get("custom_id"), payload.get("batch"), payload.get("meta")
        parent = None
        if not (isinstance(cid, str) and isinstance(batch, str)):
            # No readable payload (its hash deleted, or its data garbage): the item is found from the job's id, which
            # kevlaya derives from it, so the item still ends with this error instead of pending forever.
            found = self._item_of(row.raw.id)
            if found is not None:
                batch, cid, parent = found
        result = Result.failure(
            custom_id=cid if isinstance(cid, str) else row.raw.id,
            model=row.model,
            job_id=row.raw.id,
            batch=batch if isinstance(batch, str) else None,
            error_type=error_type,
            message=message,
            meta=meta if error_type == WORKER_DIED and isinstance(meta, (dict, list, str, int, float)) else None,
        )
        return replace(result, escalated_from=parent) if parent else result

    def _item_of(self, rq_id: str) -> tuple[str, str, str | None] | None:
        """(batch, custom_id, parent job id or None) of the item a kevlaya job id was made for (shared.keys.job_id,
        followup_id), by hashing the batch's custom ids; None if the id is none of kevlaya's or names no item."""
        parent = None
        for name in self.config.names:  # a follow-up's id: its parent's and the model it escalated to
            if rq_id.endswith(f"-{name}"):
                parent, rq_id = rq_id[: -len(name) - 1], rq_id[: -len(name) - 1]
                break
        batch, sep, digest = rq_id.rpartition("-")
        if not sep or not BATCH_ID_RE.match(batch) or not _DIGEST_RE.fullmatch(digest):
            return None
        try:
            start = 0
            while True:
                chunk = self.redis.lrange(self.keys.batch_items(batch), start, start + 999)
                for raw in chunk:
                    cid = raw.decode("utf-8", "surrogatepass")
                    if job_id(batch, cid) == rq_id:
                        return batch, cid, parent
                if len(chunk) < 1000:
                    return None
                start += 1000
        except (redis.exceptions.ResponseError, UnicodeError):
            return None

    @staticmethod
    def failure(row: Row, job: Job, error_type: str, message: str) -> Result:
        result = Result.failure(
            custom_id=job.custom_id,
            model=job.model,
            job_id=row.raw.id,
            batch=job.batch,
            error_type=error_type,
            message=message,
            meta=job.meta,
        )
        # A follow-up that fails still answers an escalated item (the batch counts it as settled).
        return replace(result, escalated_from=job.parent.job_id) if job.parent else result

    def to_result(self, row: Row, out: RowOutput, *, engine_s: float, batch_size: int, flags: BatchFlags) -> Result:
        job = row.job
        assert job is not None
        timing: dict[str, float] = {"engine_s": round(engine_s, 4), "batch_size": batch_size}
        if row.raw.enqueued_at:
            timing["queued_s"] = round(max(0.0, time.time() - engine_s - row.raw.enqueued_at), 4)
        result = Result(
            custom_id=job.custom_id,
            model=job.model,
            job_id=row.raw.id,
            batch=job.batch,
            text=out.text,
            decision=out.decision,
            confidence=out.confidence,
            raw_confidence=out.raw_confidence,
            choices=out.choices,
            logprobs=out.logprobs,
            usage={"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}
            if out.error is None
            else {},
            max_new_tokens=self._limit(job),
            truncated=True if out.truncated and out.error is None else None,
            escalated_from=job.parent.job_id if job.parent else None,
            timing=timing,
            model_version=dict(self.versions.get(job.model, {})),
            meta=job.meta,
            error=out.error,
        )
        spec = self.config.models[job.model]
        target = escalates(spec, job, result, batch_off=flags.escalate_off or flags.cancelled)
        if target is None and row.followed and result.error is None:
            target = spec.escalates_to  # its item's answer is its follow-up's already: this run is its step
        if target is None:
            return result
        return replace(result, final=False, escalated_to=follow_up(job, result, target).job_id)

    def results(self, triage: Triage, outputs: Sequence[RowOutput], *, engine_s: float) -> list[Row]:
        """The runnable rows with their results (the engine's outputs, index-aligned with `triage.runnable`)."""
        n = len(triage.runnable)
        return [
            replace(
                r,
                result=self.to_result(
                    r, out, engine_s=engine_s, batch_size=n, flags=triage.flags.get(r.job.batch or "", BatchFlags())
                ),
            )
            for r, out in zip(triage.runnable, outputs, strict=True)
            if r.job is not None
        ]

    def _limit(self, job: Job) -> int | None:
        """The new-token limit the engine applied: the job's, capped by its model's (None for choices)."""
        if job.scores_choices:
            return None
        own = self.config.models[job.model].max_new_tokens
        return min(job.max_new_tokens, own) if job.max_new_tokens else own

    # ---- writing ------------------------------------------------------------------------------
    def write(self, rows: Sequence[Row], *, ttl_s: int) -> Written:
        """Follow-ups first, then results, then RQ bookkeeping: a crash in between re-runs, never loses."""
        entries = [
            follow_up(row.job, row.result, self.config.models[row.job.model].escalates_to or "")
            for row in rows
            if row.job is not None and row.result is not None and row.result.escalated_to
        ]
        created = enqueue_absent(self.redis, self.queues, entries, self.enqueue, self.bridge.quarantine)
        writes = [row for row in rows if row.result is not None and row.result.batch is not None]
        outcomes = record_results(self.redis, self.keys, [row.result for row in writes if row.result])
        duplicates = 0
        for row, outcome in zip(writes, outcomes, strict=True):
            result = row.result
            assert result is not None
            if isinstance(outcome, redis.exceptions.ResponseError):
                # A batch whose keys a hostile writer replaced: this result only is refused, never the worker.
                self.bridge.quarantine.put(
                    self.keys.batch(result.batch or ""), f"batch keys unusable: {outcome}", row.raw.id
                )
            elif isinstance(outcome, Exception):
                raise outcome
            elif outcome is None:
                log.warning("job %s: %r is not an item of batch %s", row.raw.id, result.custom_id, result.batch)
            elif not outcome and result.final:
                duplicates += 1  # a second final answer was refused: counted, so tests and operators see it
        by_take: dict[tuple[QueueRef, str | None], list[tuple[str, str | None]]] = {}
        for row in rows:
            result = row.result
            error = None if result is None or result.error is None else f"{result.error.type}: {result.error.message}"
            by_take.setdefault((row.ref, row.exec_id), []).append((row.raw.id, error))
        if duplicates:
            self.redis.incrby(self.keys.counter("duplicate_final_results"), duplicates)
        for (ref, exec_id), done in by_take.items():
            self.bridge.finish(ref, done, ttl_s=ttl_s, exec_id=exec_id)
        return Written(created, duplicates)


def names_this_job(rq_id: str, job: Job) -> bool:
    """Whether a batch job's payload is its own: kevlaya derives every such job's id from its item (shared.keys),
    and a follow-up's from the job it escalates."""
    if job.parent is None:
        return rq_id == job_id(job.batch or "", job.custom_id)
    own = job_id(job.batch or "", job.custom_id)
    parent = job.parent.job_id
    return rq_id == followup_id(parent, job.model) and (parent == own or parent.startswith(f"{own}-"))


def by_batch(rows: Sequence[Row]) -> dict[str, list[str]]:
    """The job ids of rows whose job belongs to a batch, by batch."""
    out: dict[str, list[str]] = {}
    for row in rows:
        if row.job is not None and row.job.batch:
            out.setdefault(row.job.batch, []).append(row.raw.id)
    return out


def dead_letter(settler: Settler, rows: Sequence[Row]) -> list[Row]:
    """Rows whose job killed its worker again while running alone: failed for good, never run again. A job whose
    answer was written before that crash (killed between its write and RQ's bookkeeping) keeps its answer: only its
    bookkeeping is left, as for any job found answered."""
    decoded = [settler.decode(row) for row in rows]
    done = settler.already_done([r for r in decoded if r.job is not None and r.result is None])
    out = []
    for row in rows:
        if row.raw.id in done:
            log.warning("job %s: its worker died after its answer was written; keeping the answer", row.raw.id)
            out.append(replace(row, job=None, result=None))
            continue
        log.error("job %s: its worker died each time it ran (%d crashes); failing it", row.raw.id, row.raw.crashes)
        message = f"the worker died while running it ({row.raw.crashes} crashes)"
        out.append(replace(row, result=settler.failure_from(row, WORKER_DIED, message)))
    return out


def outputs_tokens(outputs: Sequence[Any], field: str = "completion_tokens") -> int:
    return sum(getattr(o, field, 0) or 0 for o in outputs)
