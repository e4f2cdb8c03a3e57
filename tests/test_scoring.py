"""Choice scoring on the static loop: each prompt encoded once, its choices run beside it inside the prefill."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    decoder.prefill.tokens = 40  # several prefill chunks
    try:
        scored = decoder.score(rows, pad_id=base.tokenizer.pad_token_id)
    finally:
        decoder.prefill.tokens = 4096
    assert scored is not None
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


def scored_rows(engine: Engine, count: int) -> list[ScoreRow]:
    jobs = [
        Job(custom_id=str(i), model=("kev", "laya")[i % 2], prompt=PROMPTS[i % 5], choices=CHOICES[: 1 + i % 4])
        for i in range(count)
    ]
    items = [engine.encoder.encode(job, index=i) for i, job in enumerate(jobs)]
    return [ScoreRow(ids=it.ids, choices=engine.choices.ids(it.job), adapter=it.adapter) for it in items]


def test_scores_are_the_same_whatever_the_head_slices(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The LM head runs a slice of rows (first tokens) and of positions (later tokens) at a time, and the picked
    log-probabilities come back in one read: slices of any size give every choice the same sum (a slip in the
    bookkeeping would give a choice another's tokens)."""
    from worker.fastpath import scoring

    decoder = engine.decoders["default"]
    pad_id = engine.base_for("kev").tokenizer.pad_token_id
    rows = scored_rows(engine, 9)
    whole = decoder.score(rows, pad_id=pad_id)
    assert whole is not None
    for first, later in ((1, 1), (2, 3), (5, 128)):
        monkeypatch.setattr(scoring, "CHOICE_CHUNK_ROWS", first)
        monkeypatch.setattr(scoring, "LOGIT_ROWS", later)
        got = decoder.score(rows, pad_id=pad_id)
        assert got is not None
        for want_row, got_row in zip(whole.loglik, got.loglik, strict=True):
            assert got_row == pytest.approx(want_row, abs=1e-5)


