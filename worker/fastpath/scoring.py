"""Choice scoring on the fast path: each prompt encoded once, every choice scored against its cached K/V.

HF's way -- one padded forward pass over prompt + choice for every (row, choice) pair -- encodes each prompt
once per choice and builds a padding mask, so attention falls back to the math kernel with a full score matrix
(the memory plan then runs out, and the retry releases the decode graphs). Here:

1. the loop's own chunked prefill writes each row's prompt K/V into the static cache (right-aligned at column
   `width`, as for decoding) and hands back the first choice token's logits;
2. one more pass runs every choice's tokens of a row side by side after the prompt (columns `width` ...), each
   token attending to its row's prompt and to the earlier tokens of its own choice only: a block-diagonal
   causal mask, the positions restarting after the prompt for each choice;
3. a choice's log-likelihood is the sum of its tokens' log-probabilities (its end-of-answer token included),
   the LM head run only where a next token is scored, in slices of `LOGIT_ROWS` positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker.fastpath.graphs import KV
from worker.fastpath.prefill import host_to_device, row_masks, to_device
from worker.fastpath.sampling import CHOICE_CHUNK_ROWS
from worker.fastpath.weights import Masks, Stack

# Positions per LM-head slice: (slice, vocab) logits, their float32 copy and log-softmax at a time (~185 MiB at
# Qwen's vocabulary), within what the planner sets aside for a prefill chunk, which never runs beside them.
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


@dataclass(frozen=True)
class _Layout:
    """Where the choices of a group of rows go: token, position, cache column, own-choice attention, targets."""

    tokens: torch.Tensor  # (rows, T) every choice's tokens side by side (padding after)
    positions: torch.Tensor  # (rows, T) the position each token has after its row's prompt
    mask: torch.Tensor  # (rows, 1, T, width + T) what each token attends to
    rows: torch.Tensor  # (P,) for each scored position: its row in the group...
    columns: torch.Tensor  # (P,) ...and its column among the T, whose output predicts...
    targets: torch.Tensor  # (P,) ...this token
    owners: list[tuple[int, int]]  # (row in the group, choice) of each scored position
    masks: Masks  # the rows' LoRA selection (`row_masks`)


@dataclass(frozen=True)
class HostLayout:
    """`_Layout` on the host, built with numpy a part at a time (not element by element: 256 rows of 3 choices
    were ~5,000 small tensor operations on the host, ~40 ms while the GPU waited)."""

    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray  # (rows, T, width + T)
    rows: list[int]
    columns: list[int]
    targets: list[int]
    owners: list[tuple[int, int]]

    def on(self, part: Sequence[ScoreRow], dtype: torch.dtype, device: torch.device) -> _Layout:
        """On the device, with the rows' LoRA selection: only for the part about to run (every part's mask at
        once would be rows x T x (width + T) more than the plan counts)."""
        long = lambda values: host_to_device(np.asarray(values, dtype=np.int64), device)  # noqa: E731
        return _Layout(
            tokens=host_to_device(self.tokens, device),
            positions=host_to_device(self.positions, device),
            mask=host_to_device(self.mask[:, None], device),
            rows=long(self.rows),
            columns=long(self.columns),
            targets=long(self.targets),
            owners=self.owners,
            masks=row_masks(part, dtype, device),
        )


def layout(rows: Sequence[ScoreRow], width: int, span: int) -> HostLayout:
    n = len(rows)
    tokens = np.zeros((n, span), dtype=np.int64)
    positions = np.zeros((n, span), dtype=np.int64)
    choice_of = np.full((n, span), -1, dtype=np.int64)  # which choice of its row a token belongs to (-1: padding)
    prompts = np.array([len(row.ids) for row in rows], dtype=np.int64)
    scored_rows: list[int] = []
    scored_columns: list[int] = []
    targets: list[int] = []
    owners: list[tuple[int, int]] = []
    for r, row in enumerate(rows):
        flat = [t for choice in row.choices for t in choice]
        tokens[r, : len(flat)] = flat
        start = 0
        for c, choice in enumerate(row.choices):
            m = len(choice)
            positions[r, start : start + m] = np.arange(len(row.ids), len(row.ids) + m)
            choice_of[r, start : start + m] = c
            # The output at token o scores token o + 1 (token 0: the prefill's logits).
            scored_rows.extend([r] * (m - 1))
            scored_columns.extend(range(start, start + m - 1))
            targets.extend(choice[1:])
            owners.extend([(r, c)] * (m - 1))
            start += m
    # Every choice token (and padding token) sees the row's whole prompt, right-aligned at `width`...
    sees_prompt = np.arange(width)[None, :] >= (width - prompts)[:, None]  # (n, width)
    # ...and, causally, the earlier tokens of its own choice (its own K/V included); padding sees no choice token.
    own = (choice_of[:, :, None] == choice_of[:, None, :]) & (choice_of[:, :, None] >= 0)
    causal = np.tri(span, dtype=bool)[None]
    mask = np.concatenate((np.broadcast_to(sees_prompt[:, None, :], (n, span, width)), own & causal), axis=-1)
    return HostLayout(
        tokens=tokens,
        positions=positions,
        mask=np.ascontiguousarray(mask),
        rows=scored_rows,
        columns=scored_columns,
        targets=targets,
        owners=owners,
    )


def first_token_logprobs(first_logits: torch.Tensor, rows: Sequence[ScoreRow]) -> torch.Tensor:
    """Each choice's first token's log-probability after its row's prompt, in the rows' choice order (float32,
    on the device): the logits' log-softmax in float32, `CHOICE_CHUNK_ROWS` rows at a time (as the greedy choice
    converts them), so a take of hundreds of rows never holds a float32 copy of all its logits. Row-wise, so no
    number changes."""
    device = first_logits.device
    parts: list[torch.Tensor] = []
    for start in range(0, len(rows), CHOICE_CHUNK_ROWS):
        part = rows[start : start + CHOICE_CHUNK_ROWS]
        logp = first_logits[start : start + len(part)].float().log_softmax(dim=-1)
        heads = torch.tensor([c[0] for row in part for c in row.choices], dtype=torch.long)
        which = torch.tensor([r for r, row in enumerate(part) for _ in row.choices], dtype=torch.long)
        parts.append(logp[to_device(which, device), to_device(heads, device)])
    return torch.cat(parts) if parts else first_logits.new_zeros(0, dtype=torch.float32)


def score_choices(
    stack: Stack,
    kv: KV,
    rows: Sequence[ScoreRow],
    first_logits: torch.Tensor,
    *,
    width: int,
    chunk_tokens: int,
    merge_lora: bool,
) -> Scored:
    """Each row's choices scored after its prompt, whose K/V `kv` already holds (prefilled, ending in column
    `width - 1`); `first_logits` (rows, vocab) are the prefill's logits after each prompt (the LM head's dtype).
    The host builds every part's layout first, while the GPU still runs the prefill (each goes to the device
    just before its part runs), and reads the log-probabilities back once, at the end."""
    span = max(row.choice_tokens for row in rows)
    step = max(1, chunk_tokens // span)
    parts = [
        (start, layout(rows[start : start + step], width, span))
        for start in (range(0, len(rows), step) if span > 1 else ())
    ]
    first = first_token_logprobs(first_logits, rows)
    picked: list[torch.Tensor] = []
    for start, host in parts:
        lay = host.on(rows[start : start + step], stack.dtype, stack.device)
        picked.append(_continuation(stack, kv, lay, start, width, span, merge_lora))
    values = torch.cat([first, *picked]).double().cpu().tolist()
    sums = [[0.0] * len(row.choices) for row in rows]
    k = 0
    for r, row in enumerate(rows):
        for c in range(len(row.choices)):
            sums[r][c] += values[k]
            k += 1
    for start, host in parts:
        for r, c in host.owners:
            sums[start + r][c] += values[k]
            k += 1
    bad = [not all(math.isfinite(v) for v in row_sums) for row_sums in sums]
    return Scored(loglik=[tuple(s) for s in sums], bad=bad)


def _continuation(
    stack: Stack, kv: KV, lay: _Layout, offset: int, width: int, span: int, merge_lora: bool
) -> torch.Tensor:
    """The choice tokens of rows `offset ...` (`lay`) through the layers, after their cached prompts: the
    log-probability of every choice token after the first (float32, on the device, in `lay.owners` order)."""
    s = stack
    n = lay.tokens.shape[0]
    masks = lay.masks
    h = s.embed(lay.tokens)
    cos, sin = s.rotary(h, lay.positions)
    x = s.ops.norm(s.layers[0].norm1, h)
    # The stack's compiled steps (`s.ops`), not prefill's kernels: a few tokens a row, every launch issued from the
    # host, where ours cost more host time than the compiled ones (with ours in every call of up to 512 tokens,
    # choices ran 5.6 s against 2.9 on the H200, d0f2c16 in bench/RESULTS.md).
    # GQA without expanding K/V: the query heads sharing a KV head become that head's query rows (as in a
    # decode step), the mask repeated for each of them.
    mask = lay.mask.expand(n, s.groups, span, width + span).reshape(n, 1, s.groups * span, width + span)
    for i, (layer, (k_cache, v_cache)) in enumerate(zip(s.layers, kv, strict=True)):
        merged = layer.merged(masks) if merge_lora else None
        dense, lora = (merged, []) if merged is not None else (layer.dense(), masks)
        q, k, v = s.qkv(layer, x, lora, cos, sin, dense)
        k_cache[offset : offset + n, :, width : width + span] = k
        v_cache[offset : offset + n, :, width : width + span] = v
        keys = k_cache[offset : offset + n, :, : width + span]  # views: the prompt and these choices
        values = v_cache[offset : offset + n, :, : width + span]
        q = q.reshape(n, s.kv_heads, s.groups * span, s.head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.scaling)
        attn = out.reshape(n, s.heads, span, s.head_dim).transpose(1, 2).reshape(n, span, s.heads * s.head_dim)
        h, x = s.rest(layer, h, attn, lora, s.next_norm(i), dense)
    picked: list[torch.Tensor] = []
    for start in range(0, lay.targets.numel(), LOGIT_ROWS):
        where = slice(start, start + LOGIT_ROWS)
        hidden = x[lay.rows[where], lay.columns[where]]
        logp = s.head(hidden).float().log_softmax(dim=-1)
        picked.append(logp.gather(1, lay.targets[where, None])[:, 0])
    return torch.cat(picked) if picked else lay.tokens.new_zeros(0, dtype=torch.float32)
