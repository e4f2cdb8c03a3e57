"""Adversarial edge cases of the shared prompt prefix (worker/fastpath/prefix.py) through prefill, generation and
choice scoring: each take run with the decoder's prefix cache against the same rows run with sharing off
(`PrefixCache(min_tokens=0)`), and choice scores against HF's plain log-likelihood. No bug was found by these;
they pin the behaviour the review checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shared.job import Job
from tests.conftest import tiny_config
from tests.test_prefill import bf16_config
from worker.engine import Engine
from worker.fastpath import DecodeRow, Sampling, ScoreRow
from worker.fastpath.prefill import Prefill
from worker.fastpath.prefix import MAX_TOKENS, PrefixCache
from worker.loading import select_adapters

PREFIX = [(5 * t) % 40 + 3 for t in range(20)]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request: pytest.FixtureRequest, tiny_models: Path) -> Engine:
    config = tiny_config(tiny_models, "none") if request.param == "float32" else bf16_config(tiny_models, "none")
    return Engine(config, device="cpu", decode="static")


def own(i: int, n: int) -> list[int]:
    return [(7 * i + 3 * t) % 50 + 3 for t in range(n)]


def bf16(engine: Engine) -> bool:
    return engine.decoders["default"].stack.dtype == torch.bfloat16


def decoded(engine: Engine, rows: list[DecodeRow], *, share: bool) -> Any:
    decoder, base = engine.decoders["default"], engine.bases["default"]
    kept = decoder.prefill.prefixes
    if not share:
        decoder.prefill.prefixes = PrefixCache(min_tokens=0)
    try:
        return decoder.decode(rows, stop_ids=[-1], pad_id=0, select=lambda names: select_adapters(base, names))
    finally:
        decoder.prefill.prefixes = kept


def scored(engine: Engine, rows: list[ScoreRow], *, share: bool) -> Any:
    decoder = engine.decoders["default"]
    kept = decoder.prefill.prefixes
    if not share:
        decoder.prefill.prefixes = PrefixCache(min_tokens=0)
    try:
        return decoder.score(rows, pad_id=0)
    finally:
        decoder.prefill.prefixes = kept


def assert_same_decode(engine: Engine, rows: list[DecodeRow]) -> None:
    a, b = decoded(engine, rows, share=True), decoded(engine, rows, share=False)
    tol = 5e-2 if bf16(engine) else 1e-3
    torch.testing.assert_close(a.logprobs[:, 0], b.logprobs[:, 0], atol=tol, rtol=tol)
    if not bf16(engine):  # bfloat16: the prefix's separate matmuls round differently, later tokens may part
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=tol, rtol=tol)


def hf_loglik(engine: Engine, adapter: str | None, prompt: list[int], choice: tuple[int, ...]) -> float:
    base = engine.bases["default"]
    with select_adapters(base, [adapter]), torch.inference_mode():
        logp = base.model(input_ids=torch.tensor([prompt + list(choice)])).logits[0].float().log_softmax(-1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(choice))


def assert_same_scores(engine: Engine, rows: list[ScoreRow]) -> None:
    a, b = scored(engine, rows, share=True), scored(engine, rows, share=False)
    tol = 5e-2 if bf16(engine) else 2e-4
    for row, x, y in zip(rows, a.loglik, b.loglik, strict=True):
        assert x == pytest.approx(y, abs=tol, rel=tol)
        if not bf16(engine):
            assert x == pytest.approx([hf_loglik(engine, row.adapter, row.ids, c) for c in row.choices], abs=5e-4)


@pytest.fixture
def fresh(engine: Engine) -> Any:
    decoder = engine.decoders["default"]
    decoder.prefill.prefixes = PrefixCache()
    yield decoder
    decoder.prefill.tokens, decoder.prefill.group_tokens = 4096, 32768
    decoder.prefill.prefixes = PrefixCache()


def test_a_row_that_is_the_kept_prefix_gets_a_shorter_one_not_an_empty_suffix(engine: Engine, fresh: Any) -> None:
    assert_same_decode(engine, [DecodeRow(ids=PREFIX + own(i, 3 + i), max_new=3, adapter="kev") for i in range(3)])
    assert [p.length for p in fresh.prefill.prefixes._made.values()] == [20]
    rows = [
        DecodeRow(ids=list(PREFIX), max_new=4, adapter="kev"),  # the kept prefix exactly
        DecodeRow(ids=PREFIX + own(1, 1), max_new=2, adapter="kev"),
        DecodeRow(ids=PREFIX + own(2, 6), max_new=5, adapter="kev", sampling=Sampling(temperature=0.8, seed=3)),
    ]
    assert_same_decode(engine, rows)
    assert_same_scores(engine, [ScoreRow(ids=r.ids, choices=((5, 6), (5,), (9, 1, 2, 3)), adapter="kev") for r in rows])
    assert sorted(p.length for p in fresh.prefill.prefixes._made.values()) == [19, 20]


@pytest.mark.parametrize("tokens", [12, 20, 21, 40, 41, 60])  # below the prefix, and chunks split at exact rows
def test_identical_prompts_and_one_token_suffixes_at_chunk_boundaries(engine: Engine, fresh: Any, tokens: int) -> None:
    fresh.prefill.tokens = tokens
    for lengths in ([1, 1, 1, 1], [20, 20], [19, 20, 21], [1, 39, 40]):
        rows = [DecodeRow(ids=PREFIX + own(i, n), max_new=1 + i, adapter="laya") for i, n in enumerate(lengths)]
        assert_same_decode(engine, rows)
        assert_same_scores(engine, [ScoreRow(ids=r.ids, choices=((3, 4, 5), (3,)), adapter="laya") for r in rows])
    same = [DecodeRow(ids=PREFIX + own(0, 1), max_new=3, adapter="laya")] * 4
    assert_same_decode(engine, same)


def test_a_prefix_longer_than_max_tokens_is_cut_and_long_prompts_run_after_it(engine: Engine, fresh: Any) -> None:
    document = [7 + t % 90 for t in range(MAX_TOKENS + 90)]
    rows = [DecodeRow(ids=document + own(i, n), max_new=2, adapter=None) for i, n in enumerate([1, 700, 2000])]
    assert_same_decode(engine, rows)
    assert [p.length for p in fresh.prefill.prefixes._made.values()] == [MAX_TOKENS]


def test_takes_alternating_adapters_kinds_and_partly_shared_prefixes(engine: Engine, fresh: Any) -> None:
    fresh.prefill.tokens = 30
    choices = ((5,), (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16), (5, 6), (40, 2))  # first tokens coincide
    for adapter in ("kev", "laya", "kev", None):
        rows = [DecodeRow(ids=PREFIX + own(i, 1 + 3 * i), max_new=1 + i, adapter=adapter) for i in range(4)]
        assert_same_decode(engine, rows)
        assert_same_scores(
            engine, [ScoreRow(ids=r.ids, choices=choices[: 1 + i], adapter=adapter) for i, r in enumerate(rows)]
        )
        part = [ScoreRow(ids=PREFIX[:17] + own(9 + i, 2), choices=choices[1:3], adapter=adapter) for i in range(3)]
        assert_same_scores(engine, part)  # shares only part of the kept one
    made = {(p.adapter, p.length) for p in fresh.prefill.prefixes._made.values()}
    assert made == {("kev", 20), ("laya", 20), (None, 20), ("kev", 17), ("laya", 17), (None, 17)}


def test_after_release_the_prefix_is_made_again_with_the_same_results(engine: Engine, fresh: Any) -> None:
    rows = [DecodeRow(ids=PREFIX + own(i, 2 + i), max_new=3, adapter="kev") for i in range(3)]
    first = decoded(engine, rows, share=True)
    fresh.release()
    assert not fresh.prefill.prefixes._made
    again = decoded(engine, rows, share=True)
    assert fresh.prefill.prefixes.made == 2
    assert torch.equal(first.tokens, again.tokens)


@pytest.mark.parametrize("where", ["_prefix_layer", "_layer"])
@pytest.mark.parametrize("kind", ["generate", "score"])
def test_out_of_memory_while_a_prefix_is_made_keeps_nothing_half_made(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch, where: str, kind: str
) -> None:
    config = tiny_config(tiny_models, "none")
    reference = Engine(config, device="cpu", decode="static")
    engine = Engine(config, device="cpu", decode="static", bases=reference.bases)
    prompts = ["Approve a loan of 12000?", "Income 52000, debt low.", "x", "Step 1: check income " * 3]
    extra: dict[str, Any] = {"choices": ("approve", "reject now", "need more review")} if kind == "score" else {}
    jobs = [Job(custom_id=str(i), model="kev", prompt=prompts[i % 4], max_new_tokens=2 + i, **extra) for i in range(6)]
    want = reference.run(jobs)
    real = getattr(Prefill, where)
    calls = [0]

    def flaky(self: Prefill, i: int, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:  # the second layer, the prefix half made
            raise torch.OutOfMemoryError("simulated")
        return real(self, i, *args, **kwargs)

    monkeypatch.setattr(Prefill, where, flaky)
    got = engine.run(jobs)
    decoder = engine.decoders["default"]
    assert engine.guard.count == 1
    assert all(p.made(len(decoder.stack.layers)) for p in decoder.prefill.prefixes._made.values())
    for a, b in zip(want, got, strict=True):
        assert a.error is None and b.error is None and a.text == b.text
        for k in a.choices or {}:
            assert b.choices[k] == pytest.approx(a.choices[k], abs=1e-4)


def test_kept_prefixes_alone_count_as_memory_a_release_frees(engine: Engine, fresh: Any) -> None:
    """The out-of-memory guard retries a batch once only where releasing freed something: kept prefixes (their K/V
    outside the plan) with no pool or graphs must count, and go with the release."""
    decoded(engine, [DecodeRow(ids=PREFIX + own(i, 3 + i), max_new=2, adapter="kev") for i in range(3)], share=True)
    assert len(fresh.prefill.prefixes) == 1
    fresh.graphs.clear()
    fresh.pool.release()
    assert fresh.holds_memory()
    fresh.release()
    assert not fresh.holds_memory() and len(fresh.prefill.prefixes) == 0
