"""The static decode loops (worker/fastpath/), one per base that supports one: which bases get one, warming them up
at start, and greedy and sampled rows through them."""

from __future__ import annotations

import gc
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import torch

from shared.job import Job
from worker.config import ModelsConfig
from worker.fastpath import Decoded, DecodeRow, OpsOptions, Sampling, ScoreRow, StaticDecoder, unsupported_reason
from worker.fastpath.prefix import PrefixCache
from worker.loading import LoadedBase, select_adapters, stop_ids
from worker.rows import BaseCall, Item

log = logging.getLogger("kevlaya.engine")
# auto: greedy rows through the static decode loop wherever the model supports it, with CUDA graphs on a GPU
# (on 2 CPU cores it is also ~2x HF generate, token for token the same); static: the loop without graphs
# (to compare or profile); eager: always HF generate (the fast path off).
DECODE_MODES = ("auto", "eager", "static")
T = TypeVar("T")


class StaticLoops:
    """The bases' static loops by base name (`decoders`; a base without one runs on HF generate)."""

    def __init__(
        self,
        bases: dict[str, LoadedBase],
        *,
        decode: str,
        device: torch.device,
        ops: OpsOptions,
    ) -> None:
        self.device = device
        self.decoders: dict[str, StaticDecoder] = {}
        for name, base in bases.items():
            decoder = static_decoder(name, base, decode=decode, device=device, ops=ops)
            if decoder is not None:
                self.decoders[name] = decoder

    def run(self, base: str, fn: Callable[[StaticDecoder], T], *, what: str, fallback: str) -> T | None:
        """`fn` on the base's static loop; None when the base has none, or when the loop failed -- a capture the
        device refused, a kernel it cannot run: never lose the batch over it -- in which case the loop is
        released and the base uses `fallback` from then on."""
        decoder = self.decoders.get(base)
        if decoder is None:
            return None
        try:
            return fn(decoder)
        except torch.OutOfMemoryError:
            raise  # the engine's OomGuard splits the batch
        except RuntimeError:
            log.exception("%s: the static loop failed for base %s; %s from now on", what, base, fallback)
            decoder.release()
            del self.decoders[base]
            return None

    def release(self) -> bool:
        """Drop every static loop's graphs and cache (sized for the batch that failed); True if any held some."""
        freed = False
        for decoder in self.decoders.values():
            freed |= decoder.holds_memory()
            decoder.release()
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
        return freed

    def drop_idle(self, idle_s: float, *, min_rows: int) -> int:
        """Every loop's large graphs unused for `idle_s` dropped (see `GraphCache.drop_idle`); how many."""
        return sum(d.graphs.drop_idle(idle_s, min_rows=min_rows) for d in self.decoders.values())

    def phase_seconds(self) -> Counter[str]:
        """The loops' setup (graph captures included), prefill and decode seconds (with the step count)."""
        total: Counter[str] = Counter()
        for decoder in self.decoders.values():
            total.update(decoder.phase_s)
        return total

    @property
    def captures(self) -> int:
        return sum(d.captures for d in self.decoders.values())


def static_decoder(
    name: str,
    base: LoadedBase,
    *,
    decode: str,
    device: torch.device,
    ops: OpsOptions,
) -> StaticDecoder | None:
    """The base's static loop, or None where it runs on HF generate (the mode says so, or the model is not one the
    loop supports)."""
    if decode == "eager":
        return None
    reason = unsupported_reason(base.model)
    if reason is not None:
        log.warning("decode: HF generate for base %s, the static loop does not support it: %s", name, reason)
        return None
    graphs = decode == "auto" and device.type == "cuda"
    log.info("decode: static KV cache %s for base %s", "with CUDA graphs" if graphs else "without graphs", name)
    return StaticDecoder(base.model, device, use_graphs=graphs, ops=ops)


