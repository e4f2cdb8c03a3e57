"""Choice scoring: each choice's log-likelihood (its tokens + end-of-answer) after the prompt -- on the static
loop (the prompt encoded once, the choices run beside it in its prefill), else one padded HF forward pass.

Confidence (documented in the README): the normalised probability of the best choice, from each choice's full
log-likelihood.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from shared.errors import NON_FINITE_LOGITS
from shared.job import Job
from worker.config import ModelsConfig
from worker.fastpath import ScoreRow, StaticDecoder, left_pad
from worker.loading import LoadedBase, stop_ids
from worker.outputs import RowOutput
from worker.rows import BaseCall, Item

ChoiceIds = tuple[tuple[int, ...], ...]


class ChoiceTokens:
    """Each choice's tokens and the end-of-answer token (a choice is scored as a whole answer). Cached per
    base and label set: a take of 600 jobs usually repeats one set of labels."""

    def __init__(self, config: ModelsConfig, bases: dict[str, LoadedBase]) -> None:
        self.config = config
        self.bases = bases
        self._cache: dict[tuple[str, tuple[str, ...]], ChoiceIds] = {}

    def ids(self, job: Job) -> ChoiceIds:
        key = (self.config.models[job.model].base, job.choices or ())
        cached = self._cache.get(key)
        if cached is None:
            base = self.bases[key[0]]
            end_id = stop_ids(base, self.config.stop_strings)[0]
            tok = base.tokenizer
            cached = tuple(
                (*tok(choice, add_special_tokens=False, split_special_tokens=True).input_ids, end_id)
                for choice in job.choices or ()
            )
            if len(self._cache) >= 4096:
                self._cache.clear()  # bounded: label sets chosen per job must not grow it forever
            self._cache[key] = cached
        return cached

    def count(self, job: Job) -> int:
        """All of a job's choice tokens together (what the loop keeps in its KV pool after the prompt)."""
        return sum(len(c) for c in self.ids(job))


def score_static(
    call: BaseCall, decoder: StaticDecoder, items: list[Item], choices: ChoiceTokens
) -> list[RowOutput] | None:
    """The rows scored inside the static loop's prefill; None where its own prefill is off (`score_eager`)."""
    rows = [ScoreRow(ids=it.ids, choices=choices.ids(it.job), adapter=it.adapter) for it in items]
    call.fault("score", len(items))
    scored = decoder.score(rows, pad_id=call.base.tokenizer.pad_token_id)
    if scored is None:
        return None
    return [
        choice_output(item, loglik, [0] * len(loglik), 0, not bad)
        for item, loglik, bad in zip(items, scored.loglik, scored.bad, strict=True)
    ]


@torch.inference_mode()
def score_eager(call: BaseCall, items: list[Item]) -> list[RowOutput]:
    """Each choice's log-likelihood (its tokens + end-of-answer) after the prompt, in one forward pass."""
    tok = call.base.tokenizer
    end_id = call.stop_ids[0]
    seqs, owners, lengths = [], [], []
    for row, item in enumerate(items):
        for choice in item.job.choices or ():
            cids = [*tok(choice, add_special_tokens=False, split_special_tokens=True).input_ids, end_id]
            seqs.append(item.ids + cids)
            owners.append(row)
            lengths.append(len(cids))
    input_ids, mask = left_pad(seqs, tok.pad_token_id, call.device)
    tail = max(lengths)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    call.fault("score", len(items))
    with call.adapters([items[o].adapter for o in owners]) as kwargs:
        logits = call.base.model(
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
    values = scores.tolist()
    return [choice_output(item, values, owners, row, bool(finite[row])) for row, item in enumerate(items)]


def choice_output(item: Item, scores: Sequence[float], owners: list[int], row: int, finite: bool) -> RowOutput:
    """Row `row`'s answer from the log-likelihoods in `scores` that `owners` assigns to it. Plain floats: a row's
    few choices in torch cost ~8 tensor operations, ~40 ms of a 600-row take's host time while the GPU waited."""
    if not finite:
        return RowOutput.failed(NON_FINITE_LOGITS, "the model produced NaN/inf logits for this row", len(item.ids))
    probs = softmax([s for s, o in zip(scores, owners, strict=True) if o == row])
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


def softmax(values: list[float]) -> list[float]:
    """Probabilities from log-likelihoods, in float64 as torch.softmax computes them (the largest subtracted)."""
    top = max(values)
    weights = [math.exp(v - top) for v in values]
    total = sum(weights)
    return [w / total for w in weights]
