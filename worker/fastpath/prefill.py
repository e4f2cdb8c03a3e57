"""Prefill: the prompts' K/V into the static cache, by the loop's own layer code, layer by layer.

Rows are grouped by prompt length into chunks of about `tokens` tokens (bounding the activations one chunk's
layer step makes), each right-padded only to its own longest prompt, so causal attention needs no mask and SDPA
runs its flash kernel, reading the grouped KV heads as they are; K/V go straight into the cache, every row's
prompt ending in the same column (`width`).

The take runs layer-major over groups of consecutive chunks holding at most `group_tokens` (padded) prompt
tokens together: each layer's 4-bit weights are dequantised once per group, and every chunk of the group goes
through that layer before the next one (chunk by chunk through all layers, the same weights were dequantised --
and the LoRA merged -- once per chunk: ~19% of prefill GPU time on the H200). Chunks of one adapter run with its
LoRA merged into the dequantised weights (in place for the last adapter a layer serves); mixed chunks add each
adapter's delta masked per row. The price is memory: the group's hidden states (the residual stream and its
norm) are held between layers. Bounding them by a group, not the whole take, caps what the planner sets aside
(`ModelShape.prefill_held_bytes_per_token` per padded token, up to one group; a smaller take only its own):
planned per row past a group, they cost nightly-like takes ~12% of their rows. Should the loop's
own prefill ever fail on a device, the model's own forward takes over from then on (with a log line).

A chunk may carry a tail (`ChunkTail`): tokens its rows run after their prompts, in the chunk's own layer
steps -- choice scoring's choices (worker/fastpath/scoring.py), which then need no cache at all. Its tokens
sit after the chunk's padded prompts in the same tensors, so every projection, norm and MLP serves both in one
launch; only attention splits: the prompts' queries run causal flash attention over the prompts as in any
chunk, the tail's queries one masked attention over the prompts and the tail (a tail of its own beside each
group paid a layer step's ~20 launches a chunk more, each tens of microseconds of host time).

Where every row of a take starts with the same tokens (a model template's system part), those run once, as a
one-row chunk in each layer of the take's first group, and are kept for later takes (worker/fastpath/prefix.py):
chunks then hold only their rows' own tokens, each layer step reading the prefix's K/V before its own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from worker.fastpath import gemm, staging
from worker.fastpath.graphs import KV
from worker.fastpath.ops import Ops, causal_attention, prefill_attention
from worker.fastpath.prefix import PrefixCache, SharedPrefix, suffixes
from worker.fastpath.weights import Dense, Layer, Masks, Stack, is_mixed, only_adapter

log = logging.getLogger("kevlaya.fastpath")

# A layer-major group of 8 chunks of the planned 4,096 tokens (4 of 8,192 where memory allows them): each layer
# dequantised once per group, not per chunk; for a Qwen2.5-1.5B shape in bfloat16 (6,160 bytes a token) ~192 MiB
# held at most, what the planner sets aside for a take larger than a group (worker/memory.py).
GROUP_TOKENS = 32768
# What the loop runs by default. Measured on the H200 under a 6 GiB budget (`python -m bench prefill`, one
# process, the median of 3 runs; 256 nightly rows / 64 Kev rows at 1,024 tokens / 256 rows scoring 3 choices):
# chunks alone with the compiled rotary and SiLU x up took 0.50 / 0.51 / 0.60 s, groups of GROUP_TOKENS with
# our kernels (`Stack.prefill_ops`) 0.37 / 0.40 / 0.47 s, every take still in one piece (one new token a row;
# the held group, ~192 MiB, is part of every generation take's plan beside the chunk's measured transients:
# nightly-2000's Laya takes still hold 256 rows). Chunks alone are host bound (their dequantise and merge
# launches, 8 a layer and chunk): the kernels alone gained nothing there, and larger chunks (16,384 tokens)
# planned so much activation memory that 256 rows took 3 takes.
DEFAULT_GROUP_TOKENS = GROUP_TOKENS
# The most prompt tokens a chunk holds where the memory free at the take's prefill allows more than the
# planned chunk (`Prefill.room`): fewer, larger chunks spend less host time a token (a chunk's layer step is ~13
# launches, each tens of microseconds of host time). Measured on the H200 (`bench prefill --chunks`, 256 rows):
# 4,096 -> 8,192 tokens took scoring 0.389 -> 0.331 s and nightly prefill 0.319 -> 0.304 s; 16,384 was slower
# again (0.360 / 0.325 s: a chunk's rows span more prompt lengths, and padding grows).
MAX_CHUNK_TOKENS = 8192

# The LM head's row counts warmed at start: a chunk's rows (its first-token logits) and scoring's slices of
# positions, up to the row block (`Stack.logits`); a chunk of more rows (prompts of under ~32 tokens) meets its
# count in its first take.
HEAD_WARM_ROWS = gemm.ROW_BLOCK

# The chunk tokens memory allows now, beside a held group of this many prompt tokens (None: no figure).
Room = Callable[[int], int | None]

AdapterSelect = Callable[[Sequence[str | None]], contextlib.AbstractContextManager[dict[str, Any]]]


class PromptRow(Protocol):
    """What prefill needs of a row: its prompt's token ids and its adapter (None: the base model)."""

    @property
    def ids(self) -> Sequence[int]: ...

    @property
    def adapter(self) -> str | None: ...


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without waiting for the GPU (worker/fastpath/staging.py): a plain
    `.to("cuda")` synchronises the stream, so each prefill chunk's inputs would wait for the previous chunk's
    kernels to finish."""
    if device.type != "cuda":
        return tensor.to(device)
    return staging.to_cuda(tensor, device)


@dataclass(frozen=True)
class Prompts:
    """A take's prompts as host arrays, built in one step (not row by row): every token side by side, and where
    each row's tokens start and how many there are. numpy, not torch, on the host: on the H200 machine torch's
    CPU ops around a 4,096-token chunk's padding took ~7 ms a chunk (~0.1 s of a 256-row take's prefill, the
    GPU waiting), the same work in numpy well under 1 ms."""

    tokens: np.ndarray  # (total,) int64
    starts: np.ndarray  # (rows,)
    lengths: np.ndarray  # (rows,)

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]]) -> Prompts:
        lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        tokens = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
        return cls(tokens=tokens, starts=lengths.cumsum() - lengths, lengths=lengths)

    def padded(self, index: np.ndarray, real: np.ndarray, pad_id: int) -> np.ndarray:
        """(len(index), real.shape[1]) ids: the tokens of rows `index` where `real` is set (each row's real
        slots in order, as many as its length), `pad_id` elsewhere."""
        ids = np.full(real.shape, pad_id, dtype=np.int64)
        offsets = real.cumsum(-1) - 1  # the k-th real slot of a row holds its k-th token
        ids[real] = self.tokens[(self.starts[index, None] + offsets)[real]]
        return ids


def host_to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array onto `device` (see `to_device`)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(array)), device)


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask (1 = real token), each row left-padded to `width` (default: the longest),
    so every row's last prompt token sits in the same column."""
    prompts = Prompts.of(rows)
    width = width or int(prompts.lengths.max())
    real = np.arange(width) >= width - prompts.lengths[:, None]
    ids = prompts.padded(np.arange(len(rows)), real, pad_id)
    return host_to_device(ids, device), host_to_device(real.astype(np.int64), device)


