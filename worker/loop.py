"""The batch worker: drains the model queues in large same-model batches and never loses a job.

One loop, one `except` boundary per batch. Each pass: recover abandoned jobs (rate-limited, worker.recovery),
pick a lane and model (worker.lanes, worker.policy), take up to N jobs atomically or one suspect group
(worker.take), triage them, run the rest through the engine as one batch, and settle every row
(worker.settle): results written, escalations enqueued as follow-ups, RQ's registries updated. While the
engine runs a take, a helper thread writes the take before it and takes the next one ahead (worker.ahead).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import redis.exceptions
from redis import Redis

from shared.enqueue import EnqueueSettings
from shared.errors import INTERNAL
from shared.job import Job
from shared.keys import BULK, INTERACTIVE, Keys, QueueRef
from worker.ahead import AHEAD_POLL_S, Answered, Helper, InHand, Prepared, exec_ids, in_hand
from worker.config import ModelsConfig
from worker.faults import maybe_crash
from worker.followups import prompt_chars
from worker.lanes import BulkTurn, choose_queue
from worker.metrics import HealthServer
from worker.notices import Notifier
from worker.outputs import RowOutput
from worker.pace import BulkPace, TakeTime
from worker.policy import QueueState
from worker.presence import Presence
from worker.recovery import RecoveryPass
from worker.rqcompat import RQBridge
from worker.rqcompat.bridge import QueueFacts
from worker.settings import WorkerSettings, worker_name
from worker.settle import Row, Settler, Triage, dead_letter, outputs_tokens
from worker.stats import PUBLISH_EVERY_BATCHES, BatchFacts, WorkerStats
from worker.tail import tail_take
from worker.take import Take, Taker
from worker.versions import model_versions
from worker.wake import Wake

log = logging.getLogger("kevlaya.worker")

T = TypeVar("T")


class EngineLike(Protocol):
    """What the worker needs from an engine: answers, index-aligned; how many rows to take; and a hint of
    the longest job about to be queued (so the next take of its model is sized for it)."""

    def run(
        self,
        jobs: Sequence[Job],
        *,
        time_limit_s: float | None = None,
        encoded: Any = None,
        on_gpu_wait: Callable[[], None] | None = None,
    ) -> list[Any]: ...
    def prepare(self, jobs: Sequence[Job]) -> Any: ...  # host work for `run`'s `encoded` (None: nothing)
    def capacity(self, model: str) -> int: ...
    def expect(self, job: Job) -> bool | None: ...


class BatchWorker:
    """A non-forking worker: models stay resident in this process for its whole life."""

    def __init__(
        self,
        redis: Redis,
        engine: EngineLike,
        config: ModelsConfig,
        settings: WorkerSettings | None = None,
        *,
        versions: Mapping[str, dict[str, str]] | None = None,
    ) -> None:
        self.redis = redis
        self.engine = engine
        self.config = config
        self.settings = settings = settings or WorkerSettings()
        self.keys = Keys(settings.prefix)
        self.name = worker_name(settings.name)
        self.bridge = RQBridge(redis, self.keys, config.names, self.name)
        self.stats = WorkerStats()
        enqueue = EnqueueSettings(ttl_s=settings.result_ttl_s, retries=settings.followup_retries)
        versions = model_versions(config) if versions is None else versions
        self.settler = Settler(redis, self.keys, config, self.bridge, versions=versions, enqueue=enqueue)
        self.recovery = RecoveryPass(redis, self.keys, self.bridge, config.names, self.stats)
        self.current_model: str | None = None
        self.escalates_to = {name: spec.escalates_to for name, spec in config.models.items()}
        self._stop = threading.Event()
        self.wake = Wake(redis, self.keys.queued(), self._stop)  # the idle wait: a submit ends it
        self.ready = threading.Event()  # registered and serving (/readyz)
        self._suspended = False
        self._errors_reported = 0
        self.health: HealthServer | None = None
        # Jobs in hand: the take running, the one answered and being written behind it, the one taken ahead.
        self._running: list[InHand] = []
        self._unwritten: Answered | None = None
        self._ahead: Prepared | None = None
        self._held_ahead: list[InHand] = []
        self.helper: Helper[Prepared | None] = Helper()
        self._capacity: dict[str, int] = {}  # each model's take as the loop last sized it (for the helper's look)
        self._lock = threading.Lock()
        self._last_recovery = 0.0
        self.bulk_turn = BulkTurn(every=settings.bulk_every_takes)
        self.pace = BulkPace(take_s=settings.paced_take_ms / 1000, window_s=settings.interactive_window_s)
        self._paced = False  # for the log line when pacing starts and stops
        self._pace_now = time.monotonic()  # the step's one reading of the pacer's clock
        self.presence = Presence(redis, self.keys, self.bridge, settings, stop=self._stop, in_flight=self._in_hand_now)
        self.taker = Taker(
            self.bridge,
            config,
            settings,
            bulk_limit=lambda model, capacity: self.pace.limit(model, capacity, self._pace_now),
        )

    # ---- lifecycle ----------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        """SIGTERM/SIGINT: finish the current batch, leave the rest queued, exit 0."""
        if not self._stop.is_set():
            log.info("stop requested: finishing the current batch")
        self._stop.set()

    def work(self) -> WorkerStats:
        self._install_signals()
        if self.settings.metrics_port is not None:
            self.health = HealthServer(self, self.settings.metrics_port).start()
        try:
            return self._work()
        finally:
            if self.health is not None:
                self.health.stop()

    def _work(self) -> WorkerStats:
        self.presence.arrive()
        notifier = None
        if self.settings.notify_allow:
            allow = self.settings.notify_allow
            notifier = Notifier(
                self.redis, self.keys, self.name, allow=allow, stop=self._stop, on_redis_down=self.presence.redis_down
            ).start()
        self._log_models()
        self.ready.set()
        log.info("worker %s started (burst=%s)", self.name, self.settings.burst)
        down_since: float | None = None  # monotonic: when the current Redis outage was first met
        try:
            while not self._stop.is_set():
                try:
                    if not self._step():
                        break
                    down_since = None
                    self.presence.redis_up()
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                    # Whatever this batch had not written stays registered as started; its heartbeat now
                    # lapses, and recovery requeues it once Redis is back. Nothing is lost, nothing doubled.
                    self._let_go()
                    down_since = time.monotonic() if down_since is None else down_since
                    self.presence.redis_down(exc, retry_in_s=1.0)  # one line per outage, not per retry
                    if self.presence.gives_up(down_since):
                        raise  # a burst run ends: the command names the Redis and exits non-zero
                    self._stop.wait(1.0)
                except redis.exceptions.ResponseError as exc:
                    # A key some writer replaced with another type where no check caught it: the take's
                    # entries lapse and go back to their queue (no crash charged); the worker goes on.
                    log.exception("redis refused a command (%s); carrying on", exc)
                    self._let_go()
                    self.bridge.quarantine.put("worker loop", f"redis refused a command: {exc}", "")
                    self._stop.wait(1.0)
            self._settle_hands()
            self._sweep_held()
        finally:
            self.helper.close()
            self.ready.clear()
            self._stop.set()
            self.wake.close()
            if notifier is not None:
                notifier.thread.join(timeout=5)
            self.stats.publish(self.redis, self.keys, self.name)
            self.presence.leave()
        log.info("worker %s stopped: %s", self.name, self.stats.summary())
        return self.stats

    def _log_models(self) -> None:
        for name, spec in self.config.models.items():
            base = self.config.bases[spec.base].path
            adapter = spec.adapter or "(none: the base itself)"
            log.info("model %s: base %s, adapter %s, version %s", name, base, adapter, self.settler.versions.get(name))

    def _install_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)

    def _in_hand_now(self) -> list[InHand]:
        """Every take in this worker's hands (for the heartbeat and recovery)."""
        with self._lock:
            unwritten = in_hand(self._unwritten.rows) if self._unwritten is not None else []
            return [*self._running, *unwritten, *self._held_ahead]

    def _let_go(self) -> None:
        """After Redis failed mid-step: nothing in hand is tracked any more. The helper's work is waited for; what
        was not written, or taken ahead, lapses and goes back to its queue through recovery (no crash counted)."""
        try:
            self.helper.join()
        except Exception:  # the same outage, seen by the helper
            log.debug("the helper failed too", exc_info=True)
        with self._lock:
            self._running, self._unwritten, self._ahead, self._held_ahead = [], None, None, []

    def _settle_hands(self) -> None:
        """The loop ends normally: the take made ahead goes back to its queue, the last answers are written."""
        self._give_back_ahead()
        self._write_unwritten()

    def _sweep_held(self) -> None:
        """Out of the held set: every mark but those of the takes this worker holds now (the one taken ahead, the
        answers waiting to be written). Marks are added and removed steps apart, across two threads; whatever
        failed in between (Redis down, a give-back refused) left one behind, removed here once Redis answers."""
        keep = exec_ids(self._ahead.rows) if self._ahead is not None else []
        if self._unwritten is not None:
            keep += exec_ids(self._unwritten.rows)
        self.bridge.sweep_held(keep=keep, ttl_s=self.settings.result_ttl_s)

    # ---- one pass of the loop -----------------------------------------------------------------
    def _step(self) -> bool:
        """One batch, or one idle poll. Returns False when a burst worker should exit."""
        self._sweep_held()
        ahead, self._ahead = self._ahead, None
        if self._is_suspended():
            self._ahead = ahead
            self._settle_hands()
            if self.settings.burst:
                return False
            self._stop.wait(1.0)
            return True
        self._maybe_recover()
        facts = self.bridge.queue_facts()
        if ahead is not None:  # the policy sees the queue as it would be without the take made ahead
            facts = with_ahead(facts, ahead)
        states = self._states(facts)
        ref = self._choose(self.current_model, states)
        if ahead is not None and (ref != ahead.ref or (facts[ref].suspect_groups and self.taker.suspect_turn)):
            self._ahead = ahead
            self._give_back_ahead()
            ahead = None
            facts = self.bridge.queue_facts()
            states = self._states(facts)
        if ref is None:
            self._write_unwritten()
            if self.settings.burst and not self._anything_recoverable():
                return False
            self.wake.wait(self.settings.idle_poll_s)
            return True
        self.bulk_turn.record(ref, bulk_waiting=any(s.depth for r, s in states.items() if r.lane == BULK))
        if self.current_model is not None and ref.model != self.current_model:
            self.stats.switches += 1
        self.current_model = ref.model
        self._pace_now = time.monotonic()
        paced = self._pacing(ref, states)
        take_started = time.monotonic()
        if ahead is not None:
            queued = facts[ref].depth - sum(1 for r in ahead.rows if r.ref == ref)
            prepared = self._fitted(ahead, states, queued=queued)
        else:
            prepared = self._prepare(
                self._take(ref, states, suspects=facts[ref].suspect_groups, queued=facts[ref].depth)
            )
        prepared = replace(prepared, take_s=time.monotonic() - take_started - prepared.triage_s)
        taken = prepared.take
        if not taken.rows:
            # Back in the idle set: a take whose every id was quarantined left it in the take's script.
            self._write_unwritten()
            self.presence.report(busy=False)
            return True
        started = time.monotonic()
        self._run_take(prepared)
        # Only a normal bulk take of this model alone tells what its takes cost (not a suspect group, not a take
        # topped up with another model's tail).
        if ref.lane == BULK and taken.allowed and all(r.model == ref.model for r in taken.rows):
            took = TakeTime(rows=len(taken.rows), seconds=time.monotonic() - started)
            self.pace.record(ref.model, took, allowed=taken.allowed, paced=paced)
        return True

    def _choose(self, current: str | None, states: dict[QueueRef, QueueState]) -> QueueRef | None:
        """The policy's next queue (worker.lanes), `current` the model served last."""
        return choose_queue(
            current,
            states,
            max_wait_ms=self.settings.max_wait_ms,
            bulk_due=self.bulk_turn.due,
            escalates_to=self.escalates_to,
        )

    def _states(self, facts: Mapping[QueueRef, QueueFacts]) -> dict[QueueRef, QueueState]:
        now = time.time()
        # Once per model, not per lane: on a GPU each look at the capacity re-measures the allocator.
        capacity = {m: self.engine.capacity(m) for m in sorted({ref.model for ref, f in facts.items() if f.depth})}
        self._capacity.update(capacity)
        return queue_states(facts, capacity, now)

    def _pacing(self, ref: QueueRef, states: dict[QueueRef, QueueState]) -> bool:
        """Whether this take is a paced bulk take (worker.pace): interactive work waits now or did lately."""
        now = self._pace_now
        if any(s.depth for r, s in states.items() if r.lane == INTERACTIVE):
            self.pace.saw_interactive(now)
        live = self.pace.live(now)
        if live != self._paced:
            self._paced = live
            if live:
                log.info("interactive work live: bulk takes paced to ~%d ms", self.settings.paced_take_ms)
            else:
                log.info("no interactive work for %.0f s: bulk takes full again", self.settings.interactive_window_s)
        return live and ref.lane == BULK

    def _is_suspended(self) -> bool:
        suspended = self.bridge.suspended()
        if suspended != self._suspended:
            log.warning(
                "worker %s by `rq %s`", "suspended" if suspended else "resumed", "suspend" if suspended else "resume"
            )
            self._suspended = suspended
        return suspended

    def _take(self, ref: QueueRef, states: dict[QueueRef, QueueState], *, suspects: int, queued: int) -> Take:
        capacity = self._take_size(ref, states, queued=queued)
        return self.taker.take(ref, states, capacity=capacity, suspects=suspects, queued=queued)

    def _take_size(self, ref: QueueRef, states: dict[QueueRef, QueueState], *, queued: int) -> int:
        # The step's own look at the capacity (each look re-measures the allocator on a GPU); a queue holding
        # only suspect groups had none, and looks now.
        seen = states.get(ref)
        capacity = seen.take if seen is not None and seen.take else self.engine.capacity(ref.model)
        if queued > capacity:
            capacity = self._sized_by_head(ref, capacity)
        return capacity

    # ---- the take ahead (worker.ahead) --------------------------------------------------------
    def _prepare(self, taken: Take, *, ahead: bool = False) -> Prepared:
        """A take made ready for the engine: triaged, its settled rows written, its runnable jobs encoded."""
        started = time.monotonic()
        triage = self.settler.triage(taken.rows) if not taken.dead else None
        encoded = None
        if triage is not None:
            self._write(triage.settled)
            jobs = [r.job for r in triage.runnable if r.job is not None]
            encoded = self._encoded(jobs) if jobs else None
        triage_s = 0.0 if ahead else time.monotonic() - started
        return Prepared(taken, taken_ref(taken), triage, encoded, triage_s, ahead=ahead)

    def _encoded(self, jobs: list[Job]) -> Any:
        """The engine's `prepare` of these jobs; None where it raised: `run` then encodes them itself, inside the
        batch's one except boundary (`_run_engine`), where a job that cannot be encoded fails alone."""
        try:
            return self.engine.prepare(jobs)
        except Exception:
            log.exception("encoding a take of %d ahead of its run failed; the engine encodes it as it runs", len(jobs))
            return None

    def _fitted(self, ahead: Prepared, states: dict[QueueRef, QueueState], *, queued: int) -> Prepared:
        """The take made ahead, sized as a take made now would be: it was sized before the take it ran beside
        (whose KV pool and graphs may leave room for fewer rows now), while a peer may have gone idle since (its
        share of the queue), the rest back to the front of their queue; or made while the queue was still filling
        (topped up from it)."""
        assert ahead.triage is not None
        held = sum(1 for r in ahead.rows if r.ref == ahead.ref)
        size = self._take_size(ahead.ref, states, queued=queued + held)
        # A peer gone idle since the take was made gets its share of the queue, as a take made now would leave it.
        peers = self.bridge.idle_peers(live_s=self.settings.worker_ttl_s)
        size = tail_take(size, queued + held, idle_peers=peers)
        runnable = ahead.triage.runnable
        if len(runnable) > size:
            return self._trimmed(ahead, size)
        room = size - len(runnable)
        if room <= 0 or queued <= 0:
            return ahead
        more = self._prepare(self.taker.take(ahead.ref, states, capacity=room, suspects=0, queued=queued))
        if not more.rows:
            return ahead
        return joined(ahead, more)

    def _trimmed(self, ahead: Prepared, size: int) -> Prepared:
        """The take made ahead cut to its first `size` runnable rows; the rest back to the front of their queue."""
        assert ahead.triage is not None
        runnable, back = ahead.triage.runnable[:size], ahead.triage.runnable[size:]
        self._hand_back(back)
        triage = Triage(ahead.triage.settled, runnable, ahead.triage.flags)
        take = replace(ahead.take, rows=[*ahead.triage.settled, *runnable])
        encoded = None if ahead.encoded is None else ahead.encoded.first(len(runnable))
        return replace(ahead, take=take, triage=triage, encoded=encoded)

    def _take_ahead(self, current: Prepared) -> Prepared | None:
        """On the helper thread, while `current` runs: the next take of its queue, if the loop's next step will
        want one (no interactive work waiting behind a bulk take, no idle peer, the policy staying on this
        queue). It waits for jobs while the take runs, looking every `AHEAD_POLL_S`. A take ahead is a saving,
        never a need: Redis failing meanwhile costs only the saving (what it took lapses back to its queue
        through recovery, no crash counted; the running take's answers are kept)."""
        try:
            return self._take_ahead_now(current)
        except redis.exceptions.RedisError as exc:
            if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
                self.presence.redis_down(exc)  # the outage's one line, if the loop has not said it yet
            else:
                log.warning("taking ahead failed (%s); the next step takes as usual", exc)
            with self._lock:
                self._held_ahead = []
            return None

    def _take_ahead_now(self, current: Prepared) -> Prepared | None:
        ref = current.ref
        if current.take.dead or not current.take.allowed or self.pace.live(self._pace_now):
            return None
        boundary = self.helper.boundary
        while True:
            if self._stop.is_set():
                return None
            facts = self.bridge.queue_facts(move_aside=False)
            if ref.lane == BULK and any(f.depth for r, f in facts.items() if r.lane == INTERACTIVE):
                return None
            if facts[ref].depth:
                break
            if boundary.wait(AHEAD_POLL_S):
                return None
        states = queue_states(facts, {**self._capacity, ref.model: current.take.allowed}, time.time())
        if self._choose(ref.model, states) != ref:
            return None
        exec_id = self.bridge.begin_batch()
        taken = self.taker.take(
            ref, states, capacity=current.take.allowed, suspects=0, queued=facts[ref].depth, exec_id=exec_id, ahead=True
        )
        with self._lock:
            self._held_ahead = in_hand(taken.rows)
        if not taken.rows:
            return None
        prepared = self._prepare(taken, ahead=True)
        # Held only now: a process crash while its jobs were triaged and encoded (the host code a hostile job
        # could crash) is charged to them too, so such a job is bisected like any poison job.
        self.bridge.mark_held(add=[exec_id], ttl_s=self.settings.result_ttl_s)
        return prepared

    def _give_back_ahead(self) -> None:
        """The take made ahead, not wanted after all: its jobs back to the front of their queues."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        back = list(ahead.triage.runnable) if ahead.triage is not None else ahead.rows
        self._hand_back(back)
        self.bridge.mark_held(remove=exec_ids(ahead.rows), ttl_s=self.settings.result_ttl_s)
        with self._lock:
            self._held_ahead = []
        log.debug("gave back %d job(s) taken ahead", len(back))

    def _hand_back(self, rows: Sequence[Row]) -> None:
        """Taken rows this worker will not run, back to the front of their queues in order (no crash or attempt
        counted), out of their batch's running set first: a peer may take them the moment they are back."""
        self.settler.unmark_running(rows)
        for hand in in_hand(rows):
            self.bridge.give_back(hand.ref, list(hand.ids), exec_id=hand.exec_id)

    def _write_unwritten(self) -> None:
        """The last take's answers, written now (nothing runs that they could be written behind)."""
        answered = self._unwritten
        if answered is not None:
            self._write_answered(answered, held=True)

    def _write_answered(self, answered: Answered, *, held: bool) -> None:
        """`held`: its execution ids are in the held set (it waited to be written): out of it once written."""
        self._write(self.settler.results(answered.triage, answered.outputs, engine_s=answered.engine_s))
        with self._lock:
            if self._unwritten is answered:
                self._unwritten = None
        if held:
            self.bridge.mark_held(remove=exec_ids(answered.rows), ttl_s=self.settings.result_ttl_s)

    def _behind_and_ahead(self, unwritten: Answered | None, current: Prepared) -> Prepared | None:
        """The helper's work while `current` runs (once the loop's thread waits for the GPU): the take before it
        written, the next one taken."""
        self.helper.go.wait()
        if unwritten is not None:
            self._write_answered(unwritten, held=True)
        return self._take_ahead(current)

    def _sized_by_head(self, ref: QueueRef, capacity: int) -> int:
        """A full take's size once the engine has seen the job at the queue's front: the model's last batch sized
        it, and the jobs waiting now may be of another kind (choice jobs after generation jobs fit ~3x the rows)
        or longer. A look at one job, not a promise: the engine packs whatever the take holds into sub-batches
        that fit."""
        raw = self.bridge.head(ref)
        if raw is None or raw.problem is not None:
            return capacity
        # The settler's own checks, without a log line per look: a job that cannot run fails in its take.
        decoded = self.settler.decode(Row(ref.model, raw, lane=ref.lane))
        job = decoded.job
        if job is None or decoded.foreign:
            return capacity
        try:
            if not self.engine.expect(job):
                return capacity
            return self.engine.capacity(ref.model)
        except Exception:  # a hostile front job must not end the loop: it fails in its own take
            log.exception("sizing the take by job %s at the front of %s failed; keeping %d rows", raw.id, ref, capacity)
            return capacity

    def _run_take(self, prepared: Prepared) -> None:
        rows = prepared.rows
        if prepared.take.dead:  # a suspect group written off: nothing runs that answers could be written behind
            self._write_unwritten()
        unwritten = self._unwritten  # written behind this take (held since it was answered)
        if prepared.ahead:  # running now: a crash from here on is this take's
            self.bridge.mark_held(remove=exec_ids(rows), ttl_s=self.settings.result_ttl_s)
        with self._lock:
            self._running = in_hand(rows)
            self._held_ahead = []
        started = time.time()
        self.presence.report(busy=True)
        ahead: Prepared | None = None
        try:
            if prepared.take.dead:
                failed = dead_letter(self.settler, rows)
                self.stats.dead_lettered += sum(1 for r in failed if r.result is not None)
                self._write(failed)
            else:
                ahead = self._process(prepared, unwritten)
        finally:
            with self._lock:
                self._running = []
            errors = self.stats.errors - self._errors_reported
            self._errors_reported = self.stats.errors
            ok = max(len(rows) - errors, 0)
            # Straight on to the take made ahead: not idle in between (peers sharing a tail read the idle set).
            busy = ahead is not None
            self.presence.report(busy=busy, ok=ok, failed=errors, seconds=time.time() - started)
        self._ahead = ahead

    def _process(self, prepared: Prepared, unwritten: Answered | None) -> Prepared | None:
        """The take's runnable rows through the engine as one batch, while the helper writes `unwritten` and takes
        the next one ahead (returned). A take is either normal jobs or one suspect group (worker.recovery), never
        both, so a crash is charged to exactly the jobs that ran."""
        started = time.time()
        triage = prepared.triage
        assert triage is not None
        rows = prepared.rows
        outputs: list[Any] = []
        engine_s = 0.0
        if self.settings.take_ahead:
            self.helper.start(lambda: self._behind_and_ahead(unwritten, prepared))
        try:
            if triage.runnable:
                engine_started = time.time()
                jobs = [r.job for r in triage.runnable if r.job is not None]
                outputs = self._run_engine(jobs, prepared.encoded)
                engine_s = time.time() - engine_started
        finally:
            ahead = self.helper.join()
        write_s = 0.0
        if triage.runnable:
            answered = Answered(triage, outputs, engine_s)
            if ahead is None:  # nothing to write them behind: now
                write_started = time.time()
                self._write_answered(answered, held=False)
                write_s = time.time() - write_started
            else:
                # Off the GPU until written behind the next take: a crash meanwhile is not theirs.
                self.bridge.mark_held(add=exec_ids(answered.rows), ttl_s=self.settings.result_ttl_s)
                with self._lock:
                    self._unwritten = answered
        waits = [started - r.raw.enqueued_at for r in rows if r.raw.enqueued_at]
        facts = BatchFacts(
            models=tuple(sorted({r.model for r in rows})),
            jobs=len(rows),
            ran=len(triage.runnable),
            errors=sum(1 for o in outputs if getattr(o, "error", None) is not None),
            prompt_tokens=outputs_tokens(outputs, "prompt_tokens"),
            generated_tokens=outputs_tokens(outputs),
            wait_s=max(waits, default=0.0),
            engine_s=engine_s,
            total_s=time.time() - started + prepared.take_s + prepared.triage_s,
            take_s=prepared.take_s,
            triage_s=prepared.triage_s,
            write_s=write_s,
        )
        self.stats.record(facts, peak_memory_bytes=getattr(self.engine, "peak_memory_bytes", lambda: 0)())
        self.stats.count_engine(self.engine)
        if self.stats.batches % PUBLISH_EVERY_BATCHES == 0:
            self.stats.publish(self.redis, self.keys, self.name)
        return ahead

    def _write(self, rows: Sequence[Row]) -> None:
        if not rows:
            return
        written = self.settler.write(rows, ttl_s=self.settings.result_ttl_s)
        self.stats.escalations += len(written.follow_ups)
        for row in rows:
            if row.result is not None:
                error = row.result.error
                outcome = "error" if error else ("answered" if row.result.final else "escalated")
                self.stats.count_outcome(outcome, error.type if error else "")
        if written.follow_ups:
            # The longest by characters stands for all (encoding each would cost ~0.3 ms a job). A hint only: its
            # failure must not end the loop with a take written and the next one running (charged as a crash).
            try:
                self.engine.expect(max((e.job for e in written.follow_ups), key=prompt_chars))
            except Exception:
                log.exception("sizing the next Kev take by this take's follow-ups failed; sizing it as before")

    def _run_engine(self, jobs: list[Job], encoded: Any = None) -> list[Any]:
        """The one except boundary per batch: if the engine raises, each job is retried alone, so one bad
        job cannot sink its batch-mates (a job that crashes the whole process is handled by recovery)."""
        try:
            maybe_crash(jobs)
            limit_s = self.settings.batch_time_limit_s
            if encoded is None:  # an engine that prepares nothing: no telling when it waits for a GPU
                self.helper.release()
                return self.engine.run(jobs, time_limit_s=limit_s)
            return self.engine.run(jobs, time_limit_s=limit_s, encoded=encoded, on_gpu_wait=self.helper.release)
        except Exception:
            log.exception("engine failed on a batch of %d; retrying each job alone", len(jobs))
            return [self._run_alone(job) for job in jobs]

    def _run_alone(self, job: Job) -> Any:
        try:
            return self.engine.run([job], time_limit_s=self.settings.batch_time_limit_s)[0]
        except Exception as exc:
            log.exception("job %s failed alone", job.custom_id)
            return RowOutput.failed(INTERNAL, f"{type(exc).__name__}: {exc}")

    # ---- recovery -----------------------------------------------------------------------------
    def _maybe_recover(self, *, force: bool = False) -> None:
        if not force and time.time() - self._last_recovery < self.settings.recovery_interval_s:
            return
        self._last_recovery = time.time()
        # Right after a Redis outage every worker's heartbeat has lapsed: give live ones one TTL to beat
        # again before taking anything of theirs.
        others = time.time() - self.presence.redis_ok_since >= self.settings.worker_ttl_s
        in_flight = {i for hand in self._in_hand_now() for i in hand.ids}
        self.recovery.run(in_flight=in_flight, others=others, batch_ttl_s=self.settings.result_ttl_s)

    def _anything_recoverable(self) -> bool:
        """For --burst: jobs still registered as running somewhere, which may come back to the queue."""
        if self.bridge.pending_started() == 0:
            return False
        self._maybe_recover(force=True)
        facts = self.bridge.queue_facts().values()
        return self.bridge.pending_started() > 0 or any(f.depth or f.suspect_groups for f in facts)


