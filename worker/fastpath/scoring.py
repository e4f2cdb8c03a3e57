"""Choice scoring on the fast path: each prompt encoded once, its choices run beside it through the layers.

HF's way -- one padded forward pass over prompt + choice for every (row, choice) pair -- encodes each prompt
once per choice and builds a padding mask, so attention falls back to the math kernel with a full score matrix.
Here the loop's own prefill runs the prompts, and each prefill chunk carries its rows' choices as its tail
(`prefill.ChunkTail`): every choice token of a row, side by side after the chunk's padded prompts, in the same
layer steps and on the same dequantised (and merged) weights,

1. attends to its row's prompt (real tokens only) and to the earlier tokens of its own choice (a block-diagonal
   causal mask; the positions restart after the prompt for each choice), the prompts' own queries running
   causal flash attention as in any prefill chunk;
2. after the last layer, a choice's log-likelihood is the sum of its tokens' log-probabilities (its
   end-of-answer token included): the first from the prompt's last position, the rest from the choice's own,
   the LM head run only where a next token is scored, a slice of positions at a time.

Nothing is cached: the prompt's K/V are read in the layer step that made them, so a take of scored rows needs
no KV pool (its memory is one prefill chunk's and one group's held states, whatever its rows), leaves the
decode loop's pool and graphs as they are, and dequantises each layer's weights once for prompts and choices.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.fastpath.ops import prefill_attention
from worker.fastpath.pointwise import cdiv
from worker.fastpath.prefill import Chunk, ChunkTail, Prefill, host_to_device
from worker.fastpath.sampling import CHOICE_CHUNK_ROWS
from worker.fastpath.weights import Stack
from worker.memory import MASK_ALIGN

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


def tail_layout(rows: Sequence[ScoreRow], members: Sequence[int], span: int) -> TailLayout:
    """The layout of a chunk's rows (`rows`, row `r` the take's row `members[r]`), their prompts right-padded
    to `span` (each row's real tokens first), their choices padded to their most."""
    n = len(rows)
    width = max(row.choice_tokens for row in rows)
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


@dataclass(frozen=True)
class ScoredTail(ChunkTail):
    """A chunk's choices as its tail, and where its scored tokens are."""

    layout: TailLayout
    later: torch.Tensor  # (2, scored later tokens): each one's row in the chunk, and its column in the final states


def additive_mask(seen: np.ndarray, groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A chunk's (rows, T, keys) bool mask as the tail's attention reads it (`ChunkTail.mask`): repeated for each
    query head of a KV head, 0 where seen and -inf elsewhere, in a buffer whose rows are `MASK_ALIGN`-aligned."""
    rows, width, keys = seen.shape
    aligned = cdiv(keys, MASK_ALIGN) * MASK_ALIGN
    buffer = torch.full((rows, 1, groups * width, aligned), -math.inf, dtype=dtype, device=device)
    mask = buffer[..., :keys]
    mask.view(rows, groups, width, keys).masked_fill_(host_to_device(seen, device)[:, None], 0.0)
    return mask


class ChoiceTails:
    """A take's choices as its prefill chunks' tails (`prefill.Tails`): each chunk's layout, then after a group's
    last layer its picked log-probabilities."""

    def __init__(self, stack: Stack, rows: Sequence[ScoreRow], picks: Picks) -> None:
        self.stack = stack
        self.rows = rows
        self.picks = picks
        self.row_tokens = [row.choice_tokens for row in rows]

    def for_chunk(self, members: list[int], span: int) -> ScoredTail:
        s = self.stack
        layout = tail_layout([self.rows[i] for i in members], members, span)
        # Columns of the final states, which hold the prompt's last position first, then the tail (`Chunk.reads`).
        later = np.stack((np.asarray(layout.rows, dtype=np.int64), 1 + np.asarray(layout.columns, dtype=np.int64)))
        return ScoredTail(
            tokens=layout.tokens,
            positions=layout.positions,
            mask=additive_mask(layout.mask, s.groups, s.dtype, s.device),
            layout=layout,
            later=host_to_device(later, s.device),
        )

    def finish(self, chunks: Sequence[Chunk], finals: Sequence[torch.Tensor]) -> None:
        """Each choice's first token's log-probability from its prompt's last position (float32 log-softmax,
        `CHOICE_CHUNK_ROWS` rows at a time, as the greedy choice converts them), the later tokens' from their
        choice's own positions (`LOGIT_ROWS` at a time): never a float32 copy of a whole group's logits."""
        s = self.stack
        lasts: list[torch.Tensor] = []
        later: list[torch.Tensor] = []
        head_rows: list[int] = []
        heads: list[int] = []
        head_owners: list[Owner] = []
        targets: list[int] = []
        owners: list[Owner] = []
        offset = 0  # the chunk's first row among the group's
        for c, x in zip(chunks, finals, strict=True):
            tail = c.tail
            assert isinstance(tail, ScoredTail)
            layout = tail.layout
            lasts.append(x[:, 0])
            head_rows.extend(r + offset for r in layout.head_rows)
            heads.extend(layout.heads)
            head_owners.extend(layout.head_owners)
            if layout.owners:
                later.append(x[tail.later[0], tail.later[1]])
                targets.extend(layout.targets)
                owners.extend(layout.owners)
            offset += x.shape[0]
        last = torch.cat(lasts)
        rows = np.asarray(head_rows, dtype=np.int64)  # ascending
        on_device = host_to_device(np.stack((rows, np.asarray(heads, dtype=np.int64))), s.device)
        for start in range(0, last.shape[0], CHOICE_CHUNK_ROWS):
            logp = s.logits(last[start : start + CHOICE_CHUNK_ROWS]).float().log_softmax(dim=-1)
            lo, hi = np.searchsorted(rows, (start, start + CHOICE_CHUNK_ROWS))
            which = slice(int(lo), int(hi))
            self.picks.add(logp[on_device[0, which] - start, on_device[1, which]], head_owners[which])
        if not owners:
            return
        states = torch.cat(later)
        wanted = host_to_device(np.asarray(targets, dtype=np.int64), s.device)
        for start in range(0, len(owners), LOGIT_ROWS):
            which = slice(start, start + LOGIT_ROWS)
            logp = s.logits(states[which]).float().log_softmax(dim=-1)
            self.picks.add(logp.gather(1, wanted[which, None])[:, 0], owners[which])


def score_in_prefill(prefill: Prefill, rows: Sequence[ScoreRow], *, pad_id: int) -> Scored | None:
    """Each row's choices scored by log-likelihood after its prompt, inside the loop's own prefill (see the
    module's text). None where the loop's own prefill is off (it failed on this device once, or now): HF's
    forward passes score the rows instead."""
    if not prefill.own:
        return None
    picks = Picks()
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
                tails=ChoiceTails(prefill.stack, rows, picks),
            )
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        log.exception("fast path: the loop's own prefill failed scoring choices; HF forward passes from now on")
        prefill.own = False
        return None
    return picks.scored(rows)
