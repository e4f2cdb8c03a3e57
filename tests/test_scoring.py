"""Choice scoring on the static loop: each prompt encoded once, every choice scored against its cached K/V."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.job import Job
from tests.conftest import tiny_config
from worker.engine import Engine
from worker.fastpath import ScoreRow
from worker.loading import select_adapters

PROMPTS = ["Approve a loan of 12000?", "Income 52000, debt low.", "不确定的情况", "x", "Step 1: check income " * 7]
CHOICES = ("approve", "reject now", "need more review by the credit committee", "不确定")


@pytest.fixture(scope="module", params=["none", "nf4"])
def engine(request: pytest.FixtureRequest, tiny_models: Path) -> Engine:
    return Engine(tiny_config(tiny_models, request.param), device="cpu", decode="static")


def reference(engine: Engine, model: str, prompt: list[int], choice: tuple[int, ...]) -> float:
    """A plain log-likelihood: HF forward of prompt + choice alone (no padding), the model's adapter active."""
    base = engine.base_for(model)
    with select_adapters(base, [base.adapters[model]]), torch.inference_mode():
        logp = base.model(input_ids=torch.tensor([prompt + list(choice)])).logits[0].float().log_softmax(-1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(choice))


def test_choice_scores_equal_a_plain_log_likelihood(engine: Engine) -> None:
    """Rows of different prompt lengths, adapters (a mixed batch) and choice counts and lengths, in prefill
    chunks small enough to split them: every choice's log-likelihood as HF computes it for prompt + choice."""
    decoder = engine.decoders["default"]
    base = engine.base_for("kev")
    jobs = [
        Job(custom_id=str(i), model=("kev", "laya")[i % 2], prompt=PROMPTS[i % 5], choices=CHOICES[: 2 + i % 3])
        for i in range(7)
    ]
    items = [engine.encoder.encode(job, index=i) for i, job in enumerate(jobs)]
    rows = [ScoreRow(ids=it.ids, choices=engine.choices.ids(it.job), adapter=it.adapter) for it in items]
    assert len({len(r.ids) for r in rows}) > 2 and len({c for r in rows for c in map(len, r.choices)}) > 2
    decoder.prefill.tokens = 40  # several prefill and continuation chunks
    try:
        scored = decoder.score(rows, pad_id=base.tokenizer.pad_token_id, select=lambda n: select_adapters(base, n))
    finally:
        decoder.prefill.tokens = 4096
    assert scored.bad == [False] * len(rows)
    for job, row, got in zip(jobs, rows, scored.loglik, strict=True):
        want = [reference(engine, job.model, row.ids, c) for c in row.choices]
        assert got == pytest.approx(want, abs=2e-4, rel=1e-4), job.custom_id


def test_the_engine_scores_choices_on_the_loop(engine: Engine) -> None:
    """`run` sends choice jobs through the loop (not an HF forward per choice), beside generation jobs."""
    calls: list[int] = []
    decoder = engine.decoders["default"]
    real = decoder.score
    decoder.score = lambda rows, **kw: calls.append(len(rows)) or real(rows, **kw)  # type: ignore[method-assign]
    try:
        jobs = [
            Job(custom_id="c", model="laya", prompt="Approve?", choices=("yes", "no")),
            Job(custom_id="g", model="laya", prompt="Approve?"),
            Job(custom_id="d", model="kev", prompt="Decide", choices=("approve", "reject", "review")),
        ]
        outs = engine.run(jobs)
    finally:
        del decoder.score
    assert all(o.error is None for o in outs)
    assert calls == [2]  # both choice jobs in one pass
    assert set(outs[0].choices) == {"yes", "no"} and outs[1].choices is None
    assert sum(outs[2].choices.values()) == pytest.approx(1.0)


def test_an_escalated_choice_jobs_follow_up_generates_and_its_decision_is_read_as_a_label(engine: Engine) -> None:
    """The model escalated to digs deeper by writing its answer out: a choice job's follow-up is generated
    (the labels are not scored), and the decision it names is mapped onto the job's labels."""
    from shared.job import Parent

    parent = Parent(job_id="p", model="laya", text="approve", decision="approve", confidence=0.4)
    own = Job(custom_id="c", model="kev", prompt="Decide", choices=("approve", "reject"))
    follow = Job(custom_id="c", model="kev", prompt="Decide", choices=("approve", "reject"), parent=parent)
    assert own.scores_choices and not follow.scores_choices
    calls: list[int] = []
    decoder = engine.decoders["default"]
    real = decoder.score
    decoder.score = lambda rows, **kw: calls.append(len(rows)) or real(rows, **kw)  # type: ignore[method-assign]
    try:
        scored, generated = engine.run([own, follow])
    finally:
        del decoder.score
    assert calls == [1]  # only the job's own model scored
    assert scored.choices is not None and scored.decision in own.choices
    assert generated.error is None and generated.choices is None and generated.completion_tokens > 0


