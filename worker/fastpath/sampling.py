"""Sampling inside the decode step: temperature, top-p and top-k per row, seeded per row.

A graph cannot draw from torch's global generator per row (one stream for the whole batch: a row's draws would
depend on what else the batch holds, and on its position in it). Instead each row's randomness is a
counter-based hash of (its seed, its step): one uniform number per row and step, computed on the device with
integer ops, so a seeded row gets the same draws whatever batch it runs in, and a captured graph replays it.
The token is then drawn by inverting the row's cumulative distribution (one uniform per token, not one per
vocabulary entry as Gumbel-max would need).

Greedy rows in the same batch take the argmax as before: their tokens do not change beside sampled rows. Only
the batch's sampled rows draw (gathered into sampler slots, a graph key's bucketed count), so a few sampled
rows among hundreds cost a few rows' worth of sampling work and memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.fastpath import greedy

MASK32 = 0xFFFFFFFF
# Greedy choice converts this many rows' logits to float32 at a time: the step's temporaries are one chunk's
# float32 logits and log-softmax, not the whole batch's (~300 MiB fewer at 256 rows of a 152k vocabulary,
# which the planner gives to more rows).
CHOICE_CHUNK_ROWS = 32


def token_choice(logits: torch.Tensor, end_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of float32 `logits` (as HF's greedy search): the argmax -- `end_id` for a row with a non-finite
    logit -- its log-probability, whether the row's logits were all finite, and the whole log-softmax."""
    finite = torch.isfinite(logits).all(dim=-1)
    token = torch.where(finite, logits.argmax(dim=-1), end_id)
    logp = logits.log_softmax(dim=-1)
    return token, logp.gather(1, token.unsqueeze(1)).squeeze(1), finite, logp


def greedy_choice(
    logits: torch.Tensor, end_id: int, *, chunk_rows: int = CHOICE_CHUNK_ROWS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`token_choice`'s token, log-probability and finiteness: by our fused kernel where it runs (bf16/fp16 logits
    on CUDA: `greedy`, the log-probability summed in another order), else converting `chunk_rows` rows to
    float32 at a time (row-wise arithmetic, so the chunking changes no number)."""
    if greedy.KERNEL.serves(logits):
        fused = greedy.KERNEL(logits, end_id)
        if fused is not None:
            return fused
    parts = [token_choice(part.float(), end_id)[:3] for part in logits.split(chunk_rows)]
    if len(parts) == 1:
        return parts[0]
    tokens, logprobs, finites = zip(*parts, strict=True)
    return torch.cat(tokens), torch.cat(logprobs), torch.cat(finites)


@dataclass(frozen=True)
class Sampling:
    """How one row samples. `top_k` 0: no top-k cut; `top_p` 1.0: no nucleus cut."""

    temperature: float
    seed: int  # 0 <= seed < 2**63
    top_p: float = 1.0
    top_k: int = 0

    @property
    def filtered(self) -> bool:
        """Whether this row needs the sorted (top-p / top-k) path."""
        return self.top_p < 1.0 or self.top_k > 0


class SamplingState:
    """The sampler slots a graph reads (owned by its `State`, like every tensor it reads): which batch row each
    slot draws for, and that row's parameters. Unused slots point at `rows` (a scratch row past the batch)."""

    def __init__(self, slots: int, rows: int, device: torch.device) -> None:
        self.rows = rows
        self.index = torch.full((slots,), rows, dtype=torch.long, device=device)  # the batch row of each slot
        self.on = torch.zeros(slots, dtype=torch.bool, device=device)  # False: an unused slot
        self.temperature = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=device)  # 0 set to the vocabulary at reset
        self.seed = torch.zeros(slots, dtype=torch.long, device=device)
        self.filtered = torch.zeros(slots, dtype=torch.bool, device=device)  # this slot cuts to top-p / top-k

    def reset(self, rows: list[Sampling | None], vocab: int) -> None:
        """This batch's sampled rows into the slots, in row order; the other slots unused."""
        slots = self.on.shape[0]
        index = torch.full((slots,), self.rows, dtype=torch.long)
        on = torch.zeros(slots, dtype=torch.bool)
        temperature = torch.ones(slots, dtype=torch.float32)
        top_p = torch.ones(slots, dtype=torch.float32)
        top_k = torch.full((slots,), vocab, dtype=torch.long)
        seed = torch.zeros(slots, dtype=torch.long)
        filtered = torch.zeros(slots, dtype=torch.bool)
        sampled = [(i, s) for i, s in enumerate(rows) if s is not None]
        if len(sampled) > slots:
            raise ValueError(f"{len(sampled)} sampled rows for {slots} sampler slots")
        for j, (i, s) in enumerate(sampled):
            index[j] = i
            on[j] = True
            temperature[j] = s.temperature
            top_p[j] = s.top_p
            top_k[j] = s.top_k if s.top_k > 0 else vocab
            seed[j] = s.seed
            filtered[j] = s.filtered
        for dst, src in (
            (self.index, index),
            (self.on, on),
            (self.temperature, temperature),
            (self.top_p, top_p),
            (self.top_k, top_k),
            (self.seed, seed),
            (self.filtered, filtered),
        ):
            dst.copy_(src)


