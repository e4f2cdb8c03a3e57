"""The static state a decode graph owns, the KV pool its caches are views of, and the cache of captured graphs.

A CUDA graph replays kernels on fixed addresses: every tensor a captured step reads or writes must stay alive,
and at the same address, for as long as the graph may replay. So each graph has one `State` record that owns
all of them (the stop ids included), and nothing a graph reads is built per call.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from worker.fastpath.logprobs import LogprobState
from worker.fastpath.sampling import SamplingState

log = logging.getLogger("kevlaya.fastpath")

# Rows are padded up to one of these, so a handful of graphs serve every batch size. The memory plan is rounded
# down to one, so coarse steps cost whole batches: a take cut at 192 where 214 fit cost an extra batch, and 200
# Kev prompts at the 1,024-token limit, 74 of which fit, ran as 64 + 64 + 64 + 8 (four 128-step decodes) where
# steps of 8 below 128 make it 72 + 72 + 56. Steps of 16 from 128 to 256 (6% or less of a take).
ROW_BUCKETS = (1, 2, 4, 8, *range(16, 128, 8), *range(128, 257, 16), 288, 320, 352, 384, 448, 512)
LENGTH_QUANTUM = 64  # cache lengths are multiples of this (aligned SDPA masks, few distinct graphs)
# Captured graphs kept (least recently used dropped); each pins its static buffers (a few MiB: tokens, log-
# probabilities and mask over its rows x length, its slots), its step's temporaries in the shared pool. 12 were
# full in the H100's edge workloads (Laya and Kev takes of several lengths, greedy, sampled and logprob rows):
# each capture there dropped a graph a later take captured again.
MAX_GRAPHS = 20
ROW_SLACK = 1.5  # a captured graph of up to this many times a batch's rows serves it (see `GraphCache.reusable`)
# A captured graph with up to this many idle sampler (or logprob) slots serves a batch that needs none (or few):
# an idle slot's draw or record is one row's work over the vocabulary, discarded, where a capture costs 0.2-0.5 s
# and a mix of greedy, sampled and logprob takes otherwise kept a graph per kind (51 captures in 61 s on the
# H100's edge-mixed workload, twenty-first session). Equal to the fewest sampler slots a sampled take gets.
IDLE_SLOTS = 8

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (keys, values), each (rows, kv_heads, length, head_dim)


def row_bucket(rows: int) -> int:
    return next((b for b in ROW_BUCKETS if b >= rows), rows)


def length_bucket(tokens: int) -> int:
    return LENGTH_QUANTUM * math.ceil(tokens / LENGTH_QUANTUM)


@dataclass(frozen=True)
class Ends:
    """How a row ends: the id a non-finite row is forced to emit, the padding finished rows emit, and every
    stop id. Part of a graph's key: the ids are baked into (or owned by) the captured step."""

    end_id: int
    pad_id: int
    stops: tuple[int, ...]


@dataclass(frozen=True)
class GraphKey:
    """What a captured step depends on besides its state's contents."""

    rows: int
    length: int
    adapters: tuple[str, ...]
    mixed: bool  # per-row adapter masks (else every row uses every adapter in `adapters`: zero or one)
    ends: Ends
    # Sampler slots: the batch's sampled rows, bucketed (0: greedy only, the step skips drawing). Only these
    # slots draw, so a few sampled rows among hundreds cost a few rows' worth of sampling work and memory.
    samplers: int = 0
    filtered: bool = False  # some sampled row cuts to top-p / top-k: the step sorts its slots' logits
    # Logprob slots: the batch's rows that asked for per-token logprobs, bucketed (0: the step records none).
    logprob_slots: int = 0

    @property
    def sampled(self) -> bool:
        return self.samplers > 0


def describe(key: GraphKey) -> str:
    """A key's parts besides rows and length, for the capture log: a stream that keeps capturing shows which
    part of its takes differs (the adapters, sampler or logprob slots, the stop ids)."""
    parts = ["+".join(key.adapters) or "base"]
    if key.mixed:
        parts.append("mixed")
    if key.samplers:
        parts.append(f"{key.samplers} sampler slots{' filtered' if key.filtered else ''}")
    if key.logprob_slots:
        parts.append(f"{key.logprob_slots} logprob slots")
    parts.append(f"stops {list(key.ends.stops)}")
    return ", ".join(parts)