def test_a_generated_decision_is_read_as_the_label_it_names() -> None:
    from worker.outputs import RowOutput, as_label

    labels = ("approve", "Needs Review")
    assert as_label(RowOutput(decision="Approve."), labels).decision == "approve"
    assert as_label(RowOutput(decision=" needs review"), labels).decision == "Needs Review"
    assert as_label(RowOutput(decision="maybe"), labels).decision == "maybe"  # names none: left as written
    assert as_label(RowOutput(decision=None), labels).decision is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_token_logprobs_are_the_same_in_chunks_of_any_size(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The first choice tokens' log-probabilities are taken a chunk of rows at a time (no float32 copy of a whole
    take's logits): across chunk boundaries, with rows of different choice counts, they equal one log-softmax of
    every row's logits in float32."""
    from worker.fastpath import scoring

    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 50, generator=generator) * 4).to(dtype)
    rows = [ScoreRow(ids=[1], choices=tuple((c % 50 + r, 2) for c in range(1 + r % 3)), adapter=None) for r in range(7)]
    whole = logits.float().log_softmax(dim=-1)
    want = [whole[r, c[0]].item() for r, row in enumerate(rows) for c in row.choices]
    for chunk in (1, 2, 3, 32):
        monkeypatch.setattr(scoring, "CHOICE_CHUNK_ROWS", chunk)
        assert scoring.first_token_logprobs(logits, rows).tolist() == want


def reference_layout(rows: list[ScoreRow], width: int, span: int) -> tuple[torch.Tensor, ...]:
    """The layout token by token, as the loop first built it: tokens, positions, mask, and the scored
    (row, column, target, owner) of each position."""
    n = len(rows)
    tokens = torch.zeros((n, span), dtype=torch.long)
    positions = torch.zeros((n, span), dtype=torch.long)
    mask = torch.zeros((n, span, width + span), dtype=torch.bool)
    scored: list[tuple[int, int, int, int, int]] = []
    for r, row in enumerate(rows):
        prompt = len(row.ids)
        mask[r, :, width - prompt : width] = True
        start = 0
        for c, choice in enumerate(row.choices):
            m = len(choice)
            tokens[r, start : start + m] = torch.tensor(choice)
            positions[r, start : start + m] = torch.arange(prompt, prompt + m)
            mask[r, start : start + m, width + start : width + start + m] = torch.ones(m, m, dtype=torch.bool).tril()
            scored += [(r, start + o, choice[o + 1], r, c) for o in range(m - 1)]
            start += m
        mask[r, start:, width - 1] = True
    return tokens, positions, mask, torch.tensor(scored, dtype=torch.long).reshape(-1, 5)


def test_the_choice_layout_built_at_once_is_the_token_by_token_one() -> None:
    """`layout` (numpy, a part at a time) against the loop it replaced, on rows of different prompt lengths,
    choice counts and choice lengths (single-token choices score nothing past their first token)."""
    from worker.fastpath.scoring import layout

    generator = torch.Generator().manual_seed(11)
    for trial in range(20):
        rows = []
        for _ in range(1 + trial % 7):
            prompt = int(torch.randint(1, 12, (1,), generator=generator))
            choices = tuple(
                tuple(int(t) for t in torch.randint(3, 90, (int(torch.randint(1, 5, (1,), generator=generator)),)))
                for _ in range(int(torch.randint(1, 4, (1,), generator=generator)))
            )
            rows.append(ScoreRow(ids=[7] * prompt, choices=choices, adapter=None))
        width = max(len(r.ids) for r in rows) + trial % 3
        span = max(r.choice_tokens for r in rows) + trial % 2
        host = layout(rows, width, span)
        tokens, positions, mask, scored = reference_layout(rows, width, span)
        assert torch.equal(torch.from_numpy(host.tokens), tokens)
        assert torch.equal(torch.from_numpy(host.positions), positions)
        assert torch.equal(torch.from_numpy(host.mask), mask)
        fields = zip(host.rows, host.columns, host.targets, host.owners, strict=True)
        got = [(r, c, t, *owner) for r, c, t, owner in fields]
        assert got == [tuple(x) for x in scored.tolist()]
