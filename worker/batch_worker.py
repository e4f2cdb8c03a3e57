"""The batch worker: drains the Kev and Laya queues in large same-model batches and never loses a job.

One loop, one `except` boundary per batch. Each pass: recover abandoned jobs (rate-limited), pick a model
(worker.policy), take up to N jobs atomically (worker.rqcompat), run them through the engine as one
batch, write every result (shared.store, exactly one final result per item), escalate unsure Laya
answers to Kev follow-ups with deterministic ids, and finalise each job in RQ's registries.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import redis.exceptions
from redis import Redis

from shared.errors import (
    BAD_PAYLOAD,
    CANCELLED,
    INTERNAL,
    WORKER_DIED,
    PayloadError,
    ValidationError,
)
from shared.job import Job, Parent
from shared.keys import DEFAULT_PREFIX, Keys, followup_id
from shared.models import ESCALATES_TO, MODEL_NAMES
from shared.result import Result
from shared.store import DEFAULT_BATCH_TTL_S, batch_flags, record_result
from worker.escalation import escalation_reason
from worker.faults import maybe_crash
from worker.outputs import RowOutput
from worker.policy import QueueState, choose_model
from worker.rqcompat import RawJob, RQBridge

log = logging.getLogger("kevlaya.worker")


class EngineLike(Protocol):
    """What the worker needs from an engine (the real one, or a no-op one for queue benchmarks)."""

    def run(self, jobs: Sequence[Job], *, time_limit_s: float | None = None) -> list[Any]: ...
    def max_rows(self, model: str) -> int: ...
    def expect(self, job: Job) -> None: ...
    def model_version(self, model: str) -> dict[str, str]: ...
    def escalation_rule(self, model: str) -> Any: ...
    def shares_base(self, a: str, b: str) -> bool: ...
    def peak_memory_bytes(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    burst: bool = False
    max_wait_ms: int = 2000
    heartbeat_interval_s: float = 3.0
    job_heartbeat_ttl_s: float = 20.0
    worker_ttl_s: int = 20
    idle_poll_s: float = 0.1
    recovery_interval_s: float = 5.0
    result_ttl_s: int = DEFAULT_BATCH_TTL_S
    followup_retries: int = 3
    mixed_tails: bool = True
    batch_time_limit_s: float = 900.0
    name: str | None = None
    prefix: str = DEFAULT_PREFIX


@dataclass
class WorkerStats:
    batches: int = 0
    jobs: int = 0
    errors: int = 0
    switches: int = 0
    escalations: int = 0
    recovered: int = 0
    mixed_batches: int = 0
    generated_tokens: int = 0
    engine_s: float = 0.0
    started_at: float = field(default_factory=time.time)
    first_job_at: float | None = None
    last_job_at: float | None = None
    peak_memory_bytes: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "batch_sizes"}
        out["batch_sizes"] = {str(k): v for k, v in sorted(self.batch_sizes.items())}
        return out


@dataclass(frozen=True)
class _Taken:
    model: str
    raw: RawJob


class BatchWorker:
    """A non-forking worker: models stay resident in this process for its whole life."""

    def __init__(self, redis: Redis, engine: EngineLike, settings: WorkerSettings = WorkerSettings()) -> None:
        self.redis = redis
        self.engine = engine
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self.name = settings.name or f"kevlaya-{socket.gethostname()}-{uuid.uuid4().hex[:8]}".replace(":", "-")
        self.bridge = RQBridge(redis, {m: self.keys.queue_name(m) for m in MODEL_NAMES}, self.name)
        self.stats = WorkerStats()
        self.current_model: str | None = None
        self._stop = threading.Event()
        self._in_flight: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._last_recovery = 0.0
        self._redis_ok_since = time.time()  # reset on every Redis error (see _maybe_recover)

    # ---- lifecycle ----------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        """SIGTERM/SIGINT: finish the current batch, leave the rest queued, exit 0."""
        if not self._stop.is_set():
            log.info("stop requested: finishing the current batch")
        self._stop.set()

    def work(self) -> WorkerStats:
        self._install_signals()
        rq_worker = self._wait_for_redis(lambda: self.bridge.make_rq_worker(self.settings.worker_ttl_s))
        self._wait_for_redis(rq_worker.register_birth)
        # RQ's birth gives the worker key worker_ttl + 60 s; beat once now, so a crash right after start is
        # noticed within worker_ttl, not a minute later.
        self._wait_for_redis(lambda: rq_worker.heartbeat(self.settings.worker_ttl_s))
        beat = threading.Thread(target=self._heartbeat_loop, args=(rq_worker,), daemon=True, name="heartbeat")
        beat.start()
        log.info("worker %s started (burst=%s)", self.name, self.settings.burst)
        try:
            while not self._stop.is_set():
                try:
                    if not self._step():
                        break
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                    # Whatever this batch had not written stays registered as started; its heartbeat now
                    # lapses, and recovery requeues it once Redis is back. Nothing is lost, nothing doubled.
                    log.warning("redis unavailable (%s); retrying", exc)
                    self._redis_ok_since = time.time()
                    self._stop.wait(1.0)
        finally:
            self._stop.set()
            beat.join(timeout=5)
            self._publish_stats()
            try:
                rq_worker.register_death()
            except redis.exceptions.RedisError:
                log.warning("could not register death (redis unavailable)")
        log.info("worker %s stopped: %s", self.name, self._summary())
        return self.stats

    def _install_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)

    def _wait_for_redis(self, fn: Any) -> Any:
        """Call fn, waiting with backoff while Redis is down (the model stays loaded meanwhile)."""
        delay = 0.5
        while True:
            try:
                return fn()
            except redis.exceptions.ConnectionError as exc:
                if self._stop.is_set():
                    raise
                log.warning("redis unavailable (%s); retrying in %.1f s", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)

    def _heartbeat_loop(self, rq_worker: Any) -> None:
        while not self._stop.wait(self.settings.heartbeat_interval_s):
            try:
                if not self.redis.exists(rq_worker.key):
                    rq_worker.register_birth()  # the key expired while Redis was away: announce ourselves again
                rq_worker.heartbeat(self.settings.worker_ttl_s)
                self.redis.zadd(self.keys.workers(), {self.name: time.time()})
                with self._lock:
                    in_flight = {m: list(ids) for m, ids in self._in_flight.items()}
                for model, ids in in_flight.items():
                    self.bridge.heartbeat(model, ids, ttl_s=self.settings.job_heartbeat_ttl_s)
            except redis.exceptions.RedisError as exc:
                self._redis_ok_since = time.time()
                log.warning("heartbeat failed: %s", exc)

    # ---- one pass of the loop -----------------------------------------------------------------
    def _step(self) -> bool:
        """One batch, or one idle poll. Returns False when a burst worker should exit."""
        self._maybe_recover()
        now = time.time()
        depths = self.bridge.depth_and_oldest()
        states = {m: QueueState(d, (now - t) * 1000 if (d and t) else 0.0) for m, (d, t) in depths.items()}
        model = choose_model(self.current_model, states, max_wait_ms=self.settings.max_wait_ms)
        if model is None:
            if self.settings.burst and not self._anything_recoverable():
                return False
            self._stop.wait(self.settings.idle_poll_s)
            return True
        if self.current_model is not None and model != self.current_model:
            self.stats.switches += 1
        self.current_model = model
        self._run_batch(model, states)
        return True

    def _run_batch(self, model: str, states: dict[str, QueueState]) -> None:
        self.bridge.begin_batch()
        limit = self.engine.max_rows(model)
        ttl = self.settings.job_heartbeat_ttl_s
        taken = [_Taken(model, r) for r in self.bridge.load(self.bridge.take(model, limit, ttl_s=ttl))]
        other = next((m for m in MODEL_NAMES if m != model), None)
        if self._fill_tail(model, other, len(taken), limit, states):
            extra = self.bridge.load(self.bridge.take(other, limit - len(taken), ttl_s=ttl))
            taken += [_Taken(other, r) for r in extra]
        if not taken:
            return
        with self._lock:
            self._in_flight = {m: [t.raw.id for t in taken if t.model == m] for m in {t.model for t in taken}}
        try:
            self._process(taken)
        finally:
            with self._lock:
                self._in_flight = {}

    def _fill_tail(self, model: str, other: str | None, n: int, limit: int, states: dict[str, QueueState]) -> bool:
        """Mix the other model's jobs into this batch only when both queues end in it (a small tail)."""
        if not self.settings.mixed_tails or other is None or n >= limit:
            return False
        other_depth = states[other].depth
        return 0 < other_depth <= limit - n and states[model].depth <= n and self.engine.shares_base(model, other)

    # ---- processing a taken batch -------------------------------------------------------------
    def _process(self, taken: list[_Taken]) -> None:
        """Refused, already-answered and cancelled jobs are written first; then the normal jobs run as one
        batch; then at most one *suspect* (its worker died running it) runs alone -- the other suspects go
        back to the queue untouched, so a poison job can only ever take itself down."""
        started = time.time()
        runnable: list[tuple[_Taken, Job]] = []
        finished: list[tuple[_Taken, Result | None]] = []
        decoded = [(t, self._decode(t)) for t in taken]
        done = self._already_done([(t, j) for t, j in decoded if isinstance(j, Job)])
        flags = self._flags({j.batch for _, j in decoded if isinstance(j, Job) and j.batch})
        for t, job in decoded:
            if isinstance(job, Result):
                finished.append((t, job))
            elif t.raw.id in done:
                finished.append((t, None))  # answered before a crash; only RQ bookkeeping is left
            elif flags.get(job.batch, (False, False))[0]:
                finished.append((t, self._failure(t, job, CANCELLED, "batch cancelled before this item ran")))
            else:
                runnable.append((t, job))
        suspects = [(t, j) for t, j in runnable if t.raw.suspect]
        for t, _ in suspects[1:]:
            self.bridge.give_back(t.model, t.raw.id)
        groups = [[(t, j) for t, j in runnable if not t.raw.suspect], suspects[:1]]
        self._write(finished)
        outputs: list[Any] = []
        ran: list[tuple[_Taken, Job]] = []
        for group in (g for g in groups if g):
            group_started = time.time()
            outs = self._run_engine([j for _, j in group])
            engine_s = time.time() - group_started  # this group's own engine time, not the batch's so far
            results = [
                (t, self._result(t, job, out, engine_s, len(group), flags))
                for (t, job), out in zip(group, outs, strict=True)
            ]
            self._write(results)  # each group's results are safe before the next group runs
            outputs += outs
            ran += group
        self._account(taken, ran, outputs, started, time.time() - started)

    def _decode(self, t: _Taken) -> Job | Result:
        """The job, or an error result for a job that cannot run (hostile, malformed, invalid)."""
        raw = t.raw
        payload = raw.payload or {}
        if raw.problem is not None:
            log.warning("refusing job %s: %s", raw.id, raw.problem)
            return self._failure_from(t, payload, raw.problem.type, str(raw.problem))
        try:
            job = Job.from_dict(payload, allow_system=True)
        except ValidationError as exc:
            return self._failure_from(t, payload, BAD_PAYLOAD, f"invalid payload: {exc}")
        if job.model != t.model:
            return self._failure_from(t, payload, BAD_PAYLOAD, f"job for {job.model!r} found on the {t.model} queue")
        return job

    def _failure_from(self, t: _Taken, payload: dict[str, Any], error_type: str, message: str) -> Result:
        cid = payload.get("custom_id")
        return Result.failure(
            custom_id=cid if isinstance(cid, str) else t.raw.id,
            model=t.model,
            job_id=t.raw.id,
            batch=payload.get("batch") if isinstance(payload.get("batch"), str) else None,
            error_type=error_type,
            message=message,
        )

    def _failure(self, t: _Taken, job: Job, error_type: str, message: str) -> Result:
        return Result.failure(
            custom_id=job.custom_id,
            model=job.model,
            job_id=t.raw.id,
            batch=job.batch,
            error_type=error_type,
            message=message,
            meta=job.meta,
        )

    def _already_done(self, items: list[tuple[_Taken, Job]]) -> set[str]:
        """Jobs whose result was written before a crash: a finished job never runs again."""
        if not items:
            return set()
        with self.redis.pipeline(transaction=False) as pipe:
            for _, job in items:
                if job.batch is None:
                    pipe.echo("")
                    continue
                key = self.keys.batch_results(job.batch)
                if job.model in ESCALATES_TO:  # a Laya step that escalated is done too
                    pipe.eval(
                        "return redis.call('HEXISTS', KEYS[1], ARGV[1]) + redis.call('HEXISTS', KEYS[2], ARGV[1])",
                        2,
                        key,
                        self.keys.batch_steps(job.batch),
                        job.custom_id,
                    )
                else:
                    pipe.hexists(key, job.custom_id)
            found = pipe.execute()
        return {t.raw.id for (t, _), f in zip(items, found, strict=True) if f and f != b""}

    def _flags(self, batches: set[str]) -> dict[str, tuple[bool, bool]]:
        return {b: batch_flags(self.redis, self.keys, b) for b in batches}

    def _run_engine(self, jobs: list[Job]) -> list[Any]:
        """The one except boundary per batch: if the engine raises, each job is retried alone, so one bad
        job cannot sink its batch-mates (a job that crashes the whole process is handled by recovery)."""
        try:
            maybe_crash(jobs)
            return self.engine.run(jobs, time_limit_s=self.settings.batch_time_limit_s)
        except Exception:
            log.exception("engine failed on a batch of %d; retrying each job alone", len(jobs))
            return [self._run_alone(job) for job in jobs]

    def _run_alone(self, job: Job) -> Any:
        try:
            return self.engine.run([job], time_limit_s=self.settings.batch_time_limit_s)[0]
        except Exception as exc:
            log.exception("job %s failed alone", job.custom_id)
            return RowOutput.failed(INTERNAL, f"{type(exc).__name__}: {exc}")

    def _result(
        self,
        t: _Taken,
        job: Job,
        out: Any,
        engine_s: float,
        batch_size: int,
        flags: dict[str, tuple[bool, bool]],
    ) -> Result:
        queued_s = max(0.0, time.time() - engine_s - t.raw.enqueued_at) if t.raw.enqueued_at else None
        timing = {"engine_s": round(engine_s, 4), "batch_size": batch_size}
        if queued_s is not None:
            timing["queued_s"] = round(queued_s, 4)
        result = Result(
            custom_id=job.custom_id,
            model=job.model,
            job_id=t.raw.id,
            batch=job.batch,
            text=out.text,
            decision=out.decision,
            confidence=out.confidence,
            raw_confidence=out.raw_confidence,
            choices=out.choices,
            usage={"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}
            if out.error is None
            else {},
            escalated_from=job.parent.job_id if job.parent else None,
            timing=timing,
            model_version=self.engine.model_version(job.model),
            meta=job.meta,
            error=out.error,
        )
        if out.error is not None or job.model not in ESCALATES_TO:
            return result
        cancelled, batch_off = flags.get(job.batch, (False, False))
        reason = escalation_reason(
            self.engine.escalation_rule(job.model),
            text=out.text or "",
            confidence=out.confidence,
            job_setting=job.escalate,
            batch_off=batch_off or cancelled,
        )
        if reason is None:
            return result
        return replace(result, final=False, escalated_to=followup_id(t.raw.id, ESCALATES_TO[job.model]))

    # ---- writing results ----------------------------------------------------------------------
    def _write(self, items: list[tuple[_Taken, Result | None]]) -> None:
        """Follow-ups first, then results, then RQ bookkeeping: a crash in between re-runs, never loses."""
        by_model: dict[str, list[tuple[str, str | None]]] = {}
        follow_ups: list[Job] = []
        for t, result in items:
            if result is not None and result.escalated_to:
                follow_ups.append(self._enqueue_followup(t, result))
            if result is not None and result.batch is not None:
                first = record_result(self.redis, self.keys, result)
                if first is None:
                    log.warning(
                        "job %s: %r is not an item of batch %s; result not written",
                        t.raw.id,
                        result.custom_id,
                        result.batch,
                    )
                elif not first and result.final:
                    # A second final answer for an item was refused: counted, so tests and operators see it.
                    self.redis.incr(self.keys.counter("duplicate_final_results"))
            error = None if result is None or result.error is None else f"{result.error.type}: {result.error.message}"
            by_model.setdefault(t.model, []).append((t.raw.id, error))
        for model, done in by_model.items():
            self.bridge.finish(model, done, ttl_s=self.settings.result_ttl_s)
        if follow_ups:
            # The longest by characters stands for all (encoding each would cost ~0.3 ms a job).
            self.engine.expect(max(follow_ups, key=_prompt_chars))

    def _enqueue_followup(self, t: _Taken, result: Result) -> Job:
        job = Job.from_dict(t.raw.payload or {}, allow_system=True)
        target = ESCALATES_TO[job.model]
        parent = Parent(
            job_id=t.raw.id,
            model=job.model,
            text=result.text or "",
            decision=result.decision,
            confidence=result.confidence,
        )
        follow = replace(job, model=target, parent=parent, max_new_tokens=None, escalate=None)
        created = self.bridge.enqueue_once(
            target,
            result.escalated_to or followup_id(t.raw.id, target),
            follow.to_dict(),
            retries=self.settings.followup_retries,
            ttl_s=self.settings.result_ttl_s,
        )
        if created:
            self.stats.escalations += 1
        return follow

    # ---- recovery -----------------------------------------------------------------------------
    def _maybe_recover(self, *, force: bool = False) -> None:
        if not force and time.time() - self._last_recovery < self.settings.recovery_interval_s:
            return
        self._last_recovery = time.time()
        # Right after a Redis outage every worker's heartbeat has lapsed: give live ones one TTL to beat
        # again before taking anything of theirs.
        others = time.time() - self._redis_ok_since >= self.settings.worker_ttl_s
        with self._lock:
            in_flight = {i for ids in self._in_flight.values() for i in ids}
        for model in MODEL_NAMES:
            for member, job_id in self.bridge.abandoned(model, in_flight=in_flight, others=others):
                if self.bridge.claim(model, member):
                    self._recover_one(model, job_id)
            for job_id in self.bridge.stuck_intermediate(model, older_than_s=30):
                self.bridge.requeue_front(model, job_id, use_retry=False, suspect=False)
                self.stats.recovered += 1

    def _recover_one(self, model: str, job_id: str) -> None:
        """A job whose worker died: requeue it (marked suspect, so it runs alone) or fail it for good."""
        self.stats.recovered += 1
        if self.bridge.retries_left(job_id) > 0:
            log.warning("recovering job %s of a dead worker: requeued", job_id)
            self.bridge.requeue_front(model, job_id, use_retry=True, suspect=True)
            return
        (raw,) = self.bridge.load([job_id])
        t = _Taken(model, raw)
        payload = raw.payload or {}
        log.error("job %s: its worker died on every attempt; failing it", job_id)
        result = self._failure_from(
            t, payload, WORKER_DIED, f"the worker died while running it ({raw.attempts} attempts)"
        )
        if isinstance(payload.get("meta"), (dict, list, str, int, float)):
            result = replace(result, meta=payload.get("meta"))
        self._write([(t, result)])

    def _anything_recoverable(self) -> bool:
        """For --burst: jobs still registered as running somewhere, which may come back to the queue."""
        if self.bridge.pending_started() == 0:
            return False
        self._maybe_recover(force=True)
        return self.bridge.pending_started() > 0 or any(d for d, _ in self.bridge.depth_and_oldest().values())

    # ---- stats --------------------------------------------------------------------------------
    def _account(
        self, taken: list[_Taken], runnable: list, outputs: list[Any], started: float, engine_s: float
    ) -> None:
        s = self.stats
        s.batches += 1
        s.jobs += len(taken)
        s.batch_sizes[len(taken)] += 1
        s.mixed_batches += len({t.model for t in taken}) > 1
        s.errors += sum(1 for o in outputs if getattr(o, "error", None) is not None)
        tokens = sum(getattr(o, "completion_tokens", 0) or 0 for o in outputs)
        s.generated_tokens += tokens
        s.engine_s += engine_s
        s.first_job_at = s.first_job_at or started
        s.last_job_at = time.time()
        s.peak_memory_bytes = max(s.peak_memory_bytes, self.engine.peak_memory_bytes())
        waits = [started - t.raw.enqueued_at for t in taken if t.raw.enqueued_at]
        wait = max(waits) if waits else 0.0
        models = "+".join(sorted({t.model for t in taken}))
        log.info(
            "batch model=%s n=%d tokens=%d wait=%.2fs run=%.2fs tok/s=%.0f",
            models,
            len(taken),
            tokens,
            wait,
            engine_s,
            tokens / max(engine_s, 1e-9),
        )
        if s.batches % 10 == 0:
            self._publish_stats()

    def _publish_stats(self) -> None:
        try:
            flat = {k: str(v) for k, v in self.stats.to_dict().items()}
            self.redis.hset(self.keys.worker_stats(self.name), mapping=flat)
            self.redis.expire(self.keys.worker_stats(self.name), 86400)
        except redis.exceptions.RedisError:
            pass

    def _summary(self) -> str:
        s = self.stats
        return f"{s.jobs} jobs in {s.batches} batches, {s.switches} switches, {s.escalations} escalations"


__all__ = ["BatchWorker", "PayloadError", "WorkerSettings", "WorkerStats"]


def _prompt_chars(job: Job) -> int:
    """Characters of what a job's prompt is rendered from: its prompt or input fields, and its parent's answer."""
    fields = sum(len(k) + len(v) for k, v in (job.input or {}).items())
    return len(job.prompt or "") + fields + len(job.parent.text if job.parent else "")