def warm_up(
    decoders: dict[str, StaticDecoder],
    bases: dict[str, LoadedBase],
    config: ModelsConfig,
    *,
    rows_for: Callable[[list[str]], int],
    device: torch.device,
) -> None:
    """One tiny batch per model (and per mixed pair) through each static loop, then its graphs and cache
    dropped. A GPU's first use of a kernel loads it, and cuBLAS/bitsandbytes set up on their first call:
    on the H200 that made the first real batch's setup 1.6 s instead of ~0.2 s. Paid here, at start,
    not by the first jobs; so is cuBLAS's choice at each row count prefill's matmuls run at
    (`Prefill.warm_row_counts`). `rows_for(models)` is the largest take of those models (a row bucket)."""
    started = time.perf_counter()
    for base_name, decoder in decoders.items():
        base = bases[base_name]
        models = [m for m, spec in config.models.items() if spec.base == base_name]
        adapters = [base.adapters.get(m) for m in models]
        groups = [[a] for a in dict.fromkeys(adapters)] + ([adapters] if len(set(adapters)) > 1 else [])
        rows = rows_for(models)
        token, stops = base.tokenizer.eos_token_id or 0, stop_ids(base, config.stop_strings)
        pad_id = base.tokenizer.pad_token_id
        select = lambda chosen, base=base: select_adapters(base, chosen)  # noqa: E731
        # Warm-up rows are one token repeated: rows sharing all but their last would run as a prefix and
        # one-token chunks, warming nothing real takes run. No sharing here; a fresh set of prefixes after.
        decoder.prefill.prefixes = PrefixCache(min_tokens=0)
        for names in groups:
            # The largest take (prefill in full chunks, then two decode steps), and one row: the kernels real
            # batches use (matmul shapes follow the rows and the chunk's tokens), and the compiled elementwise
            # kernels' shape families (a dimension of 1 is its own).
            # One row at two cache lengths: with one length seen, the first real single-row batch of another
            # length (an interactive job) recompiled and captured in 0.9 s on the H200, against ~0.15 s after.
            shapes = ((rows, 29), (1, 53), (1, 117)) if len(names) == 1 else ((rows, 29),)
            for n, width in shapes:
                # Prompt lengths equal to no model dimension: torch.compile treats equal sizes as one symbol
                # (a 14-token warm-up matched 12 query + 2 KV heads), and real lengths then recompile.
                batch = [DecodeRow(ids=[token] * width, max_new=2, adapter=names[i % len(names)]) for i in range(n)]
                decoder.decode(batch, stop_ids=stops, pad_id=pad_id, select=select)
            if len(names) == 1:
                # Choice scoring's own kernels (each choice's tokens beside its prompt in the prefill): the first
                # take of choice jobs spent 1.7 s where the next ones spent ~0.5 s on the H200.
                choices = ((token, token), (token, token, token))
                scored = [ScoreRow(ids=[token] * 29, choices=choices, adapter=names[0]) for _ in range(3)]
                decoder.score(scored, pad_id=pad_id)
        decoder.prefill.warm_row_counts()
        decoder.prefill.prefixes = PrefixCache()
        decoder.release()
        decoder.phase_s.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    log.info("decode: warmed up in %.1f s", time.perf_counter() - started)


def generate_static(call: BaseCall, decoder: StaticDecoder, items: list[Item]) -> Decoded:
    """Greedy and sampled rows through the static loop: the same tokens as HF generate gives greedy rows."""
    call.fault("generate", len(items))
    return decoder.decode(
        [
            DecodeRow(
                ids=it.ids, max_new=it.max_new, adapter=it.adapter, sampling=sampling(it.job), logprobs=it.job.logprobs
            )
            for it in items
        ],
        stop_ids=call.stop_ids,
        pad_id=call.base.tokenizer.pad_token_id,
        select=call.adapters,
        deadline=call.deadline,
    )


def sampling(job: Job) -> Sampling | None:
    """A row's sampling on the static loop (None: greedy). Without a seed, a fresh random one: the row is then
    random, as on HF generate, but still independent of its batch-mates."""
    if job.temperature == 0:
        return None
    seed = job.seed if job.seed is not None else secrets.randbits(63)
    return Sampling(temperature=job.temperature, seed=seed, top_p=job.top_p, top_k=job.top_k)
