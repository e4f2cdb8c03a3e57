"""Choice scoring on the fast path: each prompt encoded once, its choices run through the layers beside it.

HF's way -- one padded forward pass over prompt + choice for every (row, choice) pair -- encodes each prompt
once per choice and builds a padding mask, so attention falls back to the math kernel with a full score matrix.
Here the loop's own prefill runs the prompts, and each layer-major group of prefill chunks carries its rows'
choices as a tail (`prefill.Tail`): in every layer, on the weights that layer dequantised (and merged) for them,

1. the group's chunks run their prompts as in any prefill (causal, flash attention, grouped KV heads as they are);
2. then every choice's tokens of the group's rows, side by side, attend to their row's prompt K/V just made (one
   attention call a chunk: its prompts' span) and to the earlier tokens of their own choice only (a
   block-diagonal causal mask; the positions restart after the prompt for each choice), the rest of the layer
   once for the whole group (a chunk's tail alone paid the ~13 launches of a layer step for a few tokens a row);
3. after the last layer, a choice's log-likelihood is the sum of its tokens' log-probabilities (its
   end-of-answer token included): the first from the prompt's last position, the rest from the choice's own,
   the LM head run only where a next token is scored, a slice of positions at a time.

Nothing is cached: the prompt's K/V are read in the layer that made them, so a take of scored rows needs no KV
pool (its memory is one prefill chunk's and one group's held states, whatever its rows), leaves the decode
loop's pool and graphs as they are, and dequantises each layer's weights once for prompts and choices alike.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from worker.fastpath.ops import Ops, prefill_attention
from worker.fastpath.prefill import Hidden, Prefill, PromptKV, host_to_device, row_masks
from worker.fastpath.sampling import CHOICE_CHUNK_ROWS
from worker.fastpath.weights import Dense, Layer, Masks, Stack

log = logging.getLogger("kevlaya.fastpath")

# Positions per LM-head slice: (slice, vocab) logits, their float32 copy and log-softmax at a time (~185 MiB at
# Qwen's vocabulary). They run after a group's layers, in the memory the planner sets aside for a prefill chunk.
LOGIT_ROWS = 128


@dataclass(frozen=True)
class ScoreRow:
    ids: list[int]  # the prompt
    choices: tuple[tuple[int, ...], ...]  # each choice's tokens (end-of-answer included), none empty
    adapter: str | None

    @property
    def choice_tokens(self) -> int:
        return sum(len(c) for c in self.choices)


@dataclass(frozen=True)
class Scored:
    loglik: list[tuple[float, ...]]  # per row, each choice's log-likelihood (float64 sums)
    bad: list[bool]  # per row: a non-finite log-probability among its choices' tokens


Owner = tuple[int, int]  # (row of the take, its choice)


@dataclass(frozen=True)
class TailLayout:
    """Where a chunk's choices go, built on the host with numpy for all its rows at once (element by element,
    256 rows of 3 choices were ~5,000 small tensor operations, ~40 ms while the GPU waited)."""

    tokens: np.ndarray  # (rows, T) every choice's tokens side by side (padding after)
    positions: np.ndarray  # (rows, T) the position each token has after its row's prompt
    mask: np.ndarray  # (rows, T, span + T) what each token attends to: its prompt, its own choice's earlier tokens
    heads: list[int]  # each (row, choice)'s first token, rows in order...
    head_rows: list[int]  # ...its row in the chunk...
    head_owners: list[Owner]  # ...and owner
    rows: list[int]  # for each later scored token: its row in the chunk...
    columns: list[int]  # ...the column among the T whose output predicts it...
    targets: list[int]  # ...the token...
    owners: list[Owner]  # ...and its owner


def tail_layout(rows: Sequence[ScoreRow], members: Sequence[int], span: int, width: int | None = None) -> TailLayout:
    """The layout of a chunk's rows (`rows`, row `r` the take's row `members[r]`), their prompts right-padded
    to `span` (each row's real tokens first), their choices padded to `width` (default: their most)."""
    n = len(rows)
    width = width or max(row.choice_tokens for row in rows)
    tokens = np.zeros((n, width), dtype=np.int64)
    positions = np.zeros((n, width), dtype=np.int64)
    choice_of = np.full((n, width), -1, dtype=np.int64)  # which choice of its row a token belongs to (-1: padding)
    prompts = np.array([len(row.ids) for row in rows], dtype=np.int64)
    heads: list[int] = []
    head_rows: list[int] = []
    head_owners: list[Owner] = []
    scored_rows: list[int] = []
    scored_columns: list[int] = []
    targets: list[int] = []
    owners: list[Owner] = []
    for r, row in enumerate(rows):
        tokens[r, : row.choice_tokens] = [t for choice in row.choices for t in choice]
        start = 0
        for c, choice in enumerate(row.choices):
            m = len(choice)
            positions[r, start : start + m] = np.arange(len(row.ids), len(row.ids) + m)
            choice_of[r, start : start + m] = c
            heads.append(choice[0])
            head_rows.append(r)
            head_owners.append((members[r], c))
            # The output at token o scores token o + 1 (token 0: the prompt's last position).
            scored_rows.extend([r] * (m - 1))
            scored_columns.extend(range(start, start + m - 1))
            targets.extend(choice[1:])
            owners.extend([(members[r], c)] * (m - 1))
            start += m
    # Every choice token (and padding token) sees its row's whole prompt, the first columns...
    sees_prompt = np.arange(span)[None, :] < prompts[:, None]  # (n, span)
    # ...and, causally, the earlier tokens of its own choice (its own K/V included); padding sees no choice token.
    own = (choice_of[:, :, None] == choice_of[:, None, :]) & (choice_of[:, :, None] >= 0)
    causal = np.tri(width, dtype=bool)[None]
    mask = np.concatenate((np.broadcast_to(sees_prompt[:, None, :], (n, width, span)), own & causal), axis=-1)
    return TailLayout(
        tokens=tokens,
        positions=positions,
        mask=np.ascontiguousarray(mask),
        heads=heads,
        head_rows=head_rows,
        head_owners=head_owners,
        rows=scored_rows,
        columns=scored_columns,
        targets=targets,
        owners=owners,
    )


@dataclass
class Picks:
    """The log-probabilities picked so far, on the device, each with its owners: read back once, at the end."""

    values: list[torch.Tensor] = field(default_factory=list)
    owners: list[list[Owner]] = field(default_factory=list)

    def add(self, values: torch.Tensor, owners: list[Owner]) -> None:
        if owners:
            self.values.append(values)
            self.owners.append(owners)

    def scored(self, rows: Sequence[ScoreRow]) -> Scored:
        values = torch.cat(self.values).double().cpu().tolist() if self.values else []
        sums = [[0.0] * len(row.choices) for row in rows]
        k = 0
        for owners in self.owners:
            for r, c in owners:
                sums[r][c] += values[k]
                k += 1
        bad = [not all(math.isfinite(v) for v in row_sums) for row_sums in sums]
        return Scored(loglik=[tuple(s) for s in sums], bad=bad)


class ChoiceTail:
    """A layer-major group's choices (`prefill.Tail`): every chunk's layout on the device, its rows one after
    another, run through each layer after the group's chunks."""

    def __init__(
        self, stack: Stack, ops: Ops, rows: Sequence[ScoreRow], chunks: Sequence[TailLayout], picks: Picks
    ) -> None:
        s = self.stack = stack
        self.ops = ops
        self.picks = picks
        device = s.device
        long = lambda values: host_to_device(np.asarray(values, dtype=np.int64), device)  # noqa: E731
        starts = np.cumsum([0] + [len(c.tokens) for c in chunks])
        self.bounds = [(int(a), int(b)) for a, b in itertools.pairwise(starts)]  # each chunk's rows of the tail
        self.tokens = host_to_device(np.concatenate([c.tokens for c in chunks]), device)
        width = self.tokens.shape[1]
        # GQA without expanding K/V: the query heads sharing a KV head become that head's query rows (as in a
        # decode step), each chunk's mask repeated for each of them.
        self.attn_masks = [self._grouped(host_to_device(c.mask, device), width) for c in chunks]
        like = torch.empty(0, dtype=s.dtype, device=device)  # what the rotary module reads: dtype and device
        self.cos, self.sin = s.rotary(like, host_to_device(np.concatenate([c.positions for c in chunks]), device))
        self.masks = row_masks(rows, s.dtype, device)
        # The head tokens and later targets of every chunk, their rows counted across the tail.
        firsts = [a for a, _ in self.bounds]
        self._head_rows = np.asarray([r + a for c, a in zip(chunks, firsts, strict=True) for r in c.head_rows])
        self.head_rows, self.heads = long(self._head_rows), long([t for c in chunks for t in c.heads])  # rows ascend
        self.head_owners = [o for c in chunks for o in c.head_owners]
        self.rows = long([r + a for c, a in zip(chunks, firsts, strict=True) for r in c.rows])
        self.columns = long([x for c in chunks for x in c.columns])
        self.targets = long([t for c in chunks for t in c.targets])
        self.owners = [o for c in chunks for o in c.owners]

    @property
    def nbytes(self) -> int:
        tensors = (self.tokens, self.cos, self.sin, self.head_rows, self.heads, self.rows, self.columns, self.targets)
        return sum(t.nbytes for t in (*tensors, *self.attn_masks))

    def _grouped(self, mask: torch.Tensor, width: int) -> torch.Tensor:
        """A chunk's (rows, T, span + T) mask for its queries grouped by KV head: (rows, 1, groups x T, ...)."""
        rows, groups = mask.shape[0], self.stack.groups
        return mask[:, None].expand(rows, groups, width, mask.shape[-1]).reshape(rows, 1, groups * width, -1)

    def embedded(self) -> Hidden:
        s = self.stack
        h = s.embed(self.tokens)
        return Hidden(h=h, x=self.ops.norm(s.layers[0].norm1, h))

    def layer(self, i: int, layer: Layer, held: Hidden, kv: Sequence[PromptKV], weights: Dense, masks: Masks) -> Hidden:
        s = self.stack
        n, width = self.tokens.shape
        q, k_tail, v_tail = s.qkv(layer, held.x, masks, self.cos, self.sin, weights, ops=self.ops)
        attn = q.new_empty(n, width, s.heads * s.head_dim)
        for (a, b), prompt, mask in zip(self.bounds, kv, self.attn_masks, strict=True):
            keys = torch.cat((prompt.k, k_tail[a:b]), dim=2)  # the chunk's prompts (real tokens first), the choices
            values = torch.cat((prompt.v, v_tail[a:b]), dim=2)
            q_c = q[a:b].reshape(b - a, s.kv_heads, s.groups * width, s.head_dim)
            out = F.scaled_dot_product_attention(q_c, keys, values, attn_mask=mask, scale=layer.scaling)
            attn[a:b] = out.reshape(b - a, s.heads, width, s.head_dim).transpose(1, 2).reshape(b - a, width, -1)
        del q, k_tail, v_tail
        h, x = s.rest(layer, held.h, attn, masks, s.next_norm(i), weights, ops=self.ops)
        return Hidden(h=h, x=x)

    def finish(self, held: Hidden, last: torch.Tensor) -> None:
        """Each choice's first token's log-probability from its prompt's last position (float32 log-softmax,
        `CHOICE_CHUNK_ROWS` rows at a time, as the greedy choice converts them), the later tokens' from their
        choice's own positions (`LOGIT_ROWS` at a time): never a float32 copy of a whole group's logits."""
        s = self.stack
        for start in range(0, last.shape[0], CHOICE_CHUNK_ROWS):
            logp = s.head(last[start : start + CHOICE_CHUNK_ROWS]).float().log_softmax(dim=-1)
            lo, hi = np.searchsorted(self._head_rows, (start, start + CHOICE_CHUNK_ROWS))
            which = slice(int(lo), int(hi))
            self.picks.add(logp[self.head_rows[which] - start, self.heads[which]], self.head_owners[which])
        for start in range(0, len(self.owners), LOGIT_ROWS):
            which = slice(start, start + LOGIT_ROWS)
            logp = s.head(held.x[self.rows[which], self.columns[which]]).float().log_softmax(dim=-1)
            self.picks.add(logp.gather(1, self.targets[which, None])[:, 0], self.owners[which])


def score_in_prefill(prefill: Prefill, rows: Sequence[ScoreRow], *, pad_id: int) -> Scored | None:
    """Each row's choices scored by log-likelihood after its prompt, inside the loop's own prefill (see the
    module's text). None where the loop's own prefill is off (it failed on this device once, or now): HF's
    forward passes score the rows instead."""
    if not prefill.own:
        return None
    picks = Picks()

    def tail_for(chunks: list[list[int]], spans: list[int]) -> ChoiceTail:
        members = [i for chunk in chunks for i in chunk]
        width = max(rows[i].choice_tokens for i in members)
        layouts = [
            tail_layout([rows[i] for i in chunk], chunk, span, width) for chunk, span in zip(chunks, spans, strict=True)
        ]
        return ChoiceTail(prefill.stack, prefill.ops, [rows[i] for i in members], layouts, picks)

    width = max(len(row.ids) for row in rows)
    try:
        # Not cuDNN (a plan for every shape); the choices' masked attention runs the memory-efficient kernel.
        with prefill_attention(prefill.stack.device):
            prefill.own_layers(
                None,
                rows,
                width,
                pad_id,
                None,
                prefill.chunk_tokens(),
                tail_for=tail_for,
                tails=[row.choice_tokens for row in rows],
            )
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        log.exception("fast path: the loop's own prefill failed scoring choices; HF forward passes from now on")
        prefill.own = False
        return None
    return picks.scored(rows)