class State:
    """Every tensor one graph reads and writes (a captured graph reads them by address, so it owns them all);
    the KV tensors are views of the shared pool for its rows x length."""

    def __init__(self, key: GraphKey, kv: KV, dtype: torch.dtype, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        rows, length = key.rows, key.length
        self.rows, self.length, self.kv = rows, length, kv
        # The stop ids live here, not in a tensor built per call: a captured graph reads them by address, and a
        # per-call tensor's block is reused by the allocator once the call returns (no early stop, or a stray
        # token taken for a stop, on a later replay).
        self.end_id, self.pad_id = key.ends.end_id, key.ends.pad_id
        self.stop = torch.tensor(key.ends.stops, dtype=torch.long, device=device)
        self.ids = zeros(rows, 1)
        self.pos = zeros(rows, 1)
        self.cache_pos = zeros(1)
        self.step = zeros(1)
        self.limits = zeros(rows)
        self.mask = zeros(rows, 1, 1, length, dtype=torch.bool)
        self.first = zeros(rows)  # each row's first attended column (its prompt's first), for `decode_attention`
        self.tokens = zeros(rows, length)
        self.logprobs = zeros(rows, length, dtype=torch.float32)
        self.finished = zeros(rows, dtype=torch.bool)
        self.bad = zeros(rows, dtype=torch.bool)
        # (rows, 1, 1) 0/1 per adapter of a mixed batch: multiplies that adapter's LoRA delta per row.
        self.adapter_masks: dict[str, torch.Tensor] = {
            name: zeros(rows, 1, 1, dtype=dtype) for name in (key.adapters if key.mixed else ())
        }
        self.sampling = SamplingState(key.samplers, rows, device) if key.sampled else None
        self.filtered = key.filtered
        self.reported = LogprobState(key.logprob_slots, length, device) if key.logprob_slots else None


class KVPool:
    """One buffer for every layer's K and V, so graphs of different buckets share the memory (only one batch
    runs at a time). Growing the pool moves it, which invalidates every graph holding views of it."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.buffer: torch.Tensor | None = None

    def bytes_for(self, rows: int, length: int) -> int:
        return 2 * self.layers * rows * self.kv_heads * length * self.head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def fits(self, rows: int, length: int) -> bool:
        return self.buffer is not None and self.nbytes >= self.bytes_for(rows, length)

    def views(self, rows: int, length: int) -> KV:
        """Per-layer K and V views for `rows x length`; the caller must have grown the pool (see `fits`)."""
        per = rows * self.kv_heads * length * self.head_dim
        need = 2 * self.layers * per
        if self.buffer is None or self.buffer.numel() < need:
            self.buffer = None  # the old buffer freed before the new one is allocated
            self.buffer = torch.zeros(need, dtype=self.dtype, device=self.device)
        shape = (rows, self.kv_heads, length, self.head_dim)
        return [
            (
                self.buffer[2 * i * per : (2 * i + 1) * per].view(shape),
                self.buffer[(2 * i + 1) * per : (2 * i + 2) * per].view(shape),
            )
            for i in range(self.layers)
        ]

    def release(self) -> None:
        self.buffer = None


@dataclass(frozen=True)
class Entry:
    state: State
    graph: torch.cuda.CUDAGraph | None  # None: no graphs (CPU, or `--decode static`), the step runs eagerly


class GraphCache:
    """The entries (state + captured graph) per key, least recently used dropped past `MAX_GRAPHS`, all graphs
    capturing into one shared memory pool."""

    def __init__(self, device: torch.device, use_graphs: bool) -> None:
        self.device = device
        self.use_graphs = use_graphs
        self.entries: OrderedDict[GraphKey, Entry] = OrderedDict()
        self.used_at: dict[GraphKey, float] = {}  # monotonic seconds of each entry's last use
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        # A captured graph of up to this many times a batch's rows serves it (no graphs, nothing to save).
        self.reuse_slack = ROW_SLACK if use_graphs else 1.0
        # A captured graph of up to this many times a batch's cache length serves it. A stream of prompts of many
        # lengths otherwise captured a graph for every 64-token length bucket (29 captures in 81 s on the H200).
        self.length_slack = 1.25 if use_graphs else 1.0
        self.idle_slots = IDLE_SLOTS if use_graphs else 0  # (see `IDLE_SLOTS`; without graphs nothing is saved)
        self.captures = 0  # graphs captured so far (a benchmark figure)
        # What the last capture added to the graphs' shared pool (segments the allocator reserved while it
        # captured): the decode temporaries the memory plan estimates per row, as one capture measured them.
        self.last_pool_growth_bytes = 0
        # Captures into the shared pool since it was made: the first one measures a step on its own.
        self.pool_captures = 0
        # One side stream for every capture, as `torch.cuda.graph` keeps one: cuBLAS keeps a workspace per
        # (handle, stream) for the life of the process, so a stream per capture leaked one workspace each.
        self._stream: torch.cuda.Stream | None = None

    def reusable(self, key: GraphKey, fits: Callable[[int, int], bool]) -> GraphKey:
        """An already captured graph's key that can serve this batch instead of a new capture: the same key but
        for more sampler (and logprob) slots (`_slots_serve`: idle slots draw and record nothing the batch reads,
        so greedy rows stay greedy), up to `reuse_slack` x the rows (its extra rows idle along) and up to
        `length_slack` x the cache length (the extra slots stay masked), whose rows x length the KV pool already
        holds (`fits`: no memory beyond what is allocated, so no plan is exceeded; a take's first token, chosen
        outside the graph, skips idle slots: `choose_tokens`). A capture costs ~0.5 s on the
        H200; a step of 256 rows costs ~5% more than one of 224, and a few masked columns cost the attention
        almost nothing. Of several, the smallest serves."""
        fitting = [
            k
            for k in self.entries
            if replace(k, rows=key.rows, length=key.length, samplers=key.samplers, logprob_slots=key.logprob_slots)
            == key
            and key.rows <= k.rows <= key.rows * self.reuse_slack
            and self._slots_serve(key.samplers, k.samplers)
            and self._slots_serve(key.logprob_slots, k.logprob_slots)
            and key.length <= k.length <= key.length * self.length_slack
            and fits(k.rows, k.length)
        ]
        return min(fitting, key=lambda k: (k.rows * k.length, k.rows, k.samplers, k.logprob_slots), default=key)

    def _slots_serve(self, wanted: int, captured: int) -> bool:
        """Whether a graph's `captured` sampler (or logprob) slots serve a batch wanting `wanted`: enough, and
        no more than twice as many or `idle_slots`, whichever is more."""
        return wanted <= captured <= max(2 * wanted, self.idle_slots)

    def get(self, key: GraphKey) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            self.used_at[key] = time.monotonic()
        return entry

    def put(self, key: GraphKey, entry: Entry) -> None:
        self.entries[key] = entry
        self.used_at[key] = time.monotonic()
        while len(self.entries) > MAX_GRAPHS:
            self.used_at.pop(self.entries.popitem(last=False)[0], None)

    def drop_idle(self, idle_s: float, *, min_rows: int) -> int:
        """Drop the graphs of `min_rows` rows or more unused for `idle_s`; how many were dropped. Each pins its
        static buffers (a 256-row graph's logits alone are ~155 MiB at Qwen's vocabulary), which the memory plan
        counts as held: graphs for take sizes no longer seen (the warm-up's, paced takes' after interactive
        work stopped) would otherwise shrink every later take. Small graphs cost little and stay."""
        now = time.monotonic()
        idle = [k for k in self.entries if k.rows >= min_rows and now - self.used_at.get(k, now) >= idle_s]
        for key in idle:
            del self.entries[key]
            self.used_at.pop(key, None)
        if idle and not self.entries:
            self.clear()
        return len(idle)

    def clear(self) -> None:
        self.entries.clear()
        self.used_at.clear()
        if self.use_graphs:
            # A graph memory pool whose graphs are all gone cannot take a new capture (the allocator asserts
            # on it), so later captures share a fresh one.
            self._pool = torch.cuda.graph_pool_handle()
            self.pool_captures = 0

    def capture(self, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """`step` (which touches only its state's tensors) captured as a CUDA graph. Out of memory while
        capturing is raised as `torch.OutOfMemoryError` (the engine splits the batch on it)."""
        # Warm up on a side stream first (lazy cuBLAS/bnb initialisation must not happen inside a capture);
        # the warm-up writes garbage into the state, which every batch overwrites before replaying.
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            # Blocks cached for ordinary allocations cannot be handed to the graph's pool while it captures
            # (freeing them there is not allowed), so under a memory cap a capture runs out of memory unless
            # the cache is emptied first -- as `torch.cuda.graph(...)` does, but without its garbage
            # collection (~0.6 s a capture in the nightly profile).
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved(self.device)
            with torch.cuda.stream(stream):
                graph.capture_begin(self._pool)
                try:
                    step()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        except RuntimeError as exc:
            if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc):
                # The engine splits the batch on this; whatever else broke the capture stays a RuntimeError.
                raise torch.OutOfMemoryError(f"out of memory while capturing a decode graph: {exc}") from exc
            raise
        self.captures += 1
        self.last_pool_growth_bytes = torch.cuda.memory_reserved(self.device) - reserved
        self.pool_captures += 1
        return graph
