"""The engine: batched generation and choice scoring over resident bases with named LoRA adapters.

`Engine.run(jobs)` takes a plain list of jobs (one model, or mixed for small tails) and answers
index-aligned: every row gets a RowOutput, an error row never sinks its batch-mates.

Confidence (documented in the README):
- generation: the probability the model gave the *decision span* it emitted -- the tokens after the
  model's `decision_prefix` ("Decision:") up to the end of that line, or the first line when there is no
  prefix -- i.e. exp(sum of those tokens' log-probabilities) under the distribution it decoded from;
- choices: the normalised probability of the best choice, from each choice's full log-likelihood.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import resource
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from shared.errors import INPUT_TOO_LONG, INTERNAL, NON_FINITE_LOGITS, OUT_OF_MEMORY, TIMEOUT, JobFailure
from shared.job import Job
from worker.calibration import calibrated_output
from worker.config import ModelsConfig, ModelSpec
from worker.fastpath import (
    ROW_BUCKETS,
    DecodeRow,
    ScoreRow,
    StaticDecoder,
    left_pad,
    length_bucket,
    row_bucket,
    unsupported_reason,
)
from worker.fastpath.decoder import sampler_slots
from worker.fastpath.sampling import Sampling
from worker.loading import LoadedBase, load_all
from worker.memory import DTYPE_BYTES, MIB, RESERVE_BYTES, BatchPlan, plan_batch
from worker.outputs import RowOutput
from worker.planner import ALLOCATOR_SLACK_BYTES, default_budget, held_bytes, measure, set_allocator_cap
from worker.templates import Pieces, prompt_pieces_many

log = logging.getLogger("kevlaya.engine")
BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch
TYPICAL_INPUT_TOKENS = 256  # sizes the worker's take; real lengths size the engine's sub-batches
FaultHook = Callable[[str, int], None]
# auto: greedy rows through the static decode loop wherever the model supports it, with CUDA graphs on a GPU
# (on 2 CPU cores it is also ~2x HF generate, token for token the same); static: the loop without graphs
# (to compare or profile); eager: always HF generate (the fast path off).
DECODE_MODES = ("auto", "eager", "static")


@dataclass(frozen=True)
class _Item:
    index: int
    job: Job
    ids: list[int]
    max_new: int
    adapter: str | None


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    oom: int  # out-of-memory errors survived (0 when the plan is right)
    captures: int  # decode graphs captured so far
    budget_bytes: int | None  # the whole process's budget (CUDA: GPU total minus a margin unless given)
    outside_allocator_bytes: int  # CUDA: context, kernels, workspaces (measured)
    process_bytes: int | None  # CUDA: the process now, as the driver reports it


class Engine:
    """Models loaded once; `run` answers a batch. `fault_hook(phase, rows)` lets tests inject faults."""

    def __init__(
        self,
        config: ModelsConfig,
        *,
        device: str | None = None,
        memory_budget_bytes: int | None = None,
        max_batch_rows: int = 256,
        fault_hook: FaultHook | None = None,
        bases: dict[str, LoadedBase] | None = None,
        decode: str = "auto",
        compile_ops: bool = True,
    ) -> None:
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, not {decode!r}")
        self.config = config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # memory APIs need an index
        self.memory_budget_bytes = memory_budget_bytes
        self.max_batch_rows = max_batch_rows
        self.fault_hook = fault_hook
        self.compile_ops = compile_ops  # torch.compile'd elementwise kernels in the loop (bf16/fp16 on CUDA)
        self._deadline: float | None = None
        self.oom_count = 0  # out-of-memory errors survived: each one is a planning bug (see `_guarded`)
        self.outside_allocator_bytes = 0  # CUDA: context, kernels, workspaces (measured; see worker/planner.py)
        self._held_bytes: int | None = None  # CUDA: what the allocator holds beyond the KV pools, at the last look
        if self.device.type == "cuda":
            torch.zeros(1, device=self.device)  # the CUDA context exists before the memory outside torch is measured
            if memory_budget_bytes is None:
                self.memory_budget_bytes = default_budget(self.device)
            self._cap_allocator("start")
            torch.cuda.reset_peak_memory_stats(self.device)  # the peak we report is this engine's, not a build's
        # `bases` lets a caller that loaded the models itself (kevlaya memory, measuring each stage) reuse them.
        self.bases: dict[str, LoadedBase] = bases if bases is not None else load_all(config, self.device)
        self.decoders: dict[str, StaticDecoder] = {}
        self.phase_s: Counter[str] = Counter()  # seconds spent encoding prompts and building outputs
        self._longest_prompt: dict[str, int] = {}  # per model, in its last batch: sizes the worker's take
        self._choice_cache: dict[tuple[str, tuple[str, ...]], tuple[tuple[int, ...], ...]] = {}
        for name, base in self.bases.items():
            decoder = self._static_decoder(name, base, decode)
            if decoder is not None:
                self.decoders[name] = decoder
        self.resident_bytes = self._resident_bytes()  # after the loops: they keep float32 4-bit scales resident
        if self.device.type == "cuda":
            self.warm_up()
            self._cap_allocator("warm-up")  # the warm-up loaded kernels (compiled ones, cuBLAS, flash) into the context

    def _cap_allocator(self, when: str) -> None:
        """The allocator's cap: the budget minus what the driver counts outside the allocator, as measured now."""
        reading = measure(self.device)
        self.outside_allocator_bytes = reading.outside_allocator_bytes
        assert self.memory_budget_bytes is not None
        cap = self.memory_budget_bytes - self.outside_allocator_bytes
        set_allocator_cap(self.device, cap)
        log.info(
            "memory (%s): budget %d MiB for the whole process; %d MiB outside torch's allocator (context, kernels, "
            "workspaces; %s); allocator capped at %d MiB",
            when, self.memory_budget_bytes // MIB, self.outside_allocator_bytes // MIB,
            "this process per NVML" if reading.per_process else "the device's used memory: NVML unavailable",
            cap // MIB,
        )  # fmt: skip

    def warm_up(self) -> None:
        """One tiny batch per model (and per mixed pair) through each static loop, then its graphs and cache
        dropped. A GPU's first use of a kernel loads it, and cuBLAS/bitsandbytes set up on their first call:
        on the H200 that made the first real batch's setup 1.6 s instead of ~0.2 s. Paid here, at start,
        not by the first jobs."""
        started = time.perf_counter()
        for base_name, decoder in self.decoders.items():
            base = self.bases[base_name]
            models = [m for m, spec in self.config.models.items() if spec.base == base_name]
            adapters = [base.adapters.get(m) for m in models]
            groups = [[a] for a in dict.fromkeys(adapters)] + ([adapters] if len(set(adapters)) > 1 else [])
            rows = row_bucket(max(self.capacity(m) for m in models))
            token, stop_ids = base.tokenizer.eos_token_id or 0, self._stop_ids(base)
            for names in groups:
                # The largest take (prefill in full chunks, then two decode steps), and one row: the kernels real
                # batches use (matmul shapes follow the rows and the chunk's tokens), and the compiled elementwise
                # kernels' shape families (a dimension of 1 is its own).
                for n in (rows, 1) if len(names) == 1 else (rows,):
                    # Prompt lengths equal to no model dimension: torch.compile treats equal sizes as one symbol
                    # (a 14-token warm-up matched 12 query + 2 KV heads), and real lengths then recompile.
                    width = 29 if n > 1 else 53
                    batch = [DecodeRow(ids=[token] * width, max_new=2, adapter=names[i % len(names)]) for i in range(n)]
                    decoder.decode(
                        batch,
                        stop_ids=stop_ids,
                        pad_id=base.tokenizer.pad_token_id,
                        select=lambda chosen, base=base: self._adapters(base, chosen),
                    )
            decoder.release()
            decoder.phase_s.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        log.info("decode: warmed up in %.1f s", time.perf_counter() - started)

    def _static_decoder(self, name: str, base: LoadedBase, decode: str) -> StaticDecoder | None:
        if decode == "eager":
            return None
        reason = unsupported_reason(base.model)
        if reason is not None:
            log.warning("decode: HF generate for base %s, the static loop does not support it: %s", name, reason)
            return None
        graphs = decode == "auto" and self.device.type == "cuda"
        log.info("decode: static KV cache %s for base %s", "with CUDA graphs" if graphs else "without graphs", name)
        return StaticDecoder(base.model, self.device, use_graphs=graphs, compile_ops=self.compile_ops)

    # ---- facts the worker needs -------------------------------------------------------------
    def phase_seconds(self) -> dict[str, float]:
        """Where `run` spent its time so far: encoding, building outputs, and the static loop's setup (graph
        captures included), prefill and decode (with its step count), summed over the bases."""
        total = Counter(self.phase_s)
        for decoder in self.decoders.values():
            total.update(decoder.phase_s)
        return dict(total)

    def base_for(self, model: str) -> LoadedBase:
        return self.bases[self.config.models[model].base]

    def plan(
        self, model: str, *, input_tokens: int | None = None, new_tokens: int | None = None, sampled_rows: int = 0
    ) -> BatchPlan:
        """How many rows of this model fit the memory budget (default: its full input and output limits), with
        `sampled_rows` of them sampled (their draws need memory of their own)."""
        spec = self.config.models[model]
        base = self.base_for(model)
        budget = (self.memory_budget_bytes or (1 << 62)) - self.outside_allocator_bytes
        inputs = input_tokens or spec.max_input_tokens
        new = spec.max_new_tokens if new_tokens is None else new_tokens
        decoder = self.decoders.get(spec.base) if new > 0 else None
        plan = plan_batch(
            base.shape,
            budget_bytes=budget,
            resident_bytes=self._held_bytes if self._held_bytes is not None else self.resident_bytes,
            reserve_bytes=ALLOCATOR_SLACK_BYTES if self.device.type == "cuda" else RESERVE_BYTES,
            input_tokens=inputs,
            new_tokens=new,
            dtype_bytes=DTYPE_BYTES[base.spec.compute_dtype],
            max_rows_cap=self.max_batch_rows,
            # The static loop prefills in chunks and keeps a cache of whole length buckets.
            prefill_chunk_tokens=decoder.prefill_tokens if decoder else None,
            cache_tokens=length_bucket(inputs + new) if decoder else None,
            flash_prefill=decoder is not None and decoder.own_prefill,
            sampler_slots=sampler_slots(sampled_rows) if decoder else 0,
        )
        if decoder is None or plan.max_rows in ROW_BUCKETS:
            return plan
        # Rows are padded up to a bucket: plan the largest bucket that fits, not a size padded past the plan.
        return replace(plan, max_rows=max((b for b in ROW_BUCKETS if b <= plan.max_rows), default=plan.max_rows))

    def capacity(self, model: str) -> int:
        """How many jobs the worker takes per batch: the plan for typical prompts, or for the longest prompt
        of this model's last batch when that was longer. `run` packs the rows by their real lengths into
        sub-batches that fit, so a take of long prompts is still safe; sizing the take by what was seen keeps
        it from being split (each sub-batch decodes as many steps as its longest answer)."""
        seen = max(TYPICAL_INPUT_TOKENS, self._longest_prompt.get(model, 0))
        typical = min(self.config.models[model].max_input_tokens, seen)
        self.refresh_memory()
        return max(1, self.plan(model, input_tokens=typical).max_rows)

    def refresh_memory(self) -> None:
        """Look again at what the allocator holds (CUDA), so the next plans count what is resident now: weights,
        captured graphs' pool, anything cached -- but not the KV pools, which the next batch reuses or replaces."""
        if self.device.type != "cuda":
            return
        pools = sum(d.pool.nbytes for d in self.decoders.values())
        self._held_bytes = held_bytes(self.device) - pools
        # Kernels for new shapes (flash attention, cuBLAS) load into the context as batches come: the measured
        # H200 process grew past the budget by 10 MiB with the cap set only at start and after the warm-up.
        outside = measure(self.device).outside_allocator_bytes
        if outside > self.outside_allocator_bytes:
            self._cap_allocator("grown")

    def expect(self, job: Job) -> None:
        """A job about to be queued (the worker's longest new follow-up): its prompt length sizes that model's
        next take too. Without it the first Kev take after a run of Laya batches was sized for typical prompts,
        and follow-ups (the parent's prompt plus its answer) are longer: the take was cut in two, and each part
        decoded Kev's full answer length."""
        try:
            item = self._encode(-1, job)
        except JobFailure:
            return  # it fails when it runs; nothing to plan for
        self._longest_prompt[job.model] = max(self._longest_prompt.get(job.model, 0), len(item.ids))

    def stats(self) -> EngineStats:
        """Counters for logs, status and benchmarks."""
        process = measure(self.device).driver_bytes if self.device.type == "cuda" else None
        return EngineStats(
            oom=self.oom_count,
            captures=sum(d.captures for d in self.decoders.values()),
            budget_bytes=self.memory_budget_bytes,
            outside_allocator_bytes=self.outside_allocator_bytes,
            process_bytes=process,
        )

    def peak_memory_bytes(self) -> int:
        """Peak GPU memory allocated (CUDA), else the process's peak resident set size."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # ---- the batch contract -----------------------------------------------------------------
    def run(self, jobs: Sequence[Job], *, time_limit_s: float | None = None) -> list[RowOutput]:
        """Answer every job, index-aligned. Choice jobs are scored, the others generated.

        `time_limit_s` bounds the whole call: generation stops at the deadline and the rows it cut short,
        like the sub-batches not started by then, fail with `timeout`; finished rows keep their answers."""
        self._deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
        self.refresh_memory()
        outputs: list[RowOutput | None] = [None] * len(jobs)
        groups: dict[tuple[Any, ...], list[_Item]] = defaultdict(list)
        longest: dict[str, int] = {}
        started = time.perf_counter()
        for index, (job, item) in enumerate(zip(jobs, self._encode_many(jobs), strict=True)):
            if isinstance(item, JobFailure):
                outputs[index] = RowOutput.failed(item.type, str(item))
                continue
            spec = self.config.models[job.model]
            groups[(spec.base, *self._mode(job))].append(item)
            longest[job.model] = max(longest.get(job.model, 0), len(item.ids))
        self._longest_prompt.update(longest)
        self.phase_s["encode"] += time.perf_counter() - started
        for key, items in groups.items():
            scoring = key[1] == "choices"
            fn = self._score if scoring else self._generate
            for chunk in self._pack(items, scoring=scoring):
                if self._past_deadline():
                    results = [RowOutput.failed(TIMEOUT, "the batch's time limit passed before it ran") for _ in chunk]
                else:
                    results = self._guarded(fn, chunk)
                for item, out in zip(chunk, results, strict=True):
                    outputs[item.index] = out
        done = [o if o is not None else RowOutput.failed(INTERNAL, "no output produced") for o in outputs]
        return [self._calibrated(job, out) for job, out in zip(jobs, done, strict=True)]

    def _calibrated(self, job: Job, out: RowOutput) -> RowOutput:
        """The one place a configured calibration replaces the raw confidence (kept as raw_confidence)."""
        return calibrated_output(out, self.config.models[job.model].calibration, scored=bool(job.choices))

    def _mode(self, job: Job) -> tuple[Any, ...]:
        """Which jobs can share a batch: choices apart from generation; on the static loop greedy and sampled rows
        together (each row samples with its own parameters), on HF generate one sampling setting per batch."""
        if job.choices:
            return ("choices",)
        if self.config.models[job.model].base in self.decoders:
            return ("generate",)
        return ("generate", *_sampling_params(job))

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _pack(self, items: list[_Item], *, scoring: bool) -> list[list[_Item]]:
        """Sub-batches that fit the memory plan at their real lengths. Sorted by length first, so rows of
        similar length share a batch and little compute is spent on padding."""
        model = items[0].job.model
        on_loop = scoring and self.config.models[model].base in self.decoders
        ordered = sorted(items, key=lambda it: len(it.ids))
        chunks: list[list[_Item]] = []
        current: list[_Item] = []
        span = new = sampled = 0  # the current chunk's most choice tokens, most new tokens, sampled rows
        for item in ordered:
            longest = len(item.ids)  # ascending order: the newcomer is the longest in the chunk
            item_span = self._choice_tokens(item.job) if on_loop else 0
            if on_loop:
                # The loop scores a row's choices after its prompt, in the KV pool: planned as a row of the
                # prompt plus all its choices' tokens (the prompt once, not once per choice).
                rows = self.plan(model, input_tokens=longest, new_tokens=max(span, item_span)).max_rows
            elif scoring:
                per_item = max(1, len(item.job.choices or ()))
                rows = self.plan(model, input_tokens=longest + 8, new_tokens=0).max_rows // per_item
            else:
                draws = sampled + (item.job.temperature > 0)
                rows = self.plan(
                    model, input_tokens=longest, new_tokens=max(new, item.max_new), sampled_rows=draws
                ).max_rows
            if current and len(current) + 1 > max(1, rows):
                chunks.append(current)
                current, span, new, sampled = [], 0, 0, 0
            current.append(item)
            span, new = max(span, item_span), max(new, item.max_new)
            sampled += not scoring and item.job.temperature > 0
        if current:
            chunks.append(current)
        return chunks

    def _guarded(
        self, fn: Callable[[list[_Item]], list[RowOutput]], items: list[_Item], *, retried: bool = False
    ) -> list[RowOutput]:
        """Out of memory first retries the batch once, if releasing the static loop's graphs and cache freed
        anything (graphs of earlier buckets pin memory the plan does not count); then it splits the batch
        in halves; only a row that fails alone is an error. The retry happens after the `except` block:
        inside it, the traceback would keep the failed attempt's activations alive."""
        try:
            return fn(items)
        except torch.OutOfMemoryError as exc:
            what = str(exc).split("\n")[0][:300]  # the text only: the exception would keep the attempt alive
        self.oom_count += 1
        log.error(
            "OUT OF MEMORY at %d rows (out-of-memory error #%d of this worker): the memory plan let this batch "
            "past what the budget holds -- a planning bug, please report it; surviving it by %s. %s",
            len(items), self.oom_count, "releasing the decode graphs and cache" if not retried else "splitting", what,
        )  # fmt: skip
        freed = self._release_memory()
        if freed and not retried:
            log.warning("out of memory at %d rows; retrying once with the decode graphs and cache released", len(items))
            return self._guarded(fn, items, retried=True)
        if len(items) == 1:
            return [RowOutput.failed(OUT_OF_MEMORY, "does not fit in memory even alone", len(items[0].ids))]
        half = len(items) // 2
        log.warning("out of memory at %d rows; splitting into %d + %d", len(items), half, len(items) - half)
        return self._guarded(fn, items[:half], retried=True) + self._guarded(fn, items[half:], retried=True)

    def _release_memory(self) -> bool:
        """Drop every static loop's graphs and cache (sized for the batch that failed); True if any held some."""
        freed = False
        for decoder in self.decoders.values():
            freed |= decoder.holds_memory()
            decoder.release()
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        return freed

    # ---- encoding ---------------------------------------------------------------------------
    def _encode(self, index: int, job: Job) -> _Item:
        (item,) = self._encode_many([job], first_index=index)
        if isinstance(item, JobFailure):
            raise item
        return item

    def _encode_many(self, jobs: Sequence[Job], *, first_index: int = 0) -> list[_Item | JobFailure]:
        """Each job's prompt as token ids (index-aligned), or the JobFailure that job fails with. The jobs of
        one base are tokenised together (see `prompt_pieces_many`)."""
        by_base: dict[str, list[int]] = defaultdict(list)
        for i, job in enumerate(jobs):
            by_base[self.config.models[job.model].base].append(i)
        out: list[_Item | JobFailure | None] = [None] * len(jobs)
        for base_name, indices in by_base.items():
            base = self.bases[base_name]
            requests = [(self.config.models[jobs[i].model], jobs[i]) for i in indices]
            for i, pieces in zip(indices, prompt_pieces_many(base.tokenizer, requests), strict=True):
                if isinstance(pieces, JobFailure):
                    out[i] = pieces
                    continue
                try:
                    out[i] = self._item(first_index + i, jobs[i], pieces)
                except JobFailure as failure:
                    out[i] = failure
        # Index-aligned, always: a job nothing was made for fails in its own place rather than shifting the rest.
        return [o if o is not None else JobFailure(INTERNAL, "the job's prompt was not encoded") for o in out]

    def _item(self, index: int, job: Job, pieces: Pieces) -> _Item:
        """A job's encoded row: its prompt within the model's input limit (cut only where the job allows)."""
        spec = self.config.models[job.model]
        base = self.bases[spec.base]
        total = sum(len(ids) for ids, _ in pieces)
        if total > spec.max_input_tokens:
            if not job.truncate:
                raise JobFailure(
                    INPUT_TOO_LONG,
                    f"prompt is {total} tokens; {job.model}'s limit is {spec.max_input_tokens} "
                    '(set "truncate": true to cut the user text instead)',
                )
            pieces = _truncate(pieces, total - spec.max_input_tokens, spec)
        ids = [t for seg_ids, _ in pieces for t in seg_ids]
        max_new = min(job.max_new_tokens or spec.max_new_tokens, spec.max_new_tokens)
        return _Item(index=index, job=job, ids=ids, max_new=max_new, adapter=base.adapters[job.model])

    # ---- generation -------------------------------------------------------------------------
    def _on_static_loop(
        self,
        items: list[_Item],
        run: Callable[[StaticDecoder, list[_Item]], list[RowOutput]],
        *,
        what: str,
        fallback: str,
    ) -> list[RowOutput] | None:
        """`run` on the base's static loop; None when the base has none, or when the loop failed -- a capture the
        device refused, a kernel it cannot run: never lose the batch over it -- in which case the loop is
        released and the base uses `fallback` from then on."""
        base = self.config.models[items[0].job.model].base
        decoder = self.decoders.get(base)
        if decoder is None:
            return None
        try:
            return run(decoder, items)
        except torch.OutOfMemoryError:
            raise  # _guarded splits the batch
        except RuntimeError:
            log.exception("%s: the static loop failed for base %s; %s from now on", what, base, fallback)
            decoder.release()
            del self.decoders[base]
            return None

    def _generate(self, items: list[_Item]) -> list[RowOutput]:
        done = self._on_static_loop(items, self._generate_static, what="decode", fallback="HF generate")
        if done is not None:
            return done
        # HF generate samples the whole batch one way: one call per sampling setting (a batch grouped for the
        # static loop, which samples per row, may mix them).
        by_params: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for i, item in enumerate(items):
            by_params[_sampling_params(item.job)].append(i)
        outputs: list[RowOutput | None] = [None] * len(items)
        for rows in by_params.values():
            for i, out in zip(rows, self._generate_eager([items[i] for i in rows]), strict=True):
                outputs[i] = out
        return [o for o in outputs if o is not None]

    def _generate_static(self, decoder: StaticDecoder, items: list[_Item]) -> list[RowOutput]:
        """Greedy rows through the static loop: the same outputs as `_generate_eager`, built the same way."""
        base = self.base_for(items[0].job.model)
        stop_ids = self._stop_ids(base)
        self._fault("generate", len(items))
        result = decoder.decode(
            [DecodeRow(ids=it.ids, max_new=it.max_new, adapter=it.adapter, sampling=_sampling(it.job)) for it in items],
            stop_ids=stop_ids,
            pad_id=base.tokenizer.pad_token_id,
            select=lambda names: self._adapters(base, names),
            deadline=self._deadline,
        )
        stops = set(stop_ids)
        started = time.perf_counter()
        outputs = [
            self._row_output(
                base, item, result.tokens[row], result.logprobs[row], bool(result.bad[row]), stops, result.cut_short
            )
            for row, item in enumerate(items)
        ]
        self.phase_s["outputs"] += time.perf_counter() - started
        return outputs

    @torch.inference_mode()
    def _generate_eager(self, items: list[_Item]) -> list[RowOutput]:
        base = self.base_for(items[0].job.model)
        tok = base.tokenizer
        input_ids, mask = left_pad([it.ids for it in items], tok.pad_token_id, self.device)
        prompt_len = input_ids.shape[1]
        limits = torch.tensor([it.max_new for it in items], device=self.device)
        stop_ids = self._stop_ids(base)
        recorder = _StepRecorder(len(items), stop_ids[0])
        job = items[0].job
        gen_config = GenerationConfig(
            max_new_tokens=int(limits.max()),
            do_sample=job.temperature > 0,
            temperature=job.temperature if job.temperature > 0 else None,
            top_p=job.top_p if job.temperature > 0 and job.top_p < 1.0 else None,
            top_k=job.top_k if job.temperature > 0 and job.top_k > 0 else None,
            eos_token_id=stop_ids,
            pad_token_id=tok.pad_token_id,
        )
        if job.seed is not None:
            torch.manual_seed(job.seed)
        self._fault("generate", len(items))
        with self._adapters(base, [it.adapter for it in items]) as kwargs:
            out = base.model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                generation_config=gen_config,
                logits_processor=LogitsProcessorList([recorder]),
                stopping_criteria=StoppingCriteriaList([_RowLimit(limits, prompt_len), _Deadline(self._deadline)]),
                **kwargs,
            )
        generated = out[:, prompt_len:]
        logprobs = recorder.finish(generated)
        cut_short = self._past_deadline()
        stops = set(stop_ids)
        return [
            self._row_output(base, item, generated[row], logprobs[row], bool(recorder.bad[row]), stops, cut_short)
            for row, item in enumerate(items)
        ]

    def _row_output(
        self,
        base: LoadedBase,
        item: _Item,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        bad: bool,
        stops: set[int],
        cut_short: bool,
    ) -> RowOutput:
        if bad:
            return RowOutput.failed(NON_FINITE_LOGITS, "the model produced NaN/inf logits for this row", len(item.ids))
        all_ids = tokens.tolist()
        stop_at = next((i for i, t in enumerate(all_ids) if t in stops), None)
        stopped = stop_at is not None and stop_at < item.max_new
        if cut_short and not stopped and len(all_ids) < item.max_new:
            # Neither its stop token nor its own limit: the batch's deadline ended this row.
            return RowOutput.failed(TIMEOUT, "generation hit the batch's time limit", len(item.ids))
        end = min(len(all_ids) if stop_at is None else stop_at, item.max_new)
        used = end + 1 if stopped else end  # the stop token is generated too, so it counts
        ids, lps = all_ids[:end], logprobs[:end]
        decode = base.tokenizer.decode
        text = decode(ids, skip_special_tokens=True)
        decision, start, stop = decision_span(ids, decode, self.config.models[item.job.model].decision_prefix)
        span = lps[start:stop] if stop > start else lps[:1]
        confidence = float(torch.exp(span.double().sum())) if span.numel() else None
        return RowOutput(
            text=text,
            decision=decision,
            confidence=confidence,
            prompt_tokens=len(item.ids),
            completion_tokens=used,
        )

    # ---- choice scoring ---------------------------------------------------------------------
    def _choice_ids(self, job: Job) -> tuple[tuple[int, ...], ...]:
        """Each choice's tokens and the end-of-answer token (a choice is scored as a whole answer). Cached per
        base and label set: a take of 600 jobs usually repeats one set of labels."""
        key = (self.config.models[job.model].base, job.choices or ())
        cached = self._choice_cache.get(key)
        if cached is None:
            base = self.base_for(job.model)
            end_id = self._stop_ids(base)[0]
            tok = base.tokenizer
            cached = tuple(
                (*tok(choice, add_special_tokens=False, split_special_tokens=True).input_ids, end_id)
                for choice in job.choices or ()
            )
            if len(self._choice_cache) >= 4096:
                self._choice_cache.clear()  # bounded: label sets chosen per job must not grow it forever
            self._choice_cache[key] = cached
        return cached

    def _choice_tokens(self, job: Job) -> int:
        return sum(len(c) for c in self._choice_ids(job))

    def _score(self, items: list[_Item]) -> list[RowOutput]:
        """Each choice's log-likelihood (its tokens + end-of-answer) after the prompt: on the static loop (the
        prompt encoded once, each choice against its cached K/V), else one padded HF forward pass."""
        done = self._on_static_loop(items, self._score_static, what="scoring", fallback="HF forward passes")
        return done if done is not None else self._score_eager(items)

    def _score_static(self, decoder: StaticDecoder, items: list[_Item]) -> list[RowOutput]:
        base = self.base_for(items[0].job.model)
        rows = [ScoreRow(ids=it.ids, choices=self._choice_ids(it.job), adapter=it.adapter) for it in items]
        self._fault("score", len(items))
        scored = decoder.score(
            rows, pad_id=base.tokenizer.pad_token_id, select=lambda names: self._adapters(base, names)
        )
        outputs = []
        for item, loglik, bad in zip(items, scored.loglik, scored.bad, strict=True):
            scores = torch.tensor(loglik, dtype=torch.float64)
            owners = [0] * len(loglik)
            outputs.append(self._choice_output(item, scores, owners, 0, not bad))
        return outputs

    @torch.inference_mode()
    def _score_eager(self, items: list[_Item]) -> list[RowOutput]:
        """Each choice's log-likelihood (its tokens + end-of-answer) after the prompt, in one forward pass."""
        base = self.base_for(items[0].job.model)
        tok = base.tokenizer
        end_id = self._stop_ids(base)[0]
        seqs, owners, lengths = [], [], []
        for row, item in enumerate(items):
            for choice in item.job.choices or ():
                cids = [*tok(choice, add_special_tokens=False, split_special_tokens=True).input_ids, end_id]
                seqs.append(item.ids + cids)
                owners.append(row)
                lengths.append(len(cids))
        input_ids, mask = left_pad(seqs, tok.pad_token_id, self.device)
        tail = max(lengths)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self._fault("score", len(items))
        with self._adapters(base, [items[o].adapter for o in owners]) as kwargs:
            logits = base.model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=tail + 1, **kwargs
            ).logits
        scores = torch.empty(len(seqs), dtype=torch.float64)
        finite = torch.ones(len(items), dtype=torch.bool)
        for k, m in enumerate(lengths):
            window = logits[k, tail - m : tail].float().log_softmax(-1)  # one sequence at a time: bounded memory
            targets = input_ids[k, -m:]
            picked = window.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            if not torch.isfinite(picked).all():
                finite[owners[k]] = False
            scores[k] = picked.double().sum()
        return [self._choice_output(item, scores, owners, row, bool(finite[row])) for row, item in enumerate(items)]

    @staticmethod
    def _choice_output(item: _Item, scores: torch.Tensor, owners: list[int], row: int, finite: bool) -> RowOutput:
        if not finite:
            return RowOutput.failed(NON_FINITE_LOGITS, "the model produced NaN/inf logits for this row", len(item.ids))
        mine = torch.stack([scores[k] for k, o in enumerate(owners) if o == row])
        probs = torch.softmax(mine, dim=0).tolist()
        labels = list(item.job.choices or ())
        best = max(range(len(labels)), key=probs.__getitem__)
        return RowOutput(
            text=labels[best],
            decision=labels[best],
            confidence=probs[best],
            choices=dict(zip(labels, probs, strict=True)),
            prompt_tokens=len(item.ids),
            completion_tokens=0,
        )

    # ---- helpers ----------------------------------------------------------------------------
    def _stop_ids(self, base: LoadedBase) -> list[int]:
        tok = base.tokenizer
        ids = [tok.convert_tokens_to_ids(s) for s in self.config.stop_strings]
        ids = [i for i in ids if isinstance(i, int) and i != tok.unk_token_id]
        return ids or [tok.eos_token_id]

    @contextlib.contextmanager
    def _adapters(self, base: LoadedBase, rows: Sequence[str | None]) -> Iterator[dict[str, Any]]:
        """Select the adapter(s) for rows of these adapter names: one active adapter for a single-model batch,
        per-row names for a mixed one."""
        names = set(rows)
        if not base.has_peft:
            yield {}
        elif len(names) > 1:
            yield {"adapter_names": [name or BASE_ADAPTER for name in rows]}
        elif None in names:
            with base.model.disable_adapter():
                yield {}
        else:
            name = next(iter(names))
            if base.active_adapter != name:
                base.model.set_adapter(name)  # walks every LoRA layer (ms on a 28-layer model): only on change
                base.active_adapter = name
            yield {}

    def _fault(self, phase: str, rows: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase, rows)

    def _resident_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return sum(b.model.get_memory_footprint() for b in self.bases.values())