def queue_states(
    facts: Mapping[QueueRef, QueueFacts], capacity: Mapping[str, int], now: float
) -> dict[QueueRef, QueueState]:
    """The policy's view of the queues: depth (suspect groups counted), head wait, and a full take's rows."""
    return {
        ref: QueueState(
            f.depth + f.suspect_groups,
            (now - f.oldest_enqueued_at) * 1000 if (f.depth and f.oldest_enqueued_at) else 0.0,
            take=capacity.get(ref.model, 0) if f.depth else 0,
        )
        for ref, f in facts.items()
    }


def with_ahead(facts: Mapping[QueueRef, QueueFacts], ahead: Prepared) -> dict[QueueRef, QueueFacts]:
    """The queues' facts as they would be had the take made ahead not been taken: its rows still queued, its
    oldest job at the head."""
    out = dict(facts)
    for ref in {r.ref for r in ahead.rows}:
        rows = [r for r in ahead.rows if r.ref == ref]
        f = facts[ref]
        stamps = [t for t in (f.oldest_enqueued_at, *(r.raw.enqueued_at for r in rows)) if t]
        out[ref] = replace(f, depth=f.depth + len(rows), oldest_enqueued_at=min(stamps, default=None))
    return out


def taken_ref(taken: Take) -> QueueRef:
    """The queue a take was made for: its first row's (a take's tail rows of other models come after)."""
    return taken.rows[0].ref if taken.rows else QueueRef("", BULK)


def joined(first: Prepared, more: Prepared) -> Prepared:
    """Two takes of one queue run as one batch (each row keeps its own take's execution id)."""
    assert first.triage is not None and more.triage is not None
    triage = Triage(
        first.triage.settled + more.triage.settled,
        first.triage.runnable + more.triage.runnable,
        {**first.triage.flags, **more.triage.flags},
    )
    if first.encoded is None:
        encoded = more.encoded
    elif more.encoded is None:
        encoded = first.encoded
    else:
        encoded = first.encoded.then(more.encoded)
    take = Take(first.rows + more.rows, allowed=max(first.take.allowed, len(first.rows) + more.take.allowed))
    return Prepared(take, first.ref, triage, encoded, first.triage_s + more.triage_s, ahead=first.ahead)
