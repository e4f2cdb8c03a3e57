"""A group of rows cut into sub-batches that fit memory: packed by the memory plan at their real lengths, and,
should the plan be wrong, survived on an out-of-memory error (retried once with memory released, then split)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from shared.errors import OUT_OF_MEMORY
from worker.memory import BatchPlan
from worker.outputs import RowOutput
from worker.rows import Item

log = logging.getLogger("kevlaya.engine")
Plan = Callable[..., BatchPlan]  # Engine.plan(model, *, input_tokens, new_tokens, sampled_rows, logprob_rows, ...)


# A logprob slot (worker/fastpath/logprobs.py) holds its row's log-softmax and top-k's workspace, about 2 fp32
# vectors over the vocabulary; a sampler slot about 12 (ModelShape.sampling_bytes_per_slot). The plan counts
# logprob rows as sampler slots at that ratio, rounded up (no logprob rows: nothing).
LOGPROB_ROWS_PER_SAMPLER_SLOT = 6


def logprob_draws(rows: int) -> int:
    """Logprob rows as the sampler slots the memory plan reserves for them."""
    return -(-rows // LOGPROB_ROWS_PER_SAMPLER_SLOT)


def pack(
    items: list[Item], *, scoring: bool, on_loop: bool, plan: Plan, choice_tokens: Callable[..., int]
) -> Iterator[list[Item]]:
    """Sub-batches that fit the memory plan at their real lengths, of even sizes where the rows need several
    (`even_share`). Sorted by length first, so rows of similar length share a batch and little compute is spent
    on padding. `on_loop`: scored on the static loop;
    `choice_tokens(job)`: all of a job's choice tokens.

    A generator: each sub-batch is planned after the one before it ran, so against the KV pool and graphs that
    one left (a sub-batch planned beside an earlier, smaller pool and then run beside a larger one would
    reuse memory its plan did not count)."""
    model = items[0].job.model
    on_loop = scoring and on_loop
    ordered = sorted(items, key=lambda it: len(it.ids))
    # Rows of one adapter (or none) merge its LoRA into the prefill's dequantised weights in place: a take that
    # holds another model's rows too plans a second layer's copy (`memory.prefill_chunk_bytes`).
    one = len({it.adapter for it in items}) <= 1

    def fit(longest: int, span: int, new: int, draws: int, reporting: int, per_item: int, **kw: Any) -> BatchPlan:
        """The plan for a sub-batch of these figures (its `max_rows`: the rows it may hold)."""
        if on_loop:
            # The loop scores a row's choices beside its prompt inside its prefill: planned as a row of the
            # prompt plus all its choices' tokens (the prompt once, not once per choice), with no cache.
            return plan(model, input_tokens=longest, new_tokens=span, scoring=True, one_adapter=one, **kw)
        if scoring:
            whole = plan(model, input_tokens=longest + 8, new_tokens=0)
            return replace(whole, max_rows=whole.max_rows // per_item)
        return plan(
            model, input_tokens=longest, new_tokens=new, sampled_rows=draws, logprob_rows=reporting,
            one_adapter=one, **kw,
        )  # fmt: skip

    def fitting(longest: int, *figures: int, **kw: Any) -> int:
        """The rows the plan lets a sub-batch of these figures hold."""
        return fit(longest, *figures, **kw).max_rows

    memo: dict[tuple[Any, ...], int] = {}

    def planned(longest: int, *figures: int, **kw: Any) -> int:
        """`fitting`, asked once per figures until a sub-batch runs (rows of equal length ask alike; a plan is
        tens of microseconds, ~12 ms a 256-row take asked row by row)."""
        key = (longest, *figures, *sorted(kw.items()))
        if key not in memo:
            memo[key] = fitting(longest, *figures, **kw)
        return memo[key]

    def figures_of(rows: list[Item]) -> tuple[int, int, int, int, int]:
        """(most choice tokens, most new tokens, sampler draws, logprob rows, most choices) of these rows."""
        reporting = sum(not scoring and it.job.logprobs for it in rows)
        sampled_rows = sum(not scoring and it.job.temperature > 0 for it in rows)
        return (
            max(choice_tokens(it.job) for it in rows) if on_loop else 0,
            max(it.max_new for it in rows),
            sampled_rows + logprob_draws(reporting),
            reporting,
            max(max(1, len(it.job.choices or ())) for it in rows),
        )

    def balanced(current: list[Item], rest: list[Item]) -> int:
        """Where to cut `current` when the rows to come need a sub-batch of their own: as evenly as the rows after
        the cut fit (probed without releasing anything). A cut where the plan shrank left 189 + 3 sampled rows, the
        3 decoding every step on a graph captured for them alone; 96 + 96 share one."""
        if len(rest) >= len(current):
            return len(current)
        total = len(current) + len(rest)
        tail_cap = planned(len(rest[-1].ids), *figures_of(current + rest), may_release=False)
        return min(len(current), max(-(-total // 2), total - tail_cap))

    if ordered:
        # All rows in one sub-batch where one plan at the longest prompt and all the rows' figures holds them as
        # they are, nothing released. Where the plan shrinks as prompts and figures grow (the loop's own prefill)
        # the loop below reaches the same single sub-batch, asking the plan once per new prompt length on the way
        # (~250 plans, ~10 ms of a 344-row take's host time before its first kernel). The model-forward fallback's
        # set-aside is not monotone in the prompt length (whole prompts a chunk, rounded down), so there the loop
        # could cut where this does not; it pads every row to the take's longest prompt, the plan asked here.
        whole = fit(len(ordered[-1].ids), *figures_of(ordered), rows_wanted=len(ordered), may_release=False)
        if whole.max_rows >= len(ordered) and not whole.released:
            yield ordered
            return
    current: list[Item] = []
    span = new = sampled = asking = 0  # the chunk's most choice tokens, most new tokens, sampled and logprob rows
    greedy = False  # this sub-batch is cut where the plan cuts it (the rows to come cannot take an even share)
    index = 0
    while index < len(ordered):
        item = ordered[index]
        longest = len(item.ids)  # ascending order: the newcomer is the longest in the chunk
        wanted = len(current) + len(ordered) - index  # the rows this sub-batch could still take
        item_span = choice_tokens(item.job) if on_loop else 0
        reporting = asking + (not scoring and item.job.logprobs)
        draws = sampled + (not scoring and item.job.temperature > 0) + logprob_draws(reporting)
        per_item = max(1, len(item.job.choices or ()))
        figures = (max(span, item_span), max(new, item.max_new), draws, reporting, per_item)
        rows = max(1, planned(longest, *figures, rows_wanted=wanted))
        share = rows if greedy else even_share(rows, wanted)
        if current and share < len(current) + 1 <= rows:
            # An even cut before the plan's own: only where the longest rows still to come fit an even share
            # too (the plan shrinks as prompts grow; cut early for a share they cannot take, the rows would
            # need more sub-batches than greedy packing). Probed without releasing anything.
            rest = ordered[index:]
            tail = planned(len(rest[-1].ids), *figures_of([*current, *rest]), may_release=False)
            if tail < share:
                share, greedy = rows, True  # for the rest of this sub-batch: probed once
        if current and len(current) + 1 > share:
            keep = balanced(current, ordered[index:]) if len(current) + 1 > rows else len(current)
            yield current[:keep]
            memo.clear()  # the next sub-batch is planned beside what this one left
            index -= len(current) - keep  # rows moved past the cut go again, into the next sub-batch
            current, span, new, sampled, asking, greedy = [], 0, 0, 0, 0, False
            continue
        current.append(item)
        span, new = max(span, item_span), max(new, item.max_new)
        sampled += not scoring and item.job.temperature > 0
        asking += not scoring and item.job.logprobs
        index += 1
    if current:
        yield current


def even_share(cap: int, wanted: int) -> int:
    """The rows of a sub-batch when `wanted` rows need sub-batches of at most `cap`: as many sub-batches as
    that takes, of even size. Greedy packing decoded a long tail for a few rows (200 Kev rows under a plan of 80:
    80 + 80 + 40, each decoding the full answer length, the last one on a graph captured for it alone); even
    ones (67 + 67 + 66) share one captured graph."""
    if wanted <= cap:
        return cap
    parts = -(-wanted // cap)
    return -(-wanted // parts)


class OomGuard:
    """Runs a sub-batch and survives an out-of-memory error. `release()` drops what the static loops hold and says
    whether they held anything; `count` is the errors survived (each one a planning bug)."""

    def __init__(self, release: Callable[[], bool]) -> None:
        self.release = release
        self.count = 0

    def __call__(
        self, fn: Callable[[list[Item]], list[RowOutput]], items: list[Item], *, retried: bool = False
    ) -> list[RowOutput]:
        """Out of memory first retries the batch once, if releasing the static loop's graphs and cache freed
        anything (graphs of earlier buckets pin memory the plan does not count); then it splits the batch
        in halves; only a row that fails alone is an error. The retry happens after the `except` block:
        inside it, the traceback would keep the failed attempt's activations alive."""
        try:
            return fn(items)
        except torch.OutOfMemoryError as exc:
            what = str(exc).split("\n")[0][:300]  # the text only: the exception would keep the attempt alive
        self.count += 1
        log.error(
            "OUT OF MEMORY at %d rows (out-of-memory error #%d of this worker): the memory plan let this batch "
            "past what the budget holds -- a planning bug, please report it; surviving it by %s. %s",
            len(items), self.count, "releasing the decode graphs and cache" if not retried else "splitting", what,
        )  # fmt: skip
        freed = self.release()
        if freed and not retried:
            log.warning("out of memory at %d rows; retrying once with the decode graphs and cache released", len(items))
            return self(fn, items, retried=True)
        if len(items) == 1:
            return [RowOutput.failed(OUT_OF_MEMORY, "does not fit in memory even alone", len(items[0].ids))]
        half = len(items) // 2
        log.warning("out of memory at %d rows; splitting into %d + %d", len(items), half, len(items) - half)
        return self(fn, items[:half], retried=True) + self(fn, items[half:], retried=True)