class _StepRecorder(LogitsProcessor):
    """Records the log-probability of each token actually chosen, one step late (the next call's
    `input_ids` reveal the previous choice), keeping only one step of full-vocabulary scores.
    Rows with non-finite logits are flagged and forced to end, so their batch-mates carry on."""

    def __init__(self, batch: int, end_id: int) -> None:
        self.prev: torch.Tensor | None = None
        self.chosen: list[torch.Tensor] = []
        self.bad = torch.zeros(batch, dtype=torch.bool)
        self.end_id = end_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        finite = torch.isfinite(scores).all(dim=-1)
        if not bool(finite.all()):
            self.bad |= (~finite).cpu()
            scores = scores.clone()
            scores[~finite] = float("-inf")
            scores[~finite, self.end_id] = 0.0
        logp = scores.float().log_softmax(dim=-1)
        if self.prev is not None:
            self.chosen.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev = logp
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """(rows, steps) log-probs of the generated tokens (steps beyond a row's end are meaningless)."""
        if self.prev is not None and generated.shape[1] > len(self.chosen):
            self.chosen.append(self.prev.gather(1, generated[:, len(self.chosen)].unsqueeze(1)).squeeze(1))
        if not self.chosen:
            return torch.zeros((generated.shape[0], 0))
        return torch.stack(self.chosen, dim=1).cpu()