def positions_of(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows, as HF's generate derives them from the attention mask."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def adapter_mask(rows: Sequence[PromptRow], name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(rows, 1, 1): 1 where the row uses adapter `name`, else 0 -- multiplies that adapter's LoRA delta."""
    sel = [1.0 if r.adapter == name else 0.0 for r in rows]
    return to_device(torch.tensor(sel, dtype=dtype), device).view(-1, 1, 1)


def row_masks(part: Sequence[PromptRow], dtype: torch.dtype, device: torch.device) -> Masks:
    """LoRA selection for rows run together: no masks when every row uses one adapter (PEFT's arithmetic),
    else a 0/1 row mask per adapter."""
    names = {r.adapter for r in part}
    adapters = sorted(a for a in names if a is not None)
    if len(names) == 1:
        return [(name, None) for name in adapters]
    return [(name, adapter_mask(part, name, dtype, device)) for name in adapters]


@dataclass(frozen=True)
class ChunkTail:
    """Tokens a chunk's rows run after their prompts (their columns after the chunk's padded prompts), and
    what they attend to. Each tail token sees its row's prompt (real tokens only) and, causally, the earlier
    tokens of its own run (a choice: its positions restart after the prompt for each choice of a row)."""

    tokens: np.ndarray  # (rows, T) on the host, built into the chunk's ids
    positions: np.ndarray  # (rows, T) each token's rotary position
    # (rows, 1, groups x T, span + T): the tail's queries grouped by KV head (the query heads sharing a KV head
    # become that head's query rows, as in a decode step), an additive mask in the compute dtype (0 or -inf)
    # built once for every layer -- a bool mask was converted, and padded to the memory-efficient kernel's
    # alignment, on every call. A view of a buffer whose rows are `MASK_ALIGN`-aligned.
    mask: torch.Tensor

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])


class Tails(Protocol):
    """A take's tails (choice scoring): one per chunk, and what is done with them after the last layer."""

    @property
    def row_tokens(self) -> Sequence[int]:
        """Each row's tail tokens (a chunk counts its longest among its tokens)."""
        ...

    def for_chunk(self, members: list[int], span: int) -> ChunkTail:
        """The tail of the chunk of rows `members` (indices into the take), their prompts padded to `span` (a
        shared prefix's tokens included: the columns of the keys before the tail's)."""
        ...

    def finish(self, chunks: Sequence[Chunk], finals: Sequence[torch.Tensor]) -> None:
        """After the last layer: a group's chunks and each one's final normed hidden states at its read columns
        (`Chunk.reads`): (rows, 1 + T, hidden), each row's last prompt position, then its tail's tokens."""
        ...


@dataclass(frozen=True)
class Chunk:
    """One prefill chunk: its rows of the batch (a slice, or an index tensor) and where their K/V go."""

    where: slice | torch.Tensor
    ids: torch.Tensor  # (rows, span) right-padded prompt tokens (then the tail's, if any)
    rows: torch.Tensor  # (rows, 1) the batch rows, for the cache writes
    columns: torch.Tensor  # (rows, shared + span) the cache column of each token, a shared prefix's first
    # (rows, 1 + T) the columns read after the last layer: each row's last prompt token (its first-token logits,
    # or its first choice token's), then the tail's T tokens. Only these go through the last layer's output
    # projection and MLP.
    reads: torch.Tensor
    masks: Masks
    # Rows of a slice: `columns` as a (rows, kv_heads, span, head_dim) view, what a scatter along the cache's
    # columns takes (else None: the writes index rows and columns).
    slots: torch.Tensor | None = None
    tail: ChunkTail | None = None
    shared: int = 0  # a shared prefix's tokens before every row's own (`ids` holds only the rows' own)

    @property
    def span(self) -> int:
        """The padded prompts' length (the tail's tokens after it)."""
        return int(self.ids.shape[1]) - (0 if self.tail is None else self.tail.width)


@dataclass(frozen=True)
class Hidden:
    """A chunk's hidden states between two layers: the residual stream and the next layer's normed input."""

    h: torch.Tensor  # (rows, span, hidden)
    x: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.h.nbytes + self.x.nbytes


@dataclass(frozen=True)
class Rotary:
    """A chunk's cos and sin, computed once for all its layers: its rows are right-padded, every one at
    positions shared .. shared + span - 1 (after a shared prefix's, if any), so one row of positions serves them
    all (broadcast) -- unless the chunk has a tail, whose positions follow each row's own prompt."""

    cos: torch.Tensor  # (1, span, head_dim), with a tail (rows, span + T, head_dim)
    sin: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.cos.nbytes + self.sin.nbytes


@dataclass(frozen=True)
class Passes:
    """The chunks of a group by the weights a layer runs them on: `plain` (the dequantised weights, each
    chunk's LoRA -- if any -- masked per row: mixed chunks, base-model chunks, every chunk when merging is off)
    and `merged` (per adapter, its single-adapter chunks, which run with that LoRA merged into the weights)."""

    plain: tuple[int, ...]
    merged: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, masks: Sequence[Masks], *, merge: bool) -> Passes:
        """From each chunk's LoRA masks (`Chunk.masks`), known before its tensors are built."""
        plain: list[int] = []
        merged: dict[str, list[int]] = {}
        for j, m in enumerate(masks):
            adapter = None if is_mixed(m) else only_adapter(m)
            if merge and adapter is not None:
                merged.setdefault(adapter, []).append(j)
            else:
                plain.append(j)
        return cls(plain=tuple(plain), merged={a: tuple(js) for a, js in sorted(merged.items())})

    def weights(self, layer: Layer, masks: Sequence[Masks], dense: Dense) -> Iterator[tuple[int, Dense, Masks]]:
        """(chunk, weights, LoRA masks) for every chunk through `layer`, on its weights `dense` (dequantised
        once): the plain chunks first, then each adapter's chunks on the weights with its LoRA merged -- a copy
        for all but the last adapter, which merges into the dequantised buffers themselves, no longer needed
        plain. An adapter the layer cannot merge (no ready weights, PEFT's float32
        arithmetic kept) runs its chunks plain."""
        adapters = [a for a in self.merged if layer.mergeable(dense, a)]
        plain = sorted(self.plain + tuple(j for a, js in self.merged.items() if a not in adapters for j in js))
        for j in plain:
            yield j, dense, masks[j]
        for n, adapter in enumerate(adapters):
            merged = layer.merge(dense, adapter, in_place=n == len(adapters) - 1)
            for j in self.merged[adapter]:
                yield j, merged, []