def test_the_last_layer_scores_from_the_last_prompt_position_and_the_choices_alone(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past attention, the last layer runs each scoring chunk's rows at one prompt position and their choice
    tokens only, (rows, 1 + T); every other layer at the chunk's every position. The scores stay those of the
    plain log-likelihood (`test_choice_scores_equal_a_plain_log_likelihood`)."""
    decoder = engine.decoders["default"]
    stack = decoder.stack
    index = {id(layer): i for i, layer in enumerate(stack.layers)}
    seen: list[tuple[int, tuple[int, ...]]] = []
    mlp = stack.mlp

    def record(layer: Any, h: torch.Tensor, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append((index[id(layer)], tuple(x.shape[:2])))
        return mlp(layer, h, x, *args, **kwargs)

    monkeypatch.setattr(stack, "mlp", record)
    rows = scored_rows(engine, 9)
    pad_id = engine.base_for("kev").tokenizer.pad_token_id
    assert decoder.score(rows, pad_id=pad_id) is not None
    chunks = decoder.prefill.chunk_rows(rows, decoder.prefill.chunk_tokens(), [r.choice_tokens for r in rows])
    widths = [max(rows[i].choice_tokens for i in c) for c in chunks]
    spans = [max(len(rows[i].ids) for i in c) for c in chunks]
    last = len(stack.layers) - 1
    want = sorted((len(c), 1 + w) for c, w in zip(chunks, widths, strict=True))
    assert sorted(shape for i, shape in seen if i == last) == want
    first = sorted(shape for i, shape in seen if i == 0)
    assert first == sorted((len(c), s + w) for c, s, w in zip(chunks, spans, widths, strict=True))


def test_scoring_needs_no_kv_pool_and_leaves_the_loops_state_alone(engine: Engine) -> None:
    """Scored rows keep nothing in a cache: a scoring take allocates no KV pool, and after a generation take
    the pool it left (and the graphs' state over it) is the same buffer afterwards."""
    decoder = engine.decoders["default"]
    decoder.release()
    pad_id = engine.base_for("kev").tokenizer.pad_token_id
    assert decoder.score(scored_rows(engine, 5), pad_id=pad_id) is not None
    assert decoder.pool.buffer is None
    engine.run([Job(custom_id="g", model="laya", prompt="Approve?", max_new_tokens=3)])
    pool = decoder.pool.buffer
    assert pool is not None
    assert decoder.score(scored_rows(engine, 5), pad_id=pad_id) is not None
    assert decoder.pool.buffer is pool


def test_a_chunk_counts_its_rows_choices_among_its_tokens(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Short prompts with long choices: each prefill chunk's padded prompts and padded choices together stay
    within the chunk's tokens (a chunk of a single row excepted), so the choices' activations are within what
    the planner sets aside for a chunk; and a layer-major group's chunks, choices included, within the group's
    tokens (a group of a single chunk excepted), so are its held states."""
    from worker.fastpath.prefill import Prefill

    prefill: Prefill = engine.decoders["default"].prefill
    rows = [ScoreRow(ids=[5] * (3 + i % 7), choices=((6,) * (1 + i % 11), (7, 8)), adapter=None) for i in range(40)]
    tails = [r.choice_tokens for r in rows]
    for limit in (16, 40, 100):
        chunks = prefill.chunk_rows(rows, limit, tails)
        assert sorted(i for c in chunks for i in c) == list(range(len(rows)))

        def padded(chunk: list[int]) -> int:
            return len(chunk) * (max(len(rows[i].ids) for i in chunk) + max(tails[i] for i in chunk))

        assert all(padded(chunk) <= limit or len(chunk) == 1 for chunk in chunks)
        monkeypatch.setattr(prefill, "group_tokens", 2 * limit)
        groups = prefill.layer_groups(rows, limit, tails)
        assert [c for g in groups for c in g] == chunks and len(groups) > 1
        assert all(sum(map(padded, group)) <= 2 * limit or len(group) == 1 for group in groups)


def reference_layout(rows: list[ScoreRow], span: int) -> tuple[torch.Tensor, ...]:
    """A chunk's choice layout token by token: tokens, positions, mask over the prompt (each row's real tokens
    first, right-padded to `span`) and the choices, each choice's first token, and the later scored (row,
    column, target, owner) of each position."""
    n = len(rows)
    width = max(r.choice_tokens for r in rows)
    tokens = torch.zeros((n, width), dtype=torch.long)
    positions = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width, span + width), dtype=torch.bool)
    heads: list[tuple[int, int, int, int]] = []
    scored: list[tuple[int, int, int, int, int]] = []
    for r, row in enumerate(rows):
        prompt = len(row.ids)
        mask[r, :, :prompt] = True
        start = 0
        for c, choice in enumerate(row.choices):
            m = len(choice)
            tokens[r, start : start + m] = torch.tensor(choice)
            positions[r, start : start + m] = torch.arange(prompt, prompt + m)
            mask[r, start : start + m, span + start : span + start + m] = torch.ones(m, m, dtype=torch.bool).tril()
            heads.append((choice[0], r, 10 * r, c))
            scored += [(r, start + o, choice[o + 1], 10 * r, c) for o in range(m - 1)]
            start += m
    return (
        tokens,
        positions,
        mask,
        torch.tensor(heads, dtype=torch.long).reshape(-1, 4),
        torch.tensor(scored, dtype=torch.long).reshape(-1, 5),
    )


def test_the_choice_layout_built_at_once_is_the_token_by_token_one() -> None:
    """`tail_layout` (numpy, a chunk at a time) against the token-by-token reference, on rows of different prompt
    lengths, choice counts and choice lengths (single-token choices score nothing past their first token)."""
    from worker.fastpath.scoring import tail_layout

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
        span = max(len(r.ids) for r in rows) + trial % 3
        host = tail_layout(rows, [10 * r for r in range(len(rows))], span)
        tokens, positions, mask, heads, scored = reference_layout(rows, span)
        assert torch.equal(torch.from_numpy(host.tokens), tokens)
        assert torch.equal(torch.from_numpy(host.positions), positions)
        assert torch.equal(torch.from_numpy(host.mask), mask)
        got_heads = [(t, r, *o) for t, r, o in zip(host.heads, host.head_rows, host.head_owners, strict=True)]
        assert got_heads == [tuple(x) for x in heads.tolist()]
        fields = zip(host.rows, host.columns, host.targets, host.owners, strict=True)
        got = [(r, c, t, *owner) for r, c, t, owner in fields]
        assert got == [tuple(x) for x in scored.tolist()]


def test_a_choice_job_about_to_be_taken_sizes_the_next_take_for_scoring(engine: Engine) -> None:
    """`expect` of a job that scores choices on the loop plans the model's next take for scored rows (no
    cache), one that generates for generation; it says when the sizing changed."""
    scoring = Job(custom_id="s", model="laya", prompt="Approve?", choices=("yes", "no"))
    generating = Job(custom_id="g", model="laya", prompt="Approve?")
    engine.expect(generating)
    assert engine.expect(scoring) is True
    assert engine._scored_tokens["laya"] == engine.choices.count(scoring)
    assert engine.expect(scoring) is False
    assert engine.expect(generating) is True and "laya" not in engine._scored_tokens


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 2)])
def test_a_chunks_attention_with_its_choices_is_attention_over_repeated_kv(heads: int, kv_heads: int) -> None:
    """`Prefill._with_tail` on a mask from `additive_mask` (rows aligned), for one, two and three query heads a
    KV head: the prompts' queries causal over the prompts, each choice token over its row's prompt and its own
    choice's earlier tokens -- as plain attention over K/V repeated to every query head with the bool mask."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from worker.fastpath.ops import repeat_kv
    from worker.fastpath.prefill import ChunkTail, Prefill
    from worker.fastpath.scoring import additive_mask, tail_layout
    from worker.memory import MASK_ALIGN

    rows = [
        ScoreRow(ids=[1] * 5, choices=((3, 4), (5,)), adapter=None),
        ScoreRow(ids=[1] * 2, choices=((6, 7, 8),), adapter=None),
        ScoreRow(ids=[1] * 7, choices=((9,), (10,), (11, 12)), adapter=None),
    ]
    span, dim, groups = 7, 8, heads // kv_heads
    layout = tail_layout(rows, [0, 1, 2], span)
    mask = additive_mask(layout.mask, groups, torch.float32, torch.device("cpu"))
    assert mask.stride(-2) % MASK_ALIGN == 0
    prefill = Prefill.__new__(Prefill)
    prefill.stack = SimpleNamespace(heads=heads, kv_heads=kv_heads, head_dim=dim, groups=groups)
    tail = ChunkTail(tokens=layout.tokens, positions=layout.positions, mask=mask)
    n, length = len(rows), span + tail.width
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(n, heads, length, dim, generator=generator)
    k, v = (torch.randn(n, kv_heads, length, dim, generator=generator) for _ in range(2))
    got = prefill._with_tail(tail, q, k, v, span, 0.3)
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    prompt = F.scaled_dot_product_attention(q[:, :, :span], k[:, :, :span], v[:, :, :span], is_causal=True, scale=0.3)
    seen = torch.from_numpy(layout.mask)[:, None]
    choices = F.scaled_dot_product_attention(q[:, :, span:], k, v, attn_mask=seen, scale=0.3)
    want = torch.cat((prompt, choices), dim=2).transpose(1, 2).reshape(n, length, heads * dim)
    assert torch.allclose(got, want, atol=1e-5)


def test_choices_of_one_token_each_are_scored_by_their_first_token_alone(engine: Engine) -> None:
    """Rows whose choices are one token each (a chunk with no later token to score): each choice's score is
    that token's log-probability after the prompt."""
    decoder = engine.decoders["default"]
    base = engine.base_for("laya")
    items = [engine.encoder.encode(Job(custom_id=str(i), model="laya", prompt=PROMPTS[i])) for i in range(3)]
    rows = [ScoreRow(ids=it.ids, choices=((5,), (9,), (17,)), adapter=it.adapter) for it in items]
    scored = decoder.score(rows, pad_id=base.tokenizer.pad_token_id)
    assert scored is not None and scored.bad == [False] * 3
    for row, got in zip(rows, scored.loglik, strict=True):
        want = [reference(engine, "laya", row.ids, c) for c in row.choices]
        assert got == pytest.approx(want, abs=2e-4, rel=1e-4)
