"""The engine: batched generation and choice scoring over resident bases with named LoRA adapters.

`Engine.run(jobs)` takes a plain list of jobs (one model, or mixed for small tails) and answers
index-aligned: every row gets a RowOutput, an error row never sinks its batch-mates. A batch runs as:
encode (worker/prompts.py) -> group by base and kind -> pack into sub-batches the memory plan holds
(worker/planner.py) -> guarded against out-of-memory -> generate (the static loop, worker/static.py, or HF
generate, worker/eager.py) | score (worker/scoring.py) -> each row's output (worker/outputs.py) -> calibrated.
Confidence is defined in worker/outputs.py (generation) and worker/scoring.py (choices).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from shared.errors import INTERNAL, TIMEOUT, ConfigError, JobFailure
from shared.job import Job
from worker.calibration import calibrated_output
from worker.config import ModelsConfig
from worker.eager import generate_eager, sampling_params
from worker.fastpath import DEFAULT_OPS, Decoded, OpsOptions, StaticDecoder, row_bucket
from worker.loading import LoadedBase, load_all, pick_device, stop_ids
from worker.memory import DTYPE_BYTES, MIB, BatchPlan
from worker.outputs import RowOutput, as_label, generated_output, text_decoder, token_bytes
from worker.packing import OomGuard, pack
from worker.planner import MemoryBudget
from worker.prompts import Encoder
from worker.rows import BaseCall, FaultHook, Item
from worker.scoring import ChoiceTokens, score_eager, score_static
from worker.static import DECODE_MODES, StaticLoops, generate_static, warm_up

log = logging.getLogger("kevlaya.engine")
# A take is planned without the KV pool and graphs the loop holds (they are released, and the graphs captured
# again, ~0.2-0.5 s each on the H200) where that plans more than this many times the rows planned beside them.
RELEASE_GAIN = 1.25

TYPICAL_INPUT_TOKENS = 256  # sizes the worker's take; real lengths size the engine's sub-batches
# Decode graphs of at least GRAPH_DROP_ROWS rows unused this long are dropped before a take is planned: their
# buffers would otherwise count against every later take. Long enough that a spell of paced takes (worker.pace)
# keeps the full take's graph: dropped after 10 s, it was recaptured at pacing's end and that capture ran out of
# memory beside the paced takes' graphs.
GRAPH_IDLE_S = 30.0
GRAPH_DROP_ROWS = 16


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class Encoded:
    """A take's jobs as `Engine.prepare` encoded them, index-aligned: each an Item, or the JobFailure it fails with."""

    jobs: tuple[Job, ...]
    items: tuple[Item | JobFailure, ...]
    seconds: float = 0.0  # what encoding them cost

    def of(self, jobs: Sequence[Job]) -> bool:
        """Whether these are the jobs encoded, in their order (the same objects)."""
        return len(jobs) == len(self.jobs) and all(a is b for a, b in zip(jobs, self.jobs, strict=True))

    def first(self, n: int) -> Encoded:
        """The first `n` jobs' encodings only."""
        return Encoded(self.jobs[:n], self.items[:n], self.seconds)

    def then(self, more: Encoded) -> Encoded:
        """These jobs followed by `more`'s, as one take's (`more`'s rows indexed after these)."""
        shift = len(self.jobs)
        moved = (i if isinstance(i, JobFailure) else replace(i, index=i.index + shift) for i in more.items)
        return Encoded(self.jobs + more.jobs, self.items + tuple(moved), self.seconds + more.seconds)


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    oom: int  # out-of-memory errors survived (0 when the plan is right)
    captures: int  # decode graphs captured so far
    budget_bytes: int | None  # the whole process's budget (CUDA: GPU total minus a margin unless given)
    outside_allocator_bytes: int  # CUDA: context, kernels, workspaces (measured)
    process_bytes: int | None  # CUDA: the process now, as the driver reports it


# On a GPU the memory plan is what bounds a generation take (288 Laya rows at 6 GiB); the cap only stops takes that
# a larger budget, or scoring (no KV cache), would let grow past it. On a CPU a batch is not free: a 512-row take
# of the demo models is ~30 s, which an interactive job would wait behind.
GPU_BATCH_ROWS = 512
CPU_BATCH_ROWS = 256


def default_batch_rows(device: torch.device) -> int:
    return GPU_BATCH_ROWS if device.type == "cuda" else CPU_BATCH_ROWS