@dataclass(frozen=True)
class Built:
    """A chunk made ready for the layers: its tensors, its rotary tables, its hidden states so far."""

    chunk: Chunk
    rotary: Rotary
    hidden: Hidden

    @property
    def held_bytes(self) -> int:
        """What it holds between layers: hidden states, ids and cache columns; with a tail also its mask and
        per-row rotary tables."""
        c = self.chunk
        held = self.hidden.nbytes + c.ids.nbytes + c.columns.nbytes
        if c.tail is not None:
            held += c.tail.mask.untyped_storage().nbytes() + self.rotary.nbytes
        return held


class GroupChunks:
    """A layer-major group's chunks, each built when the first layer reaches it: the GPU starts on a chunk's
    first layer while the host builds the next. Built all before the first layer, a take's first group kept the
    GPU idle for the whole of their host work (numpy, staging, a tail's mask: ~35 ms on the H200's first choice
    take)."""

    def __init__(self, masks: Sequence[Masks], build: Callable[[int], Built]) -> None:
        self.masks = masks
        self._build = build
        self._built: list[Built | None] = [None] * len(masks)
        self.held_bytes = 0  # the chunks' held states together, as built (`Built.held_bytes`)

    def get(self, j: int) -> Built:
        b = self._built[j]
        if b is None:
            b = self._built[j] = self._build(j)
            self.held_bytes += b.held_bytes
        return b

    def advance(self, j: int, hidden: Hidden) -> None:
        """Chunk `j`'s hidden states after another layer."""
        b = self._built[j]
        assert b is not None
        self._built[j] = Built(chunk=b.chunk, rotary=b.rotary, hidden=hidden)

    def all(self) -> list[Built]:
        return [self.get(j) for j in range(len(self.masks))]


