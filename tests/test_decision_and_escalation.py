"""Decision spans (what the confidence is computed over) and the escalation rule, table-driven."""

from __future__ import annotations

import pytest

from worker.config import EscalationRule
from worker.escalation import escalation_reason
from worker.outputs import decision_span

# A fake tokeniser: each "token" is a string; decoding is concatenation.
VOCAB = ["Step", " 1", ":", " check", "\n", "Decision", ":", " approve", "\n", "done", " re", "ject"]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


@pytest.mark.parametrize(
    ("tokens", "prefix", "decision", "span"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "Decision:", "approve", (7, 8)),
        ([5, 6, 10, 11], "Decision:", "reject", (2, 4)),
        ([7, 8, 9], "Decision:", "approve", (0, 1)),  # no prefix: the first line
        ([10, 11], None, "reject", (0, 2)),
        ([], "Decision:", None, (0, 0)),
    ],
)
def test_decision_span(tokens: list[int], prefix: str | None, decision: str | None, span: tuple[int, int]) -> None:
    got, start, stop = decision_span(tokens, decode, prefix)
    assert (got, (start, stop)) == (decision, span)


RULE = EscalationRule(threshold=0.7, max_chars=40)


@pytest.mark.parametrize(
    ("text", "confidence", "job", "batch_off", "escalates"),
    [
        ("approve", 0.9, None, False, False),
        ("approve", 0.5, None, False, True),
        ("approve", 0.5, False, False, False),  # switched off per job
        ("approve", 0.5, None, True, False),  # switched off per batch
        ("approve", 0.85, 0.9, False, True),  # the job's own threshold
        ("approve", 0.6, 0.5, False, False),
        ("I am not sure", 0.99, None, False, True),
        ("可能需要更多信息", 0.99, None, False, True),
        ("x" * 41, 0.99, None, False, True),
    ],
)
def test_escalation_rule(text: str, confidence: float, job, batch_off: bool, escalates: bool) -> None:
    reason = escalation_reason(RULE, text=text, confidence=confidence, job_setting=job, batch_off=batch_off)
    assert (reason is not None) == escalates


def test_kev_never_escalates() -> None:
    assert escalation_reason(None, text="not sure", confidence=0.0, job_setting=None, batch_off=False) is None


def test_a_follow_up_keeps_the_items_logprobs_request() -> None:
    """The final answer of an escalated item is Kev's: it carries the logprobs the item asked for."""
    from shared.job import Job
    from shared.result import Result
    from worker.followups import follow_up

    job = Job(custom_id="a", model="laya", prompt="p", logprobs=True, top_logprobs=2)
    entry = follow_up(job, Result(custom_id="a", model="laya", job_id="j1", text="not sure"), "kev")
    assert (entry.job.model, entry.job.logprobs, entry.job.top_logprobs) == ("kev", True, 2)
