"""The static decoder: the fast decode path, a static KV cache and one CUDA-graph-captured decode step per bucket.

HF `generate` spends most of a decode step in Python and kernel launches (measured on the H200: ~75-150 ms a
step whatever the batch size), so the GPU idles. Here greedy decoding of a batch runs as:

1. prefill by the loop's own layer code, in chunks of rows of similar length (~4,096 tokens each, bounding
   activation memory, up to 8,192 where the memory free then holds them), each right-padded only to its own
   longest prompt so causal attention needs no mask; layer-major: each layer's 4-bit weights are dequantised
   once per batch (one op per joined projection, not bitsandbytes' Python path, a single adapter's LoRA merged
   in) and every chunk runs through that layer before the next; K/V go straight into a preallocated cache of
   `rows x cache_len` slots, where every row's prompt ends in the same column;
2. one decode step -- embedding, every decoder layer, the LM head, the greedy choice, its log-probability,
   stop/limit bookkeeping -- written over static buffers, so on CUDA it is captured once per (rows bucket,
   length bucket, adapters) and replayed; the host checks "all rows finished?" only every few steps;
3. LoRA applied here, not by PEFT's forward: one graph serves a mixed Kev/Laya batch by multiplying each
   adapter's delta with a per-row 0/1 mask (no Python-side split, no index copies), and a single-adapter
   batch does PEFT's arithmetic (in the compute dtype where PEFT would cast to float32 and back);
4. grouped-query attention without expanding K/V to every head: in a decode step the query length is 1, so
   the `heads / kv_heads` query heads that share a KV head are passed to SDPA as that head's query rows;
5. fewer kernels per step where the result is the same element for element: RMSNorm's statistics by torch's
   fused kernel, rotary embeddings on queries and keys together, 4-bit scales decoded once, not per call.

Supported: Llama-style decoder layers (qwen2, llama, mistral) with full attention, greedy decoding. The
engine falls back to HF `generate` (with a log line) for anything else. On CPU the loop runs without graphs,
which is how the tests check it token for token against HF `generate`.

The package's rooms: `quant4` (the only bitsandbytes-op caller), `ops` (fused elementwise steps), `weights`
(projections, LoRA, joined groups, the layer stack's math), `graphs` (the state a graph owns, the KV pool,
the graph cache), `prefill`, and this module (the step, the batch loop).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from worker.fastpath import decode_attention
from worker.fastpath.graphs import (
    KV,
    Ends,
    Entry,
    GraphCache,
    GraphKey,
    KVPool,
    State,
    describe,
    length_bucket,
    row_bucket,
)
from worker.fastpath.logprobs import RowLogprobs
from worker.fastpath.ops import DEFAULT_OPS, OpsOptions
from worker.fastpath.prefill import DEFAULT_GROUP_TOKENS, AdapterSelect, Prefill, adapter_mask
from worker.fastpath.sampling import Sampling, draw_rows, greedy_choice
from worker.fastpath.scoring import Scored, ScoreRow, score_in_prefill
from worker.fastpath.weights import Masks, Stack

log = logging.getLogger("kevlaya.fastpath")

ARCHITECTURES = ("qwen2", "llama", "mistral")


# Sampled rows per take vary from take to take (5% of 160 rows is 4 to 12), and every slot count was a graph
# of its own: 9 captures where the all-greedy run took 3 (H200). A slot's draw is one row's work over the
# vocabulary, so a few idle slots cost little.
MIN_SAMPLER_SLOTS = 8


def _nothing() -> None:
    pass


def sampler_slots(sampled: int) -> int:
    """Sampler slots for a batch with this many sampled rows (0 for none): at least `MIN_SAMPLER_SLOTS`, bucketed
    like rows above that, so a few graphs serve every mix."""
    return max(MIN_SAMPLER_SLOTS, row_bucket(sampled)) if sampled else 0


def logprob_slots(asking: int) -> int:
    """Logprob slots for a batch with this many rows asking for logprobs (0 for none), bucketed as sampler slots:
    bucketed as rows (1, 2, 4, 8, 16, ...), takes of 1 to 16 asking rows each captured a graph of their own (10
    of the 43 captures in the H100's edge workloads differed from a kept graph in these slots alone). A slot
    records one row's log-softmax a step (the plan counts float32 logits for every row of such a take)."""
    return sampler_slots(asking)


@dataclass(frozen=True)
class DecodeRow:
    ids: list[int]
    max_new: int
    adapter: str | None
    sampling: Sampling | None = None  # None: greedy
    logprobs: bool = False  # record each token's log-probability and the most likely tokens (worker.fastpath.logprobs)


@dataclass(frozen=True)
class Decoded:
    tokens: torch.Tensor  # (rows, steps) on the CPU; past a row's end: padding
    logprobs: torch.Tensor  # (rows, steps) float32 log-probability of each chosen token
    bad: torch.Tensor  # (rows,) bool: non-finite logits seen while the row was live
    cut_short: bool  # the deadline ended the loop before every row finished
    reported: dict[int, RowLogprobs] = field(default_factory=dict)  # by row: the rows that asked for logprobs


def unsupported_reason(model: Any) -> str | None:
    """Why the static loop cannot run this model (None when it can)."""
    lm = causal_lm(model)
    cfg = lm.config
    if cfg.model_type not in ARCHITECTURES:
        return f"architecture {cfg.model_type!r} is not one of {', '.join(ARCHITECTURES)}"
    layer_types = getattr(cfg, "layer_types", None) or ()
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention layers"
    layer = lm.model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(layer.self_attn, name):
            return f"attention has no {name}"
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not hasattr(layer.mlp, name):
            return f"MLP has no {name}"
    if hasattr(layer.self_attn, "q_norm"):
        return "per-head query/key norms"
    return None


def causal_lm(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def choose_tokens(state: State, logits: torch.Tensor, *, sampled: bool = True, reporting: bool = True) -> None:
    """Greedy choice (or each sampled row's draw) and bookkeeping, all on the device (no host sync): as HF's
    greedy search does it -- argmax of the float32 logits (converted a chunk of rows at a time), finished rows
    emit padding -- plus the chosen token's log-probability and non-finite rows forced to end (flagged, so their
    batch-mates carry on). Rows reporting logprobs are recorded from their own slots' logits (converting every
    row's logits to float32 at once for them held ~3 float32 vocabulary vectors a row in each step; the plan
    still sets that aside, see `worker.memory.plan_batch`), and every row's token is the one it gets in a
    batch without them. `sampled` / `reporting` False: the batch has no sampled (no reporting) rows, so a state's
    idle slots (`GraphCache.reusable`) are skipped: run outside a graph (a take's first token), their float32
    temporaries would be memory no plan counted."""
    token, logprob, finite = greedy_choice(logits, state.end_id)
    if state.sampling is not None and sampled:
        # Sampled rows draw from their own distribution (greedy rows keep the argmax above; only the sampler
        # slots' rows are converted to float32); a non-finite row still ends with `end_id`.
        token, logprob = draw_rows(logits, token, logprob, finite, state.sampling, state.step, filtered=state.filtered)
    state.bad |= ~finite & ~state.finished
    token = torch.where(state.finished, state.pad_id, token)
    if state.reported is not None and reporting:
        state.reported.record(logits, token, state.step)
    state.tokens.index_copy_(1, state.step, token.unsqueeze(1))
    state.logprobs.index_copy_(1, state.step, logprob.unsqueeze(1))
    state.finished |= torch.isin(token, state.stop) | (state.step + 1 >= state.limits)
    state.ids.copy_(token.unsqueeze(1))
    state.pos += 1
    state.cache_pos += 1
    state.step += 1


class StaticDecoder:
    """Batched decoding (greedy rows and sampled rows together) over a static KV cache, with CUDA graphs when
    the device is a GPU."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        *,
        use_graphs: bool,
        check_every: int = 8,
        prefill_tokens: int = 4096,
        prefill_group_tokens: int = DEFAULT_GROUP_TOKENS,
        fuse_lora: bool = True,
        join_projections: bool = True,
        merge_lora: bool = True,
        ops: OpsOptions = DEFAULT_OPS,
    ) -> None:
        self.model = model  # what the prefill fallback calls (the PEFT wrapper, so adapters apply)
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.check_every = check_every
        self.stack = Stack(
            causal_lm(model),
            fuse_lora=fuse_lora,
            join_projections=join_projections,
            options=ops,
        )
        self.dtype = self.stack.dtype
        self.prefill = Prefill(
            model, self.stack, tokens=prefill_tokens, group_tokens=prefill_group_tokens, merge_lora=merge_lora
        )
        s = self.stack
        self.pool = KVPool(len(s.layers), s.kv_heads, s.head_dim, s.dtype, device)
        self.graphs = GraphCache(device, self.use_graphs)
        # Rows of a greedy graph captured into a fresh pool -> what the pool grew (the latest such capture): a
        # decode step's temporaries at that many rows as the allocator reserved them, read by the memory plan.
        # Kept across `release`: it measures the model's step, not one pool (the warm-up's capture gives the first).
        self.pool_readings: dict[int, int] = {}
        self.phase_s: Counter[str] = Counter()  # seconds per phase of `decode` (and steps), for benchmarks
        # Called when this thread is about to wait for the GPU for a while (a batch's prefill all queued, its
        # decode steps ahead): the worker's helper thread runs its Python then, not while this thread launches
        # prefill's kernels one by one (worker.ahead). Set by the engine for each call.
        self.on_wait: Callable[[], None] = _nothing

    # ---- what the engine and the benchmarks read ---------------------------------------------
    @property
    def prefill_tokens(self) -> int:
        return self.prefill.tokens

    @property
    def prefill_group_tokens(self) -> int:
        return self.prefill.group_tokens

    @property
    def own_prefill(self) -> bool:
        return self.prefill.own

    @property
    def captures(self) -> int:
        return self.graphs.captures

    # ---- memory ------------------------------------------------------------------------------
    @property
    def graph_rows(self) -> int:
        """The most rows of a captured graph (0 without graphs): the graphs' shared pool holds a decode step's
        temporaries for that many rows, which a smaller graph's capture reuses."""
        return max((key.rows for key, e in self.graphs.entries.items() if e.graph is not None), default=0)

    def _read_pool(self, key: GraphKey) -> None:
        """Keep what a capture into a fresh pool grew it by, for a greedy graph: sampler and logprob slots hold
        memory the plan counts apart, and a capture beside earlier graphs grows the pool only past what they
        left (the pool holds about the largest step's temporaries, not one set a graph)."""
        if key.sampled or key.logprob_slots or self.graphs.pool_captures != 1:
            return
        self.pool_readings[key.rows] = self.graphs.last_pool_growth_bytes

    def _kv_views(self, rows: int, length: int) -> KV:
        """The pool's views for rows x length; growing the pool moves it, so every captured graph goes first."""
        if not self.pool.fits(rows, length):
            self.release()
        return self.pool.views(rows, length)

    def holds_memory(self) -> bool:
        """Whether `release` would free anything: a KV pool, captured graphs or kept prompt prefixes (their K/V,
        up to `prefix.KEPT_TOKENS` tokens, lie outside the memory plan)."""
        return self.pool.buffer is not None or bool(self.graphs.entries) or len(self.prefill.prefixes) > 0

    def release(self) -> None:
        """Drop the graphs, the KV pool and the kept prompt prefixes (after an out-of-memory error, or to hand
        memory back)."""
        self.graphs.clear()
        self.pool.release()
        self.prefill.prefixes.clear()

    # ---- the step ----------------------------------------------------------------------------
    @staticmethod
    def _masks(state: State, key: GraphKey) -> Masks:
        if not key.mixed:
            return [(name, None) for name in key.adapters]
        return [(name, state.adapter_masks[name]) for name in key.adapters]

    def _forward(self, state: State, masks: Masks) -> torch.Tensor:
        """Logits (rows, vocab) for the tokens in `state.ids`, their K/V written at `state.cache_pos`."""
        s = self.stack
        rows = state.rows
        h = s.embed(state.ids)
        cos, sin = s.rotary(h, state.pos)
        x = s.ops.norm(s.layers[0].norm1, h)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(s.layers, state.kv, strict=True)):
            q, k, v = s.qkv(layer, x, masks, cos, sin, ops=s.step_ops)
            k_cache.index_copy_(2, state.cache_pos, k)
            v_cache.index_copy_(2, state.cache_pos, v)
            # Query length 1: the query heads sharing a KV head become that head's query rows -- GQA with no
            # K/V expansion. Head j uses KV head j // groups, as in HF's repeat_kv.
            q = q.reshape(rows, s.kv_heads, s.groups, s.head_dim)
            out = self._attention(state, q, k_cache, v_cache, layer.scaling)
            attn = out.reshape(rows, 1, s.heads * s.head_dim)
            h, x = s.rest(layer, h, attn, masks, s.next_norm(i), ops=s.step_ops)
        return s.head(x)[:, 0]

    @staticmethod
    def _attention(
        state: State, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """One query token a row over its columns of the cache: our kernel, reading only each row's own columns
        (`decode_attention`), else SDPA under the mask."""
        if decode_attention.serves(q, k_cache, v_cache):
            out = decode_attention.decode_attention(q, k_cache, v_cache, state.first, state.cache_pos, scale=scale)
            if out is not None:
                return out
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=state.mask, scale=scale)

    def _step(self, state: State, masks: Masks) -> None:
        state.mask.index_fill_(-1, state.cache_pos, True)  # the slot this step writes is now attended
        choose_tokens(state, self._forward(state, masks))

    # ---- graphs ------------------------------------------------------------------------------
    def _entry(self, key: GraphKey) -> tuple[State, Callable[[], None]]:
        """The state for `key` (or for a captured graph a little larger that can serve it), and how to run one
        step on it: the graph's replay, or the step itself where there are no graphs."""
        key = self.graphs.reusable(key, self.pool.fits)
        kv = self._kv_views(key.rows, key.length)  # first: may clear the graphs
        entry = self.graphs.get(key)
        if entry is None:
            state = State(key, kv, self.dtype, self.device)
            graph = None
            if self.use_graphs:
                masks = self._masks(state, key)
                began = time.perf_counter()
                try:
                    graph = self.graphs.capture(lambda: self._step(state, masks))
                except RuntimeError:
                    self.release()
                    raise
                took = time.perf_counter() - began
                self._read_pool(key)
                self.phase_s["captures"] += 1
                self.phase_s["capture"] += took  # host seconds, part of "setup"
                # One line per capture, its host seconds and what it added to the graphs' pool: a stream of shapes
                # causing a capture storm shows, and the plan's per-row decode estimate can be read against it.
                log.info(
                    "decode: captured a graph for %d rows x %d tokens (%s; %d captured so far, %d kept) in %.3f s; "
                    "the graphs' pool grew %d MiB",
                    key.rows, key.length, describe(key), self.graphs.captures, len(self.graphs.entries) + 1,
                    took, self.graphs.last_pool_growth_bytes >> 20,
                )  # fmt: skip
            entry = Entry(state=state, graph=graph)
            self.graphs.put(key, entry)
        state, graph = entry.state, entry.graph
        if graph is not None:
            return state, graph.replay
        masks = self._masks(state, key)
        return state, lambda: self._step(state, masks)

    # ---- one batch ---------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(
        self,
        rows: Sequence[DecodeRow],
        *,
        stop_ids: Sequence[int],
        pad_id: int,
        select: AdapterSelect,
        deadline: float | None = None,
    ) -> Decoded:
        """Decode every row (greedy, or sampled as its `sampling` says) to its stop token or its own `max_new`;
        `select(adapters)` is the engine's
        adapter choice for the prefill fallback (PEFT's own path)."""
        n = len(rows)
        width = max(len(r.ids) for r in rows)
        max_new = max(r.max_new for r in rows)
        names = {r.adapter for r in rows}
        asking = [i for i, r in enumerate(rows) if r.logprobs]
        key = GraphKey(
            rows=row_bucket(n),
            length=length_bucket(width + max_new),
            adapters=tuple(sorted(a for a in names if a is not None)),
            mixed=len(names) > 1,
            ends=Ends(end_id=stop_ids[0], pad_id=pad_id, stops=tuple(sorted(set(stop_ids)))),
            samplers=sampler_slots(sum(r.sampling is not None for r in rows)),
            filtered=any(r.sampling is not None and r.sampling.filtered for r in rows),
            logprob_slots=logprob_slots(len(asking)),
        )
        started = time.perf_counter()
        state, replay = self._entry(key)
        self._reset(state, rows, width, key.adapters if key.mixed else ())
        prefill_at = time.perf_counter()
        first = self.prefill.run(state.kv, rows, width=width, out_rows=state.rows, pad_id=pad_id, select=select)
        choose_tokens(state, first, sampled=any(r.sampling is not None for r in rows), reporting=bool(asking))
        self.on_wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # one wait per batch, so the phase times below are the GPU's
        decode_at = time.perf_counter()
        steps = 1
        cut_short = False
        while steps < max_new:
            for _ in range(min(self.check_every, max_new - steps)):
                replay()
                steps += 1
            if bool(state.finished[:n].all()):
                break
            if deadline is not None and time.monotonic() >= deadline:
                cut_short = True
                break
        cpu = torch.device("cpu")  # copies: on the CPU `.cpu()` would hand out views the next batch overwrites
        result = Decoded(
            tokens=state.tokens[:n, :steps].to(cpu, copy=True),
            logprobs=state.logprobs[:n, :steps].to(cpu, copy=True),
            bad=state.bad[:n].to(cpu, copy=True),
            cut_short=cut_short,  # only set while some row is unfinished
            reported=state.reported.rows(asking, steps) if state.reported is not None else {},
        )
        done = time.perf_counter()
        self.phase_s["setup"] += prefill_at - started  # graph captures included
        self.phase_s["prefill"] += decode_at - prefill_at
        self.phase_s["decode"] += done - decode_at
        self.phase_s["decode_steps"] += steps
        log.debug(
            "batch rows=%d bucket=%d length=%d width=%d steps=%d setup=%.3fs prefill=%.3fs decode=%.3fs captures=%d",
            n, state.rows, key.length, width, steps, prefill_at - started, decode_at - prefill_at, done - decode_at,
            self.captures,
        )  # fmt: skip
        return result

    @torch.inference_mode()
    def score(self, rows: Sequence[ScoreRow], *, pad_id: int) -> Scored | None:
        """Each row's choices scored by log-likelihood after its prompt, inside the loop's own prefill (see
        `scoring`): no KV pool, so a take holding both kinds of rows releases nothing. None where the loop's
        own prefill is off: HF's forward passes score them."""
        started = time.perf_counter()
        scored = score_in_prefill(self.prefill, rows, pad_id=pad_id)
        self.phase_s["score"] += time.perf_counter() - started
        return scored

    def _reset(self, state: State, rows: Sequence[DecodeRow], width: int, mixed_adapters: tuple[str, ...]) -> None:
        """Fresh state for a batch: zeroed cache (stale or uninitialised slots must not hold NaNs: a masked
        slot's weight is 0, but 0 x NaN is NaN), masks over each row's real tokens, per-row limits."""
        n, bucket = len(rows), state.rows
        for k, v in state.kv:
            k.zero_()
            v.zero_()
        # Built in numpy, all rows at once: torch's CPU ops row by row were ~1,000 small operations a take.
        lengths = np.ones(bucket, dtype=np.int64)  # bucket padding rows: one real slot, finished from the start
        lengths[:n] = [len(row.ids) for row in rows]
        limits = np.ones(bucket, dtype=np.int64)
        limits[:n] = [row.max_new for row in rows]
        columns = np.arange(state.length)
        mask = (columns >= width - lengths[:, None]) & (columns < width)
        finished = np.arange(bucket) >= n
        state.mask.copy_(torch.from_numpy(mask).view(bucket, 1, 1, -1))
        state.first.copy_(torch.from_numpy(width - lengths))
        # choose_tokens advances each row's position to its first generated token's
        state.pos.copy_(torch.from_numpy(lengths[:, None] - 1))
        state.limits.copy_(torch.from_numpy(limits))
        state.finished.copy_(torch.from_numpy(finished))
        state.bad.zero_()
        state.step.zero_()
        state.cache_pos.fill_(width - 1)
        if state.sampling is not None:
            state.sampling.reset([r.sampling for r in rows], self.stack.head.out_features)
        if state.reported is not None:
            state.reported.reset([i for i, r in enumerate(rows) if r.logprobs])
        for name in mixed_adapters:
            state.adapter_masks[name][:n].copy_(adapter_mask(rows, name, self.dtype, self.device))
            state.adapter_masks[name][n:] = 0.0
