"""What the engine answers for one row: a plain value, index-aligned with the jobs it was given; and how a row's
generated tokens become one (where it stopped, its text, the decision span and the confidence).

Confidence of a generated answer (documented in the README): the probability the model gave the *decision span*
it emitted -- the tokens after the model's `decision_prefix` ("Decision:") up to the end of that line, or the
first line when there is no prefix -- i.e. exp(sum of those tokens' log-probabilities) under the distribution it
decoded from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.errors import NON_FINITE_LOGITS, TIMEOUT
from shared.result import ErrorInfo

if TYPE_CHECKING:
    import torch

    from worker.rows import Item


@dataclass(frozen=True, kw_only=True)
class RowOutput:
    text: str | None = None
    decision: str | None = None
    confidence: float | None = None
    raw_confidence: float | None = None  # the model's own, when `confidence` was calibrated (worker/calibration.py)
    choices: dict[str, float] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: ErrorInfo | None = None

    @classmethod
    def failed(cls, error_type: str, message: str, prompt_tokens: int = 0) -> RowOutput:
        return cls(error=ErrorInfo(type=error_type, message=message), prompt_tokens=prompt_tokens)


def generated_output(
    item: Item,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    *,
    bad: bool,
    stops: set[int],
    cut_short: bool,
    decode: Callable[..., str],
    decision_prefix: str | None,
) -> RowOutput:
    """One row's answer from its generated `tokens` (past its end: padding) and each token's log-probability."""
    if bad:
        return RowOutput.failed(NON_FINITE_LOGITS, "the model produced NaN/inf logits for this row", len(item.ids))
    all_ids = tokens.tolist()
    stop_at = next((i for i, t in enumerate(all_ids) if t in stops), None)
    stopped = stop_at is not None and stop_at < item.max_new
    if cut_short and not stopped and len(all_ids) < item.max_new:
        # Neither its stop token nor its own limit: the batch's deadline ended this row.
        return RowOutput.failed(TIMEOUT, "generation hit the batch's time limit", len(item.ids))
    end = min(len(all_ids) if stop_at is None else stop_at, item.max_new)
    used = end + 1 if stopped else end  # the stop token is generated too, so it counts
    ids, lps = all_ids[:end], logprobs[:end]
    text = decode(ids, skip_special_tokens=True)
    decision, start, stop = decision_span(ids, decode, decision_prefix)
    span = lps[start:stop] if stop > start else lps[:1]
    confidence = float(span.double().sum().exp()) if span.numel() else None
    return RowOutput(
        text=text,
        decision=decision,
        confidence=confidence,
        prompt_tokens=len(item.ids),
        completion_tokens=used,
    )


def decision_span(
    ids: list[int], decode: Callable[[list[int]], str], prefix: str | None
) -> tuple[str | None, int, int]:
    """(decision text, first token, end token) of the decision: the line after the last `prefix`, else the
    first line. Token bounds are found by decoding growing spans, so multi-byte characters stay whole."""
    if not ids:
        return None, 0, 0
    text = decode(ids)
    start = 0
    if prefix and prefix in text:
        k = len(ids) - 1
        while k > 0 and prefix not in decode(ids[k:]):
            k -= 1
        start = k
        while start < len(ids) and prefix not in decode(ids[k : start + 1]):
            start += 1
        start += 1
    while start < len(ids) and not decode(ids[start : start + 1]).strip():
        start += 1  # whitespace between the prefix and the label is not part of the decision
    stop = start
    while stop < len(ids) and "\n" not in decode(ids[start : stop + 1]):
        stop += 1
    # `stop` now indexes the token holding the line break (or len(ids)): the span is [start, stop).
    decision = decode(ids[start:stop]).strip() or None
    return decision, start, stop