class Engine:
    """Models loaded once; `run` answers a batch. `fault_hook(phase, rows)` lets tests inject faults."""

    def __init__(
        self,
        config: ModelsConfig,
        *,
        device: str | None = None,
        memory_budget_bytes: int | None = None,
        max_batch_rows: int | None = None,
        fault_hook: FaultHook | None = None,
        bases: dict[str, LoadedBase] | None = None,
        decode: str = "auto",
        ops: OpsOptions = DEFAULT_OPS,
    ) -> None:
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
        self.config = config
        self.device = pick_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # memory APIs need an index
        self.memory = MemoryBudget(self.device, memory_budget_bytes)
        self.max_batch_rows = max_batch_rows or default_batch_rows(self.device)
        self.fault_hook = fault_hook
        self._deadline: float | None = None
        self.memory.start()
        # `bases` lets a caller that loaded the models itself (kevlaya memory, measuring each stage) reuse them.
        started = time.perf_counter()
        self.bases: dict[str, LoadedBase] = bases if bases is not None else load_all(config, self.device)
        self.load_s = time.perf_counter() - started  # kevlaya_model_load_seconds (0 for bases loaded by the caller)
        self.warmup_s = 0.0  # kevlaya_warmup_seconds: none on a CPU
        self.encoder = Encoder(config, self.bases)
        for base in self.bases.values():
            text_decoder(base.tokenizer)  # checked against the tokenizer's own decode once, here, not in a take
        self.choices = ChoiceTokens(config, self.bases)
        self.phase_s: Counter[str] = Counter()  # seconds spent encoding prompts and building outputs
        self._longest_prompt: dict[str, int] = {}  # per model, in its last batch: sizes the worker's take
        # Per model on the static loop whose last batch only scored choices: its rows' most choice tokens (a
        # row scored inside the loop's prefill needs no cache, unlike one that generates).
        self._scored_tokens: dict[str, int] = {}
        # Per model: the take size last logged, its prompts and its scored rows' choice tokens (None: generation).
        self._logged_takes: dict[str, tuple[int, int, int | None]] = {}
        self.loops = StaticLoops(self.bases, decode=decode, device=self.device, ops=ops)
        self.decoders: dict[str, StaticDecoder] = self.loops.decoders  # by base; a base without one: HF generate
        self.guard = OomGuard(self.loops.release)
        self.give_prefill_room()
        # After the loops: they keep float32 4-bit scales resident.
        self.memory.count_resident(b.model for b in self.bases.values())
        if self.device.type == "cuda":
            started = time.perf_counter()
            self.warm_up()
            self.warmup_s = time.perf_counter() - started
            # The warm-up loaded kernels (compiled ones, cuBLAS, flash) into the context.
            self.memory.cap_allocator("warm-up")
        self._check_budget_holds_a_row()
        # Everything alive now -- the models, torch's and transformers' modules, compiled kernels -- lives as long as
        # the engine: out of the garbage collector's sight, a full collection (which the takes' short-lived jobs and
        # results set off now and then) scans only what came after. On the H200 such a collection took 343 ms in
        # the middle of a worker's drain, the GPU idle; after the freeze, 1 ms. Collected first, so no garbage is
        # kept for good; here, at start, not when the worker starts (a collection that large took ~0.35 s).
        gc.collect()
        gc.freeze()

    def _check_budget_holds_a_row(self) -> None:
        """A budget that leaves no room for one short row of some model is refused at start, in one line: every take
        would run one row past the plan (`capacity` takes at least one), an out-of-memory error on a GPU."""
        if self.memory.total_bytes is None:
            return
        self.refresh_memory()
        for model in self.config.models:
            plan = self.plan(model, input_tokens=1, new_tokens=1, may_release=False)
            if plan.max_rows < 1:
                short = max(0, plan.take_bytes(1) - plan.free_bytes)
                raise ConfigError(
                    f"--memory-budget {self.memory.total_bytes / MIB:.0f} MiB leaves no room for one {model} row "
                    f"beside the {self.memory.planned_resident_bytes / MIB:.0f} MiB held (weights, context, "
                    f"kernels); give at least ~{(self.memory.total_bytes + short) / MIB + 1:.0f} MiB"
                )

    def give_prefill_room(self) -> None:
        """Each static loop's prefill asks the memory budget how large a chunk the take about to run may hold
        (`MemoryBudget.prefill_chunk_room`). Again after a loop is replaced (a benchmark's variant)."""
        for name, decoder in self.decoders.items():
            base = self.bases[name]
            dtype_bytes = DTYPE_BYTES[base.spec.compute_dtype]
            decoder.prefill.room = partial(self.memory.prefill_chunk_room, base.shape, dtype_bytes=dtype_bytes)

    def warm_up(self) -> None:
        """Every static loop's kernels loaded at start, not by the first jobs (see `worker.static.warm_up`)."""
        rows_for = lambda models: row_bucket(max(self.capacity(m) for m in models))  # noqa: E731
        warm_up(self.decoders, self.bases, self.config, rows_for=rows_for, device=self.device)

    # ---- facts the worker needs -------------------------------------------------------------
    def phase_seconds(self) -> dict[str, float]:
        """Where `run` spent its time so far: encoding, building outputs, and the static loop's setup (graph
        captures included), prefill and decode (with its step count), summed over the bases."""
        total = Counter(self.phase_s)
        total.update(self.loops.phase_seconds())
        return dict(total)

    def base_for(self, model: str) -> LoadedBase:
        return self.bases[self.config.models[model].base]

    def plan(
        self,
        model: str,
        *,
        input_tokens: int | None = None,
        new_tokens: int | None = None,
        sampled_rows: int = 0,
        logprob_rows: int = 0,
        may_release: bool = True,
        rows_wanted: int | None = None,
        scoring: bool = False,
        one_adapter: bool = False,
    ) -> BatchPlan:
        """How many rows of this model fit the memory budget (default: its full input and output limits), with
        `sampled_rows` of them sampled (their draws need memory of their own) and `logprob_rows` reporting
        log-probabilities (each in a slot of its own, normalising its row's logits in float32); with `scoring`, rows
        scoring `new_tokens` choice tokens inside the loop's prefill (no cache of their own); with `one_adapter`,
        rows all on one adapter (their prefill merges its LoRA in place: one layer's weights at a time).

        A take the loop's KV pool holds reuses it, so it is planned beside the pool and graphs as they are. Where
        releasing them would plan more than `RELEASE_GAIN` times the rows (a pool sized for another model's
        lengths: 200 long Kev prompts left one that held Laya's next takes to 88-96 rows where 240 fit; or not
        one row fits beside it), they are released and the take planned on what that leaves -- or, with
        `may_release` False (sizing a take, not running one), planned as though they were. Not where the pool
        leaves room for the `rows_wanted` rows there are: releasing would cost captures and gain nothing."""
        spec = self.config.models[model]
        decoder = self.decoders.get(spec.base)

        def plan(released: bool = False) -> BatchPlan:
            return self.memory.plan(
                self.base_for(model),
                input_tokens=input_tokens or spec.max_input_tokens,
                new_tokens=spec.max_new_tokens if new_tokens is None else new_tokens,
                sampled_rows=sampled_rows,
                max_rows=self.max_batch_rows,
                decoder=decoder,
                released=released,
                logprob_rows=logprob_rows,
                scoring=scoring,
                one_adapter=one_adapter,
            )

        planned = plan()
        if not planned.kv_pool_bytes or (rows_wanted is not None and planned.max_rows >= rows_wanted):
            return planned
        fresh = plan(released=True)
        if fresh.max_rows <= planned.max_rows * RELEASE_GAIN:
            return planned
        if not may_release:
            return fresh
        assert decoder is not None
        log.info(
            "plan: %d %s rows fit beside the KV pool (%d MiB), %d without it; releasing it",
            planned.max_rows, model, planned.kv_pool_bytes // MIB, fresh.max_rows,
        )  # fmt: skip
        decoder.release()
        self.refresh_memory()
        return plan()

    def capacity(self, model: str) -> int:
        """How many jobs the worker takes per batch: the plan for typical prompts, or for the longest prompt
        of this model's last batch when that was longer; rows that score choices where its last batch only
        scored (scored inside the loop's prefill, a row needs no cache: a take of `max_batch_rows` where
        generation plans ~176 at Laya's longest prompts). `run` packs the rows by their real lengths and kinds
        into sub-batches that fit, so a take of long prompts or of other rows is still safe; sizing the take by
        what was seen keeps it from being split (each sub-batch decodes as many steps as its longest answer)."""
        typical = self._sized_prompt(model)
        scored = self._scored_tokens.get(model)
        self.loops.drop_idle(GRAPH_IDLE_S, min_rows=GRAPH_DROP_ROWS)
        self.refresh_memory()
        # A look: the take may be the other model's.
        on_loop = scored is not None and self._scores_on_loop(model)
        plan = self.plan(
            model, input_tokens=typical, new_tokens=scored, may_release=False, scoring=on_loop, one_adapter=True
        )
        if self._logged_takes.get(model) != (plan.max_rows, typical, scored):
            self._logged_takes[model] = (plan.max_rows, typical, scored)
            # An operator's answer to "why this take size": what the budget left and what a row costs.
            log.info(
                "take for %s: %d rows at prompts up to %d tokens%s: %d MiB left for rows after %d MiB held "
                "(weights, graphs' pool, caches, a KV pool of %d MiB that takes it holds reuse), %.1f MiB per row",
                model, plan.max_rows, typical, "" if scored is None else f", scoring {scored} choice tokens",
                plan.free_bytes // MIB, self.memory.planned_resident_bytes // MIB, plan.kv_pool_bytes // MIB,
                plan.bytes_per_row / MIB,
            )  # fmt: skip
        return max(1, plan.max_rows)

    def refresh_memory(self) -> None:
        """The memory the next plans start from, looked at again (see `MemoryBudget.refresh`)."""
        self.memory.refresh()

    def expect(self, job: Job) -> bool:
        """A job about to be queued (the worker's longest new follow-up) or taken (the one at the front of the
        queue a take is about to come from): its prompt length sizes that model's next take too, and so does its
        kind -- rows that score choices on the loop need no cache (`capacity`). Without it the first Kev take
        after a run of Laya batches was sized for typical prompts, and follow-ups (the parent's prompt plus its
        answer) are longer: the take was cut in two, and each part decoded Kev's full answer length; and the
        first take of 600 choice jobs after generation jobs held the 192 rows a generation plan allows. Returns
        whether the model's next take is sized otherwise now."""
        try:
            item = self.encoder.encode(job, index=-1)
        except JobFailure:
            return False  # it fails when it runs; nothing to plan for
        model = job.model
        before = (self._sized_prompt(model), self._scored_tokens.get(model))
        self._longest_prompt[model] = max(self._longest_prompt.get(model, 0), len(item.ids))
        if job.scores_choices and self._scores_on_loop(model):
            self._scored_tokens[model] = max(before[1] or 0, self.choices.count(job))
        else:
            self._scored_tokens.pop(model, None)  # a row that generates is coming: a take sized for those
        return (self._sized_prompt(model), self._scored_tokens.get(model)) != before

    def _sized_prompt(self, model: str) -> int:
        """The prompt length `capacity` plans a take of this model for: the longest of its last batch (or an
        expected job), at least a typical one, at most the model's input limit."""
        seen = max(TYPICAL_INPUT_TOKENS, self._longest_prompt.get(model, 0))
        return min(self.config.models[model].max_input_tokens, seen)

    def stats(self) -> EngineStats:
        """Counters for logs, status and benchmarks."""
        return EngineStats(
            oom=self.oom_count,
            captures=self.loops.captures,
            budget_bytes=self.memory.total_bytes,
            outside_allocator_bytes=self.memory.outside_allocator_bytes,
            process_bytes=self.memory.process_bytes(),
        )

    @property
    def oom_count(self) -> int:
        """Out-of-memory errors survived: each one is a planning bug (see `OomGuard`)."""
        return self.guard.count

    def peak_memory_bytes(self) -> int:
        """Peak GPU memory allocated (CUDA), else the process's peak resident set size."""
        return self.memory.peak_bytes()

    # ---- the batch contract -----------------------------------------------------------------
    def prepare(self, jobs: Sequence[Job]) -> Encoded:
        """The host work of `run` that needs neither the GPU nor the memory plan -- the prompts encoded -- for a
        take about to run (worker.ahead: made on another thread while the GPU runs the take before it)."""
        started = time.perf_counter()
        items = tuple(self.encoder.encode_many(jobs))
        return Encoded(tuple(jobs), items, time.perf_counter() - started)

    def run(
        self,
        jobs: Sequence[Job],
        *,
        time_limit_s: float | None = None,
        encoded: Encoded | None = None,
        on_gpu_wait: Callable[[], None] | None = None,
    ) -> list[RowOutput]:
        """Answer every job, index-aligned. Choice jobs are scored, the others generated.

        `time_limit_s` bounds the whole call: generation stops at the deadline and the rows it cut short,
        like the sub-batches not started by then, fail with `timeout`; finished rows keep their answers.
        `encoded`: `prepare`'s work for these very jobs, done already. `on_gpu_wait`: called (at least once,
        at the latest on return) when this thread is about to wait for the GPU a while -- a generation batch's
        prefill queued, a scoring batch begun (its launches run ahead of the GPU) -- so another thread's Python
        then costs the GPU nothing (worker.ahead)."""
        waits = on_gpu_wait or _nothing
        for decoder in self.decoders.values():
            decoder.on_wait = waits
        try:
            return self._run(jobs, time_limit_s=time_limit_s, encoded=encoded, waits=waits)
        finally:
            for decoder in self.decoders.values():
                decoder.on_wait = _nothing
            waits()

    def _run(
        self, jobs: Sequence[Job], *, time_limit_s: float | None, encoded: Encoded | None, waits: Callable[[], None]
    ) -> list[RowOutput]:
        self._deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.refresh_memory()
        if encoded is None or not encoded.of(jobs):
            encoded = self.prepare(jobs)
        outputs: list[RowOutput | None] = [None] * len(jobs)
        groups: dict[tuple[Any, ...], list[Item]] = defaultdict(list)
        longest: dict[str, int] = {}
        self.phase_s["encode"] += encoded.seconds
        started = time.perf_counter()
        for index, (job, item) in enumerate(zip(jobs, encoded.items, strict=True)):
            if isinstance(item, JobFailure):
                outputs[index] = RowOutput.failed(item.type, str(item))
                continue
            spec = self.config.models[job.model]
            groups[(spec.base, *self._mode(job))].append(item)
            longest[job.model] = max(longest.get(job.model, 0), len(item.ids))
        self._longest_prompt.update(longest)
        self._remember_kinds(groups)
        self.phase_s["encode"] += time.perf_counter() - started
        for key, items in groups.items():
            scoring = key[1] == "choices"
            fn = self._score if scoring else self._generate
            on_loop = key[0] in self.decoders and (not scoring or self.decoders[key[0]].own_prefill)
            for chunk in pack(
                items, scoring=scoring, on_loop=on_loop, plan=self.plan, choice_tokens=self.choices.count
            ):
                if self._past_deadline():
                    results = [RowOutput.failed(TIMEOUT, "the batch's time limit passed before it ran") for _ in chunk]
                else:
                    if scoring or not on_loop:
                        # Scoring launches run ahead of the GPU (they block on its full queue, not on a result);
                        # HF generate gives no signal of its own (the static loop's comes after its prefill).
                        waits()
                    self.memory.take_started()
                    results = self.guard(fn, chunk)
                    self._log_take(chunk, scoring)
                for item, out in zip(chunk, results, strict=True):
                    outputs[item.index] = out
                self.refresh_memory()  # the next sub-batch is planned beside the pool and graphs this one left
        done = [o if o is not None else RowOutput.failed(INTERNAL, "no output produced") for o in outputs]
        return [self._calibrated(job, out) for job, out in zip(jobs, done, strict=True)]

    def _scores_on_loop(self, model: str) -> bool:
        """Whether this model's choice rows are scored inside its static loop's own prefill."""
        decoder = self.decoders.get(self.config.models[model].base)
        return decoder is not None and decoder.own_prefill

    def _remember_kinds(self, groups: dict[tuple[Any, ...], list[Item]]) -> None:
        """Per model of this batch: its rows' most choice tokens where they all scored on the static loop (what
        its next take is sized for, `capacity`), else nothing."""
        scored: dict[str, int] = {}
        other: set[str] = set()  # models with rows that generate, or score on HF's path
        for key, items in groups.items():
            on_loop = key[1] == "choices" and key[0] in self.decoders
            for it in items:
                if on_loop:
                    scored[it.job.model] = max(scored.get(it.job.model, 0), self.choices.count(it.job))
                else:
                    other.add(it.job.model)
        for model in other:
            self._scored_tokens.pop(model, None)
        self._scored_tokens.update({m: tokens for m, tokens in scored.items() if m not in other})

    def _log_take(self, chunk: list[Item], scoring: bool) -> None:
        """CUDA: a sub-batch's allocator peak beside the cap (see `MemoryBudget.take_peak`), and what stayed
        allocated after it."""
        peak = self.memory.take_peak()
        if peak is None:
            return
        longest = max(len(it.ids) for it in chunk)
        decoder = self.decoders.get(self.config.models[chunk[0].job.model].base)
        models = {it.job.model for it in chunk}
        chunks = f"; prefill chunks of {decoder.prefill.last_tokens} tokens" if decoder and decoder.own_prefill else ""
        log.info(
            "take: %d %s rows (%s, prompts up to %d tokens): allocator peak %d MiB (%d MiB held), cap %d MiB, "
            "headroom %d MiB, %d retries, %d MiB allocated after it%s",
            len(chunk), "+".join(sorted(models)), "scoring" if scoring else "generation", longest,
            peak.peak_bytes // MIB, peak.reserved_peak_bytes // MIB, peak.cap_bytes // MIB, peak.headroom_bytes // MIB,
            peak.retries, self.memory.allocated_bytes() // MIB, chunks,
        )  # fmt: skip

    def _calibrated(self, job: Job, out: RowOutput) -> RowOutput:
        """The one place a configured calibration replaces the raw confidence (kept as raw_confidence)."""
        out = calibrated_output(out, self.config.models[job.model].calibration, scored=job.scores_choices)
        return as_label(out, job.choices) if job.choices and not job.scores_choices else out

    def _mode(self, job: Job) -> tuple[Any, ...]:
        """Which jobs can share a batch: choices apart from generation; on the static loop greedy and sampled rows
        together (each row samples with its own parameters), on HF generate one sampling setting per batch."""
        if job.scores_choices:
            return ("choices",)
        if self.config.models[job.model].base in self.decoders:
            return ("generate",)
        return ("generate", *sampling_params(job))

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    # ---- generation and scoring of one sub-batch --------------------------------------------
    def _call(self, items: list[Item]) -> BaseCall:
        """What running these rows (all of one base) needs besides them."""
        base = self.base_for(items[0].job.model)
        stops = stop_ids(base, self.config.stop_strings)
        return BaseCall(base=base, device=self.device, stop_ids=stops, deadline=self._deadline, fault=self._fault)

    def _generate(self, items: list[Item]) -> list[RowOutput]:
        call = self._call(items)
        base = self.config.models[items[0].job.model].base
        done = self.loops.run(
            base, lambda decoder: self._generate_static(call, decoder, items), what="decode", fallback="HF generate"
        )
        if done is not None:
            return done
        # HF generate samples the whole batch one way: one call per sampling setting (a batch grouped for the
        # static loop, which samples per row, may mix them).
        by_params: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_params[sampling_params(item.job)].append(i)
        outputs: list[RowOutput | None] = [None] * len(items)
        for rows in by_params.values():
            part = [items[i] for i in rows]
            for i, out in zip(rows, self._row_outputs(call, part, generate_eager(call, part)), strict=True):
                outputs[i] = out
        return [o for o in outputs if o is not None]

    def _generate_static(self, call: BaseCall, decoder: StaticDecoder, items: list[Item]) -> list[RowOutput]:
        decoded = generate_static(call, decoder, items)
        started = time.perf_counter()
        outputs = self._row_outputs(call, items, decoded)
        self.phase_s["outputs"] += time.perf_counter() - started
        return outputs

    def _row_outputs(self, call: BaseCall, items: list[Item], decoded: Decoded) -> list[RowOutput]:
        return [self._row_output(call, item, decoded, row) for row, item in enumerate(items)]

    def _row_output(self, call: BaseCall, item: Item, decoded: Decoded, row: int) -> RowOutput:
        """One generated row's output (bench/fastpath.py's TokenRecorder records the row's tokens here)."""
        reported = decoded.reported.get(row) if item.job.logprobs else None
        return generated_output(
            item,
            decoded.tokens[row],
            decoded.logprobs[row],
            bad=bool(decoded.bad[row]),
            stops=set(call.stop_ids),
            cut_short=decoded.cut_short,
            decode=text_decoder(call.base.tokenizer),
            decision_prefix=self.config.models[item.job.model].decision_prefix,
            reported=reported,
            top_logprobs=item.job.top_logprobs,
            token_bytes=token_bytes(call.base.tokenizer) if reported is not None else None,
        )

    def _score(self, items: list[Item]) -> list[RowOutput]:
        """Each choice's log-likelihood after the prompt: on the static loop, else HF forward passes."""
        call = self._call(items)
        base = self.config.models[items[0].job.model].base
        done = self.loops.run(
            base,
            lambda decoder: score_static(call, decoder, items, self.choices),
            what="scoring",
            fallback="HF forward passes",
        )
        return done if done is not None else score_eager(call, items)

    def _fault(self, phase: str, rows: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase, rows)