class Prefill:
    """Prompts into a static cache; `run` returns each row's first-token logits (in the LM head's dtype)."""

    def __init__(
        self,
        model: Any,
        stack: Stack,
        *,
        tokens: int = 4096,
        group_tokens: int = DEFAULT_GROUP_TOKENS,
        merge_lora: bool = True,
    ) -> None:
        self.model = model  # what the fallback calls (the PEFT wrapper, so adapters apply)
        self.stack = stack
        self.tokens = tokens  # about this many prompt tokens per chunk: what the planner sets aside for
        self._max_tokens: int | None = None  # see `max_tokens`
        # Set by the engine on a GPU: the chunk size the memory left under the budget holds at the time the
        # take's prefill starts (its KV, logits and everything resident already allocated). None: `tokens`.
        self.room: Room | None = None
        # At most this many padded prompt tokens (a single larger chunk: its own) go through the layers together.
        self.group_tokens = group_tokens
        # Prefill a single-adapter chunk with its (fused) LoRA merged into the dequantised weights.
        self.merge_lora = merge_lora
        self.own = True  # False: prefill through the model's forward (after a failure, or to compare)
        # The most one group of the last take held between layers (its chunks' hidden states, ids and cache
        # columns; with tails their masks and per-row rotary tables), measured from the tensors: what the
        # planner's held term must cover.
        self.held_bytes = 0
        self.last_tokens = tokens  # the chunk size the last take's own prefill ran
        # The elementwise steps a chunk's layers run: the stack's prefill set (on a GPU our rotary, SiLU x up and
        # residual add with its RMSNorm).
        self.ops: Ops = stack.prefill_ops
        # The prompt prefixes a take's rows all share, run once (worker/fastpath/prefix.py); `min_tokens` 0: off.
        self.prefixes = PrefixCache()

    def run(
        self,
        kv: KV,
        rows: Sequence[PromptRow],
        *,
        width: int,
        out_rows: int,
        pad_id: int,
        select: AdapterSelect,
    ) -> torch.Tensor:
        """The prompts' K/V into `kv` (each row's prompt ending in column `width - 1`); returns the first tokens'
        logits (out_rows, vocab) in the LM head's dtype, as the head made them (rows past `len(rows)` stay zero):
        the token choice converts them to float32 a chunk of rows at a time, as it does the decode steps' (a
        float32 copy of a 256-row take's logits is ~155 MiB at Qwen's vocabulary)."""
        stack = self.stack
        head = stack.head.weight.dtype  # the LM head's own dtype: an untied float32 head keeps its precision
        logits = torch.zeros(out_rows, stack.head.out_features, dtype=head, device=stack.device)
        if self.own:
            try:
                with prefill_attention(stack.device):
                    self.own_layers(kv, rows, width, pad_id, logits, self.chunk_tokens())
                return logits
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                log.exception("fast path: the loop's own prefill failed; using the model's forward from now on")
                self.own = False
        chunk = max(1, self.tokens // max(1, width))
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            ids, mask = left_pad([r.ids for r in part], pad_id, stack.device, width)  # the whole batch's width
            where = slice(start, start + len(part))
            logits[where] = self.through_model(kv, where, part, ids, mask, select)
        return logits

    @property
    def max_tokens(self) -> int:
        """The most prompt tokens a chunk holds where `room` allows: set, or `MAX_CHUNK_TOKENS` (never below
        `tokens`, whatever `tokens` is set to later)."""
        return max(self.tokens, MAX_CHUNK_TOKENS if self._max_tokens is None else self._max_tokens)

    @max_tokens.setter
    def max_tokens(self, tokens: int | None) -> None:
        self._max_tokens = tokens

    def chunk_tokens(self) -> int:
        """A chunk's prompt tokens for the take about to run: `tokens`, or more (up to `max_tokens`) where the
        memory free now holds larger chunks beside a full group's held states (`room`; a group smaller than a
        chunk holds that chunk alone)."""
        if self.room is None or self.max_tokens <= self.tokens:
            return self.tokens
        allowed = self.room(max(self.group_tokens, self.max_tokens))
        return self.tokens if allowed is None else max(self.tokens, min(self.max_tokens, allowed))

    @torch.inference_mode()
    def warm_row_counts(self) -> int:
        """A layer's four matmuls once at every row count prefill runs them at on a GPU (`gemm.row_counts`, up to
        `max_tokens`: the steps below the block and its multiples), and the LM head at those up to
        `HEAD_WARM_ROWS` (first-token logits a chunk, scoring's slices), on zeros: cuBLAS's first call at a new
        count cost ~1-2.5 ms on the H200 (`bench shapes`), paid here at start instead of by a fresh worker's first
        takes. Single-adapter chunks run on merged weights of the same shapes; a mixed chunk's LoRA matmuls, and a
        single prompt longer than a chunk, are left to their first take. Returns the counts warmed."""
        s = self.stack
        counts = gemm.row_counts(self.max_tokens, s.device)
        if not counts:
            return 0  # off a GPU: nothing to dequantise a layer for
        # Outside `row_blocks`: each count is one of its own there, so these run whole at it, as prefill will.
        layer = s.layers[0]
        dense = layer.dense()
        hidden, inner = s.embed.weight.shape[1], s.heads * s.head_dim
        for rows in counts:
            x = torch.zeros(1, rows, hidden, dtype=s.dtype, device=s.device)
            layer.qkv(x, [], dense[0])
            layer.o(x.new_zeros(1, rows, inner), [], dense[1])
            (gate, _), _ = layer.gate_up(x, [], dense[2])
            layer.down(gate.contiguous(), [], dense[3])  # the MLP's inner width, laid out as its activations
            if rows <= HEAD_WARM_ROWS:
                s.logits(x[0])
        return len(counts)

    def chunk_rows(
        self,
        rows: Sequence[PromptRow],
        tokens: int | None = None,
        tails: Sequence[int] | None = None,
        shared: int = 0,
    ) -> list[list[int]]:
        """Rows grouped by prompt length into chunks of about `tokens` tokens (default: `self.tokens`; each chunk
        its rows' indices, the longest last), each to be right-padded only to its own longest prompt: causal
        attention then needs no mask (a real token never sees the padding after it), so SDPA runs its flash
        kernel with grouped-query heads as they are. `tails`: each row's tail tokens (`ChunkTail`), padded to
        the chunk's longest and counted in its tokens too (a chunk of short prompts with long tails stays within
        the activations planned for a chunk). `shared`: a shared prefix's tokens before each row's own, whose K/V
        each layer step copies before every row's (`_layer`): a chunk's rows times them stay within its tokens
        too (a K/V copy a token is ~1/90 of a token's planned transients for a Qwen2.5-1.5B shape)."""
        limit = self.tokens if tokens is None else tokens
        lengths = [len(r.ids) for r in rows]
        extra = tails or [0] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: lengths[i])
        chunks: list[list[int]] = [[]]
        tail = 0  # the current chunk's longest tail
        for i in order:  # ascending: the newcomer is the longest prompt of its chunk
            rows_then = len(chunks[-1]) + 1
            if chunks[-1] and (rows_then * (lengths[i] + max(tail, extra[i])) > limit or rows_then * shared > limit):
                chunks.append([])
                tail = 0
            chunks[-1].append(i)
            tail = max(tail, extra[i])
        return chunks

    def layer_groups(
        self,
        rows: Sequence[PromptRow],
        tokens: int | None = None,
        tails: Sequence[int] | None = None,
        shared: int = 0,
    ) -> list[list[list[int]]]:
        """The chunks (`chunk_rows`) in groups of consecutive ones holding at most `group_tokens` padded tokens
        together, tails included (a chunk larger than that alone): each group goes through the layers before
        the next."""
        extra = tails or [0] * len(rows)
        groups: list[list[list[int]]] = [[]]
        held = 0
        for chunk in self.chunk_rows(rows, tokens, tails, shared):
            padded = len(chunk) * (len(rows[chunk[-1]].ids) + max(extra[i] for i in chunk))
            if groups[-1] and held + padded > self.group_tokens:
                groups.append([])
                held = 0
            groups[-1].append(chunk)
            held += padded
        return groups

    def chunks(self, rows: Sequence[PromptRow], width: int, pad_id: int) -> list[Chunk]:
        """Every chunk's tensors at once (`chunk_rows`), across all groups."""
        prompts = Prompts.of([r.ids for r in rows])
        return [self._chunk(prompts, [rows[i] for i in c], c, width, pad_id) for c in self.chunk_rows(rows)]

    def _chunk(
        self,
        prompts: Prompts,
        part: Sequence[PromptRow],
        members: list[int],
        width: int,
        pad_id: int,
        tails: Tails | None = None,
        masks: Masks | None = None,
        shared: int = 0,
    ) -> Chunk:
        """One chunk's tensors, each built for all its rows at once (its tail's tokens after its prompts);
        `masks`: its rows' LoRA masks where already made (`row_masks`); `shared`: the tokens of a shared prefix
        before every row's own (`prompts`: the rows' own), whose K/V the chunk's attention and cache writes put
        before its own."""
        s = self.stack
        device = s.device
        index = np.asarray(members, dtype=np.int64)
        lengths = prompts.lengths[index, None]
        steps = np.arange(int(lengths.max()))
        real = steps < lengths  # right-padded: a row's tokens first
        # Where each token's K/V goes (the shared prefix's first): a row's real tokens right-aligned at the batch
        # width (where its decode mask expects them), its padding into its own masked columns on the left
        # (distinct slots, never read).
        full, every = lengths + shared, np.arange(shared + len(steps))
        columns = host_to_device(np.where(every < full, width - full + every, every - full), device)
        contiguous = members == list(range(members[0], members[0] + len(members)))
        rows = host_to_device(index[:, None], device)
        slots = None
        if contiguous:
            slots = columns[:, None, :, None].expand(len(members), s.kv_heads, columns.shape[1], s.head_dim)
        ids = prompts.padded(index, real, pad_id)
        tail = None if tails is None else tails.for_chunk(members, shared + len(steps))
        reads = lengths - 1
        if tail is not None:
            ids = np.concatenate((ids, tail.tokens), axis=1)
            after = np.broadcast_to(len(steps) + np.arange(tail.width), (len(members), tail.width))
            reads = np.concatenate((reads, after), axis=1)
        return Chunk(
            where=slice(members[0], members[0] + len(members)) if contiguous else rows[:, 0],
            ids=host_to_device(ids, device),
            rows=rows,
            columns=columns,
            reads=host_to_device(reads, device),
            masks=row_masks(part, s.dtype, device) if masks is None else masks,
            slots=slots,
            tail=tail,
            shared=shared,
        )

    def own_layers(
        self,
        kv: KV | None,
        rows: Sequence[PromptRow],
        width: int,
        pad_id: int,
        logits: torch.Tensor | None,
        tokens: int | None = None,
        *,
        tails: Tails | None = None,
    ) -> None:
        """Every chunk (of about `tokens` prompt tokens; default `self.tokens`) through the decoder layers as HF
        computes them (same modules, same LoRA arithmetic as PEFT), without PEFT's per-module Python or a dynamic
        cache to copy from: K/V go straight into the static cache `kv` (None: nowhere). Group by group
        (`layer_groups`), each group layer by layer, so each layer's 4-bit weights are dequantised once per
        group and only one group's hidden states are held. Each row's first-token logits go into `logits`;
        with `tails`, each chunk carries its rows' tail (`Tails.row_tokens` tokens a row), and `tails` finishes
        each group instead."""
        layers = len(self.stack.layers)
        prefix = self.prefixes.for_rows(rows, layers)
        runs = suffixes(rows, prefix)  # what each row runs itself: its tokens after the shared prefix
        prompts = Prompts.of([r.ids for r in runs])
        self.held_bytes = 0
        self.last_tokens = self.tokens if tokens is None else tokens
        with gemm.row_blocks():
            shared = 0 if prefix is None else prefix.length
            for group in self.layer_groups(runs, tokens, None if tails is None else tails.row_tokens, shared):
                self._group(kv, prompts, runs, group, width, pad_id, logits, tails, prefix)
        if prefix is not None:
            self.prefixes.keep(prefix, layers)

    def _group(
        self,
        kv: KV | None,
        prompts: Prompts,
        rows: Sequence[PromptRow],
        group: list[list[int]],
        width: int,
        pad_id: int,
        logits: torch.Tensor | None,
        tails: Tails | None,
        prefix: SharedPrefix | None = None,
    ) -> None:
        """One group's chunks through every layer, then their first-token logits (or their tails finished). A
        function of its own so the group's chunk tensors and hidden states are let go on return, before the next
        group's are made. `rows`: the rows' own tokens after `prefix` (if any)."""
        s = self.stack
        parts = [[rows[i] for i in c] for c in group]
        masks = [row_masks(part, s.dtype, s.device) for part in parts]
        shared = 0 if prefix is None else prefix.length

        def build(j: int) -> Built:
            c = self._chunk(prompts, parts[j], group[j], width, pad_id, tails, masks[j], shared)
            return Built(chunk=c, rotary=self._rotary(c), hidden=self._embedded(c.ids))

        chunks = GroupChunks(masks, build)
        passes = Passes.of(masks, merge=self.merge_lora)
        caches: Sequence[tuple[torch.Tensor, torch.Tensor] | None] = kv if kv is not None else [None] * len(s.layers)
        try:
            for i, (layer, cache) in enumerate(zip(s.layers, caches, strict=True)):
                self._through(i, layer, cache, chunks, passes, prefix)
        finally:  # what the group held as far as it got, even where a layer failed
            self.held_bytes = max(self.held_bytes, chunks.held_bytes)
        built = chunks.all()
        if tails is not None:
            tails.finish([b.chunk for b in built], [b.hidden.x for b in built])
            return
        assert logits is not None
        for b in built:
            # The last layer kept only the read columns, the last prompt's first.
            logits[b.chunk.where] = s.logits(b.hidden.x[:, 0])

    def _embedded(self, ids: torch.Tensor) -> Hidden:
        s = self.stack
        h = s.embed(ids)
        return Hidden(h=h, x=s.ops.norm(s.layers[0].norm1, h))

    def _rotary(self, c: Chunk) -> Rotary:
        """A chunk's cos and sin: one row of positions shared .. shared + span - 1 for every row (after a shared
        prefix's, if any), or with a tail each row's own (its prompt's, then its tail's)."""
        s = self.stack
        like = torch.empty(0, dtype=s.dtype, device=s.device)  # what the rotary module reads: dtype and device
        own = range(c.shared, c.shared + c.span)  # the rows' own tokens' positions, after a shared prefix
        if c.tail is None:
            positions = torch.arange(own.start, own.stop, device=s.device)[None]
        else:
            rows = c.tail.positions.shape[0]
            prompt = np.broadcast_to(np.arange(own.start, own.stop, dtype=np.int64), (rows, c.span))
            positions = host_to_device(np.concatenate((prompt, c.tail.positions), axis=1), s.device)
        cos, sin = s.rotary(like, positions)
        return Rotary(cos=cos, sin=sin)

    def _through(
        self,
        i: int,
        layer: Layer,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        chunks: GroupChunks,
        passes: Passes,
        prefix: SharedPrefix | None = None,
    ) -> None:
        """Every chunk through layer `i`, its hidden states replaced by the layer's output (after the last layer:
        only at the columns read, `Chunk.reads`); the first layer builds each chunk as it reaches it. A function
        of its own so the layer's dequantised weights are let go on return, before the next layer's are made (a
        loop variable would keep them alive meanwhile: a layer's worth of weights more than the planner counts)."""
        dense = layer.dense()
        final = i == len(self.stack.layers) - 1
        for j, weights, masks in passes.weights(layer, chunks.masks, dense):
            if prefix is not None and len(prefix.kv) == i:  # being made: on the weights every chunk runs on
                self._prefix_layer(i, layer, prefix, weights, masks, final=final)
            b = chunks.get(j)
            shared = None if prefix is None else prefix.kv[i]
            hidden = self._layer(
                i, layer, cache, b.chunk, b.hidden, weights, masks, b.rotary, final=final, shared=shared
            )
            chunks.advance(j, hidden)
            del b, hidden  # the chunk's states before this layer, let go before the next chunk is built

    def _layer(
        self,
        i: int,
        layer: Layer,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        c: Chunk,
        held: Hidden,
        weights: Dense,
        masks: Masks,
        rotary: Rotary,
        *,
        final: bool = False,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Hidden:
        """One chunk through layer `i`: its K/V into the cache (if any), attention, the rest of the layer. In the
        `final` layer every position's K/V and attention are made as in any layer (the cache and the tail's
        queries need them), but the output projection, the MLP and the norms run only at the columns read after
        it (`Chunk.reads`: ~1 in 200 of a nightly row's positions), what the returned states hold. The rest would
        be states nobody reads: for a Qwen2.5-1.5B shape the output projection and MLP are 93% of a layer's
        weights, so ~3% of a prefill's matmul work (one layer in 28). `shared`: a shared prefix's keys and values
        in this layer, read before the chunk's own (and written into the cache with them)."""
        s = self.stack
        count, length = c.ids.shape
        span = c.span
        q, k, v = s.qkv(layer, held.x, masks, rotary.cos, rotary.sin, weights, ops=self.ops)
        if shared is not None:
            k = torch.cat((shared[0].expand(count, -1, -1, -1), k), dim=2)
            v = torch.cat((shared[1].expand(count, -1, -1, -1), v), dim=2)
        if cache is not None:
            k_cache, v_cache = cache
            keys = c.shared + span
            k_prompt, v_prompt = (k, v) if c.tail is None else (k[:, :, :keys], v[:, :, :keys])
            if c.slots is not None:
                # One scatter along the cache's columns: advanced indexing (below) spent ~4x its host time.
                k_cache[c.where].scatter_(2, c.slots, k_prompt)
                v_cache[c.where].scatter_(2, c.slots, v_prompt)
            else:
                # (rows, kv_heads, span, D) -> the cache's (rows, span) slots: advanced indices put those first.
                k_cache[c.rows, :, c.columns] = k_prompt.transpose(1, 2)
                v_cache[c.rows, :, c.columns] = v_prompt.transpose(1, 2)
        if c.tail is None:
            out = causal_attention(q, k, v, scale=layer.scaling)
            # Each intermediate let go as soon as it is read: the MLP's peak (gate/up and their product) is what
            # the planner sets aside per chunk, without the attention's queries and output beside it.
            del q, k, v
            attn = out.transpose(1, 2).reshape(count, length, s.heads * s.head_dim)
            del out
        else:
            attn = self._with_tail(c.tail, q, k, v, span, layer.scaling)
            del q, k, v
        h = held.h
        if final:
            attn, h = read_columns(attn, c.reads), read_columns(h, c.reads)
        h, x = s.attn_out(layer, h, attn, masks, weights, ops=self.ops)
        del attn
        h, x = s.mlp(layer, h, x, masks, s.next_norm(i), weights, ops=self.ops)
        return Hidden(h=h, x=x)

    def _prefix_layer(
        self, i: int, layer: Layer, prefix: SharedPrefix, weights: Dense, masks: Masks, *, final: bool
    ) -> None:
        """The shared prefix through layer `i` as a one-row chunk of its own: its keys and values kept, its
        states carried to the next layer (in the last layer only its K/V are needed)."""
        s = self.stack
        n = prefix.length
        if prefix.hidden is None:
            embedded = self._embedded(host_to_device(np.asarray(prefix.ids, dtype=np.int64)[None], s.device))
            prefix.hidden = (embedded.h, embedded.x)
        h, x = prefix.hidden
        like = torch.empty(0, dtype=s.dtype, device=s.device)
        cos, sin = s.rotary(like, torch.arange(n, device=s.device)[None])
        q, k, v = s.qkv(layer, x, masks, cos, sin, weights, ops=self.ops)
        # Copies of their own: `k` and `v` are views of the rotary output and the joint q/k/v matmul output
        # (queries included, rows padded), which kept views would hold whole.
        prefix.kv.append(
            (k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format))
        )
        if final:
            prefix.hidden = None
            return
        out = causal_attention(q, k, v, scale=layer.scaling)
        attn = out.transpose(1, 2).reshape(1, n, s.heads * s.head_dim)
        prefix.hidden = s.rest(layer, h, attn, masks, s.next_norm(i), weights, ops=self.ops)

    def _with_tail(
        self, tail: ChunkTail, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: int, scale: float
    ) -> torch.Tensor:
        """Attention of a chunk with a tail, as (rows, span + T, heads x D): the prompts' queries causal over the
        prompts (flash), the tail's queries -- grouped by KV head, as the mask is -- over prompts and tail under
        the tail's mask. Keys and values may hold a shared prefix's before the chunk's own (the causal mask then
        aligned to their end). The causal pass runs over all span + T positions: a prompt query never sees a key after
        it (the tail's keys stay unseen), and its output, laid out as the layer's, needs no copy into place
        (copying the prompts' part was ~2.5% of a scoring prefill's GPU time on the H200); the tail's rows of it
        are overwritten."""
        s = self.stack
        rows, width = q.shape[0], tail.width
        mask = tail.mask if tail.mask.dtype == q.dtype else tail.mask.to(q.dtype)  # SDPA takes the queries' dtype
        causal = causal_attention(q, k, v, scale=scale)
        attn = causal.transpose(1, 2).reshape(rows, span + width, s.heads * s.head_dim)
        del causal
        grouped = q[:, :, span:].reshape(rows, s.kv_heads, s.groups * width, s.head_dim)
        out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
        shaped = out.view(rows, s.kv_heads, s.groups, width, s.head_dim).permute(0, 3, 1, 2, 4)
        attn[:, span:].view(rows, width, s.kv_heads, s.groups, s.head_dim).copy_(shaped)
        return attn

    def through_model(
        self,
        kv: KV,
        where: slice,
        part: Sequence[PromptRow],
        ids: torch.Tensor,
        mask: torch.Tensor,
        select: AdapterSelect,
    ) -> torch.Tensor:
        """One chunk through the model's own forward (PEFT selects the adapters); its cache copied over."""
        with select([r.adapter for r in part]) as kwargs:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions_of(mask),
                use_cache=True,
                logits_to_keep=1,
                **kwargs,
            )
        width = ids.shape[1]
        for (k_cache, v_cache), (keys, values) in zip(kv, cache_layers(out), strict=True):
            k_cache[where, :, :width].copy_(keys)
            v_cache[where, :, :width].copy_(values)
        return out.logits[:, -1]


def read_columns(states: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """(rows, K, features) of (rows, positions, features) `states`: each row's `columns` (rows, K), in one gather,
    into rows holding room for their padded count (`gemm.empty_rows`: the matmuls after it run as one)."""
    rows, count = columns.shape
    out = gemm.empty_rows(rows, count, states.shape[-1], dtype=states.dtype, device=states.device)
    return torch.gather(states, 1, columns[..., None].expand(-1, -1, states.shape[-1]), out=out)


def cache_layers(out: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a forward pass's cache, across transformers 4.5x-5.x names."""
    cache = getattr(out, "cache", None) or out.past_key_values
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            yield layer.keys, layer.values
    else:
        yield from zip(cache.key_cache, cache.value_cache, strict=True)
