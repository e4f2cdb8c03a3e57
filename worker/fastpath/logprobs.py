"""Per-token log-probabilities for the rows that ask (`logprobs` on a job), from the logits the step already has.

Like sampling, this is work of a few slots, not of the batch: the rows that asked are gathered into logprob
slots (their count bucketed, part of the graph key; 0 slots: the step does nothing extra, and its graph is the
one a batch without such rows uses). Each step, every slot records the model's own log-probability (before
temperature, top-p and top-k) of the token its row emitted and the `TOP_LOGPROBS` most likely tokens with
theirs; the engine keeps as many of those as the job asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_LOGPROBS = 5  # the most a job may ask for (shared.job.MAX_TOP_LOGPROBS): one top-k shape for every graph


@dataclass(frozen=True)
class RowLogprobs:
    """One row's record, per generated token (steps past its end: padding)."""

    chosen: torch.Tensor  # (steps,) float32: the emitted token's log-probability under the model's distribution
    top_ids: torch.Tensor  # (steps, TOP_LOGPROBS) the most likely tokens, most likely first
    top_logprobs: torch.Tensor  # (steps, TOP_LOGPROBS) float32


class LogprobState:
    """The logprob slots a graph reads and writes (owned by its `State`, like every tensor it reads): which batch
    row each slot records, and what it recorded per step. Unused slots record row 0, and nobody reads them."""

    def __init__(self, slots: int, length: int, device: torch.device) -> None:
        self.index = torch.zeros(slots, dtype=torch.long, device=device)
        self.chosen = torch.zeros(slots, length, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(slots, length, TOP_LOGPROBS, dtype=torch.long, device=device)
        self.top_logprobs = torch.zeros(slots, length, TOP_LOGPROBS, dtype=torch.float32, device=device)

    def reset(self, rows: list[int]) -> None:
        """This batch's asking rows into the slots, in row order."""
        slots = self.index.shape[0]
        if len(rows) > slots:
            raise ValueError(f"{len(rows)} rows asking for logprobs for {slots} logprob slots")
        index = torch.zeros(slots, dtype=torch.long)
        index[: len(rows)] = torch.tensor(rows, dtype=torch.long)
        self.index.copy_(index)

    def record(self, logits: torch.Tensor, token: torch.Tensor, step: torch.Tensor) -> None:
        """Step `step`'s record from the batch's logits (rows, vocab) and the tokens the rows emitted: only the
        slots' rows converted to float32 and normalised (row by row, the numbers the whole batch's would give)."""
        mine = logits.index_select(0, self.index).float().log_softmax(dim=-1)
        values, ids = mine.topk(TOP_LOGPROBS, dim=-1)
        chosen = mine.gather(1, token.index_select(0, self.index).unsqueeze(1))
        self.chosen.index_copy_(1, step, chosen)
        self.top_ids.index_copy_(1, step, ids.unsqueeze(1))
        self.top_logprobs.index_copy_(1, step, values.unsqueeze(1))

    def rows(self, asking: list[int], steps: int) -> dict[int, RowLogprobs]:
        """Each asking row's record of the first `steps` steps, copied to the CPU."""
        cpu = torch.device("cpu")  # copies: the next batch overwrites these buffers
        chosen = self.chosen[: len(asking), :steps].to(cpu, copy=True)
        ids = self.top_ids[: len(asking), :steps].to(cpu, copy=True)
        values = self.top_logprobs[: len(asking), :steps].to(cpu, copy=True)
        return {row: RowLogprobs(chosen[j], ids[j], values[j]) for j, row in enumerate(asking)}