def draw_rows(
    logits: torch.Tensor,
    token: torch.Tensor,
    logprob: torch.Tensor,
    finite: torch.Tensor,
    params: SamplingState,
    step: torch.Tensor,
    *,
    filtered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token` and `logprob` (the greedy choice, per row) with each sampled row's draw in its place: the slots
    gather their rows' logits, draw, and write back (unused slots write into a scratch row past the batch).
    A non-finite row keeps what the caller chose for it. `logits` in any float dtype: only the slots' rows are
    converted to float32 (the same numbers as converting them all first)."""
    rows = token.shape[0]
    gather = params.index.clamp(max=rows - 1)  # an unused slot reads any row; what it draws is discarded
    drawn, drawn_logprob = sample(logits.index_select(0, gather).float(), params, step, filtered=filtered)
    use = params.on & finite.index_select(0, gather)
    tokens = torch.cat((token, token.new_zeros(1)))
    logprobs = torch.cat((logprob, logprob.new_zeros(1)))
    tokens.index_copy_(0, params.index, torch.where(use, drawn, tokens.index_select(0, params.index)))
    logprobs.index_copy_(0, params.index, torch.where(use, drawn_logprob, logprobs.index_select(0, params.index)))
    return tokens[:rows], logprobs[:rows]


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding values below 2**32. A product can pass 2**63
    and wrap, but wrapping keeps the low 32 bits, which are all the mask keeps: CPU and CUDA agree."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(rows,) float32 in (0, 1): a function of each row's seed and the step only, never of other rows."""
    x = _mix32((seed & MASK32) ^ _mix32((step * 0x9E3779B1) & MASK32))
    x = _mix32(x ^ ((seed >> 32) & MASK32))
    return ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def sample(
    logits: torch.Tensor, params: SamplingState, step: torch.Tensor, *, filtered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token per row drawn from softmax(logits / temperature) -- cut to the top-k tokens and to the smallest
    set whose probability reaches top-p for a row that asks (`filtered`: some row of the batch does) -- and its
    log-probability under that distribution. `logits` are float32 (rows, vocab); greedy rows get a draw too,
    which the caller ignores.

    A row without a cut draws over the vocabulary in its own order whether or not a batch-mate sorts: the
    draw of a row must not depend on what else the batch holds."""
    scaled = logits / params.temperature[:, None]
    u = uniform(params.seed, step)[:, None]
    token, logprob = _draw(scaled.log_softmax(dim=-1), u)
    if not filtered:
        return token, logprob
    # Sorted descending (stable: ties keep the vocabulary order, so the draw is a function of the row alone).
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    keep = ranks[None, :] < params.top_k[:, None]
    probs = ordered.softmax(dim=-1)
    # Nucleus: keep a token while the mass before it is under top_p (the most likely token always stays).
    keep &= (probs.cumsum(dim=-1) - probs) < params.top_p[:, None]
    pick, cut_logprob = _draw(ordered.masked_fill(~keep, float("-inf")).log_softmax(dim=-1), u)
    cut_token = order.gather(1, pick[:, None])[:, 0]
    return torch.where(params.filtered, cut_token, token), torch.where(params.filtered, cut_logprob, logprob)


def _draw(logp: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw: the first index whose cumulative probability reaches u (scaled by the total, which
    rounding keeps from being exactly 1). Never an index of probability 0, since u > 0; a cut-off tail (-inf)
    is never reached, since u < 1."""
    cdf = logp.exp().cumsum(dim=-1)
    index = (cdf < u * cdf[:, -1:]).sum(dim=-1).clamp(max=logp.shape[-1] - 1)
    return index, logp.gather(1, index[:, None])[:, 0]