class _Deadline(StoppingCriteria):
    """Stops every row once the batch's time limit has passed (a hung or crawling generation)."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        done = self.deadline is not None and time.monotonic() >= self.deadline
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class _RowLimit(StoppingCriteria):
    """Each row stops at its own max_new_tokens (the batch runs to the longest)."""

    def __init__(self, limits: torch.Tensor, prompt_len: int) -> None:
        self.limits = limits
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return (input_ids.shape[1] - self.prompt_len) >= self.limits


def _sampling_params(job: Job) -> tuple[Any, ...]:
    """What HF generate needs the same for every row of one call."""
    if job.temperature == 0:
        return (0.0,)
    return (job.temperature, job.top_p, job.top_k, job.seed)


def _sampling(job: Job) -> Sampling | None:
    """A row's sampling on the static loop (None: greedy). Without a seed, a fresh random one: the row is then
    random, as on HF generate, but still independent of its batch-mates."""
    if job.temperature == 0:
        return None
    seed = job.seed if job.seed is not None else secrets.randbits(63)
    return Sampling(temperature=job.temperature, seed=seed, top_p=job.top_p, top_k=job.top_k)


def decision_span(
    ids: list[int], decode: Callable[[list[int]], str], prefix: str | None
) -> tuple[str | None, int, int]:
    """(decision text, first token, end token) of the decision: the line after the last `prefix`, else the
    first line. Token bounds are found by decoding growing spans, so multi-byte characters stay whole."""
    if not ids:
        return None, 0, 0
    text = decode(ids)
    start = 0
    if prefix and prefix in text:
        k = len(ids) - 1
        while k > 0 and prefix not in decode(ids[k:]):
            k -= 1
        start = k
        while start < len(ids) and prefix not in decode(ids[k : start + 1]):
            start += 1
        start += 1
    while start < len(ids) and not decode(ids[start : start + 1]).strip():
        start += 1  # whitespace between the prefix and the label is not part of the decision
    stop = start
    while stop < len(ids) and "\n" not in decode(ids[start : stop + 1]):
        stop += 1
    # `stop` now indexes the token holding the line break (or len(ids)): the span is [start, stop).
    decision = decode(ids[start:stop]).strip() or None
    return decision, start, stop


def _truncate(pieces: list[tuple[list[int], bool]], excess: int, spec: ModelSpec) -> list[tuple[list[int], bool]]:
    """Cut `excess` tokens from the end of the longest user segment (the template framing stays whole)."""
    user = [i for i, (ids, is_user) in enumerate(pieces) if is_user]
    if not user:
        raise JobFailure(INPUT_TOO_LONG, f"the template alone exceeds {spec.name}'s {spec.max_input_tokens} tokens")
    longest = max(user, key=lambda i: len(pieces[i][0]))
    ids = pieces[longest][0]
    if len(ids) <= excess:
        raise JobFailure(INPUT_TOO_LONG, f"cannot truncate to {spec.max_input_tokens} tokens for {spec.name}")
    out = list(pieces)
    out[longest] = (ids[: len(ids) - excess], True)
    return out
