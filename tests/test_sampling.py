"""Sampling in the static loop: per-row temperature / top-p / top-k, seeded per row, beside greedy rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.fastpath import TokenRecorder
from shared.job import Job
from tests.conftest import tiny_config
from worker.fastpath.decoder import MIN_SAMPLER_SLOTS
from worker.fastpath.sampling import Sampling, SamplingState, sample, uniform

PROMPTS = ["Approve a loan of 12000?", "Income 52000, debt low.", "不确定的情况", "x", "Step 1: check income " * 7]


@pytest.fixture(scope="module")
def static(tiny_models: Path) -> TokenRecorder:
    return TokenRecorder(tiny_config(tiny_models, "none", laya_new=16), device="cpu", decode="static")


def sampled(cid: str, model: str = "laya", prompt: str = PROMPTS[0], **kw: object) -> Job:
    return Job(custom_id=cid, model=model, prompt=prompt, **{"temperature": 1.5, "seed": 11, **kw})


def greedy(n: int) -> list[Job]:
    return [Job(custom_id=f"g{i}", model=("kev", "laya")[i % 2], prompt=PROMPTS[i % 5] + f" {i}") for i in range(n)]


def test_a_seeded_row_draws_the_same_tokens_alone_and_in_any_batch(static: TokenRecorder) -> None:
    """Batch-mates (greedy rows, other seeds, rows cutting to top-k / top-p, the other adapter) and the row's
    position in the batch do not change a seeded row's tokens; greedy rows are unchanged beside sampled ones."""
    row = sampled("s")
    alone = static.run([row])[0]
    assert alone.error is None
    want = static.tokens["s"]
    assert len(want) > 3
    others = [
        sampled("o1", seed=12),
        sampled("o2", model="kev", top_k=5, seed=3),
        sampled("o3", top_p=0.5, seed=4, prompt=PROMPTS[2]),
    ]
    plain = greedy(6)
    static.run(plain)
    greedy_tokens = {j.custom_id: static.tokens[j.custom_id] for j in plain}
    for batch in ([*plain[:3], row, *others, *plain[3:]], [*others, *plain, row]):
        outs = static.run(batch)
        assert all(o.error is None for o in outs)
        assert static.tokens["s"] == want
        assert {j.custom_id: static.tokens[j.custom_id] for j in plain} == greedy_tokens
    decoder = next(iter(static.decoders.values()))
    # Ran in the loop, not HF generate: 4 sampled rows of 10 drew in the fewest sampler slots a graph has.
    assert any(key.samplers == MIN_SAMPLER_SLOTS and key.filtered for key in decoder.graphs.entries)


def test_seeds_and_cuts_change_the_draw_as_they_should(static: TokenRecorder) -> None:
    first = [sampled(f"seed{s}", seed=s, prompt=PROMPTS[4]) for s in range(4)]
    cut = [sampled("k1", top_k=1, prompt=PROMPTS[4]), sampled("p0", top_p=1e-6, prompt=PROMPTS[4])]
    plain = Job(custom_id="g", model="laya", prompt=PROMPTS[4])
    static.run([*first, *cut, plain])
    draws = {tuple(static.tokens[j.custom_id]) for j in first}
    assert len(draws) > 1  # different seeds, different draws (temperature 1.5 on a random-weight model)
    # Top-1 and a vanishing nucleus keep only the most likely token: the greedy answer.
    assert static.tokens["k1"] == static.tokens["p0"] == static.tokens["g"]


def test_an_unseeded_sampled_row_still_runs_in_the_loop(static: TokenRecorder) -> None:
    outs = static.run([Job(custom_id="u", model="laya", prompt="hello", temperature=0.8)])
    assert outs[0].error is None and outs[0].completion_tokens >= 1


def _params(rows: list[Sampling | None], vocab: int) -> SamplingState:
    state = SamplingState(len(rows), len(rows), torch.device("cpu"))
    state.reset(rows, vocab)
    return state


def test_draws_follow_the_distribution_and_respect_the_cuts() -> None:
    """Over many seeds, the tokens drawn follow softmax(logits / T), and cut ones never appear."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n, temperature = 6000, 0.7
    rows = [Sampling(temperature=temperature, seed=s) for s in range(n)]
    step = torch.tensor([3])
    tokens, logprobs = sample(logits.expand(n, -1).clone(), _params(rows, 6), step, filtered=False)
    want = torch.softmax(logits / temperature, dim=-1)
    got = torch.bincount(tokens, minlength=6).float() / n
    assert torch.allclose(got, want, atol=0.02)
    torch.testing.assert_close(logprobs, want.log()[tokens])
    cut = [Sampling(temperature=temperature, seed=s, top_k=2) for s in range(n)]
    tokens, logprobs = sample(logits.expand(n, -1).clone(), _params(cut, 6), step, filtered=True)
    assert set(tokens.tolist()) == {0, 1}
    torch.testing.assert_close(logprobs, torch.softmax(logits[:2] / temperature, -1).log()[tokens])
    nucleus = [Sampling(temperature=1.0, seed=s, top_p=0.75) for s in range(n)]  # p = .61, .22, .14, ...
    tokens, _ = sample(logits.expand(n, -1).clone(), _params(nucleus, 6), step, filtered=True)
    assert set(tokens.tolist()) == {0, 1}  # .61 < .75, .61 + .22 >= .75: the first two


def test_uniforms_depend_on_seed_and_step_only() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 5, 2**40])
    a = uniform(seeds, torch.tensor([7]))
    assert ((a > 0) & (a < 1)).all()
    assert torch.equal(uniform(seeds[2:3], torch.tensor([7])), a[2:3])  # alone = in a batch
    assert not torch.equal(uniform(seeds, torch.tensor([8])), a)
    assert len(set(a.tolist())) == 4


def test_hf_generate_runs_each_sampling_setting_on_its_own(static: TokenRecorder) -> None:
    """Where the loop cannot run (here `--decode eager`), a batch mixing greedy and sampled rows is split into
    one HF generate call per setting: a seeded row's tokens then do not depend on its batch-mates either."""
    eager = TokenRecorder(static.config, device="cpu", decode="eager", bases=static.bases)
    row = sampled("e")
    eager.run([row])
    want = eager.tokens["e"]
    plain = greedy(3)
    eager.run(plain)
    greedy_tokens = {j.custom_id: eager.tokens[j.custom_id] for j in plain}
    outs = eager.run([plain[0], row, *plain[1:]])
    assert all(o.error is None for o in outs)
    assert eager.tokens["e"] == want
    assert {j.custom_id: eager.tokens[j.custom_id] for j in plain} == greedy_tokens


def test_greedy_choice_in_chunks_of_rows_gives_the_whole_batchs_numbers() -> None:
    """Token choice converts a few rows' logits to float32 at a time (memory for more rows): the tokens,
    log-probabilities and finiteness flags equal one conversion of the whole batch, non-finite rows included."""
    from worker.fastpath.sampling import greedy_choice

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(37, 101, generator=gen) * 4).to(torch.bfloat16)
    logits[5, 7] = float("nan")
    logits[30, 0] = float("inf")
    whole = greedy_choice(logits, 99, chunk_rows=logits.shape[0])
    for chunk_rows in (1, 8, 32):
        parts = greedy_choice(logits, 99, chunk_rows=chunk_rows)
        for got, want in zip(parts, whole, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    token, logprob, finite = whole
    assert token[5] == 99 and token[30] == 99 and not finite[5] and not finite[30]
    reference = logits[0].float().log_softmax(dim=-1)
    assert token[0] == reference.argmax() and logprob[0] == reference.max()
