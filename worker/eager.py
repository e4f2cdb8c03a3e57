"""The HF generate fallback: a batch through `model.generate`, for bases the static loop does not support, after
the loop failed, or with `--decode eager`. HF generate samples the whole call one way, so the engine makes one
call per sampling setting (`sampling_params`). The answer has the static loop's shape (`Decoded`)."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from shared.job import Job
from worker.fastpath import Decoded, left_pad
from worker.fastpath.logprobs import TOP_LOGPROBS, RowLogprobs
from worker.rows import BaseCall, Item


@torch.inference_mode()
def generate_eager(call: BaseCall, items: list[Item]) -> Decoded:
    """Rows of one sampling setting: each to its stop token or its own `max_new`, the batch to its deadline."""
    tok = call.base.tokenizer
    input_ids, mask = left_pad([it.ids for it in items], tok.pad_token_id, call.device)
    prompt_len = input_ids.shape[1]
    limits = torch.tensor([it.max_new for it in items], device=call.device)
    recorder = StepRecorder(len(items), call.stop_ids[0], asking=[i for i, it in enumerate(items) if it.job.logprobs])
    job = items[0].job
    gen_config = GenerationConfig(
        max_new_tokens=int(limits.max()),
        do_sample=job.temperature > 0,
        temperature=job.temperature if job.temperature > 0 else None,
        top_p=job.top_p if job.temperature > 0 and job.top_p < 1.0 else None,
        top_k=job.top_k if job.temperature > 0 and job.top_k > 0 else None,
        eos_token_id=call.stop_ids,
        pad_token_id=tok.pad_token_id,
    )
    if job.seed is not None:
        torch.manual_seed(job.seed)
    call.fault("generate", len(items))
    with call.adapters([it.adapter for it in items]) as kwargs:
        out = call.base.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            generation_config=gen_config,
            logits_processor=LogitsProcessorList([recorder]),
            stopping_criteria=StoppingCriteriaList([RowLimit(limits, prompt_len), Deadline(call.deadline)]),
            **kwargs,
        )
    generated = out[:, prompt_len:]
    logprobs = recorder.finish(generated)
    cut_short = call.deadline is not None and time.monotonic() >= call.deadline
    return Decoded(
        tokens=generated, logprobs=logprobs, bad=recorder.bad, cut_short=cut_short, reported=recorder.reported(logprobs)
    )


def sampling_params(job: Job) -> tuple[Any, ...]:
    """What HF generate needs the same for every row of one call."""
    if job.temperature == 0:
        return (0.0,)
    return (job.temperature, job.top_p, job.top_k, job.seed)


class StepRecorder(LogitsProcessor):
    """Records the log-probability of each token actually chosen, one step late (the next call's
    `input_ids` reveal the previous choice), keeping only one step of full-vocabulary scores.
    Rows with non-finite logits are flagged and forced to end, so their batch-mates carry on.
    HF applies temperature, top-p and top-k after the processors it is given: these are the model's own
    log-probabilities. For the `asking` rows (a job's `logprobs`) it also keeps each step's most likely tokens."""

    def __init__(self, batch: int, end_id: int, *, asking: list[int] | None = None) -> None:
        self.prev: torch.Tensor | None = None
        self.chosen: list[torch.Tensor] = []
        self.bad = torch.zeros(batch, dtype=torch.bool)
        self.end_id = end_id
        self.asking = asking or []
        self._asking: torch.Tensor | None = None  # `asking` on the scores' device
        self.top: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: (values, ids), (asking, TOP_LOGPROBS)

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
        if self.asking:
            if self._asking is None:
                self._asking = torch.tensor(self.asking, dtype=torch.long, device=logp.device)
            self.top.append(logp.index_select(0, self._asking).topk(TOP_LOGPROBS, dim=-1))
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """(rows, steps) log-probs of the generated tokens (steps beyond a row's end are meaningless)."""
        if self.prev is not None and generated.shape[1] > len(self.chosen):
            self.chosen.append(self.prev.gather(1, generated[:, len(self.chosen)].unsqueeze(1)).squeeze(1))
        if not self.chosen:
            return torch.zeros((generated.shape[0], 0))
        return torch.stack(self.chosen, dim=1).cpu()

    def reported(self, logprobs: torch.Tensor) -> dict[int, RowLogprobs]:
        """The asking rows' records (`logprobs`: what `finish` returned)."""
        if not self.asking:
            return {}
        steps = logprobs.shape[1]
        if self.top:
            values = torch.stack([v for v, _ in self.top], dim=1)[:, :steps].cpu()
            ids = torch.stack([i for _, i in self.top], dim=1)[:, :steps].cpu()
        else:
            values = torch.zeros((len(self.asking), 0, TOP_LOGPROBS))
            ids = torch.zeros((len(self.asking), 0, TOP_LOGPROBS), dtype=torch.long)
        return {row: RowLogprobs(logprobs[row], ids[j], values[j]) for j, row in enumerate(self.asking)}


class Deadline(StoppingCriteria):
    """Stops every row once the batch's time limit has passed (a hung or crawling generation)."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        done = self.deadline is not None and time.monotonic() >= self.deadline
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class RowLimit(StoppingCriteria):
    """Each row stops at its own max_new_tokens (the batch runs to the longest)."""

    def __init__(self, limits: torch.Tensor, prompt_len: int) -> None:
        self.limits = limits
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return (input_ids.shape[1] - self.prompt_len) >= self.limits
