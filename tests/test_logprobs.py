"""Per-token logprobs (`logprobs`, `top_logprobs` on a job) from the same forward passes, on the static loop and on
HF generate: the model's own log-probabilities, the k most likely tokens sorted, and nothing else changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.fastpath import TokenRecorder
from shared.job import Job
from shared.result import Result, TokenLogprob
from tests.conftest import tiny_config
from worker.loading import select_adapters
from worker.outputs import token_bytes

PROMPTS = ["Approve a loan of 12000?", "Income 52000, debt low.", "不确定的情况", "x", "Step 1: check income " * 7]


@pytest.fixture(scope="module")
def engines(tiny_models: Path) -> dict[str, TokenRecorder]:
    static = TokenRecorder(tiny_config(tiny_models, "none", laya_new=16), device="cpu", decode="static")
    eager = TokenRecorder(static.config, device="cpu", decode="eager", bases=static.bases)
    return {"static": static, "eager": eager}


@pytest.fixture(params=["static", "eager"])
def engine(request: pytest.FixtureRequest, engines: dict[str, TokenRecorder]) -> TokenRecorder:
    return engines[request.param]


def asking(cid: str, model: str = "laya", prompt: str = PROMPTS[0], top: int = 5, **kw: object) -> Job:
    return Job(custom_id=cid, model=model, prompt=prompt, logprobs=True, top_logprobs=top, **kw)


def reference(engine: TokenRecorder, job: Job) -> torch.Tensor:
    """log_softmax of a plain HF forward pass over the prompt and the row's answer tokens: (answer tokens, vocab)."""
    base = engine.base_for(job.model)
    prompt = engine.encoder.encode(job).ids
    answer = engine.tokens[job.custom_id]
    ids = torch.tensor([prompt + answer])
    with select_adapters(base, [base.adapters[job.model]]), torch.inference_mode():
        logits = base.model(input_ids=ids).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(answer)].log_softmax(-1)


def check_against_reference(engine: TokenRecorder, job: Job, entries: list[TokenLogprob]) -> None:
    want = reference(engine, job)
    answer = engine.tokens[job.custom_id]
    tokens = token_bytes(engine.base_for(job.model).tokenizer)
    assert 0 < len(entries) <= len(answer)
    for step, entry in enumerate(entries):
        token = answer[step]
        assert entry.bytes == list(tokens(token))
        assert entry.logprob == pytest.approx(float(want[step, token]), abs=1e-4)
        values, ids = want[step].topk(job.top_logprobs)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert [t.bytes for t in entry.top_logprobs] == [list(tokens(i)) for i in ids.tolist()]


def test_greedy_logprobs_are_the_models_own(engine: TokenRecorder) -> None:
    jobs = [asking("a"), asking("b", model="kev", prompt=PROMPTS[1]), asking("c", prompt=PROMPTS[2])]
    for job, out in zip(jobs, engine.run(jobs), strict=True):
        assert out.error is None and out.logprobs is not None
        check_against_reference(engine, job, out.logprobs)
        # The answer's tokens, in order: their bytes are the text's (a multi-byte character may span tokens).
        assert b"".join(bytes(e.bytes or []) for e in out.logprobs).decode("utf-8", "replace") == out.text


def test_top_logprobs_are_sorted_hold_k_and_the_greedy_choice(engine: TokenRecorder) -> None:
    jobs = [asking(f"k{k}", top=k, prompt=PROMPTS[k % 5]) for k in range(6)]
    for job, out in zip(jobs, engine.run(jobs), strict=True):
        assert out.logprobs
        for entry in out.logprobs:
            top = entry.top_logprobs
            assert len(top) == job.top_logprobs
            assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
            if top:
                assert entry.bytes in [t.bytes for t in top]
                assert top[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the most likely


def test_a_sampled_rows_logprobs_are_the_models_own_too(engines: dict[str, TokenRecorder]) -> None:
    """Before temperature and top-k, as HF's processors see them: the same on both paths."""
    for engine in engines.values():
        job = asking("s", model="kev", prompt=PROMPTS[4], temperature=1.5, top_k=20, seed=5, top=2)
        (out,) = engine.run([job])
        assert out.error is None and out.logprobs
        check_against_reference(engine, job, out.logprobs)


def test_rows_that_ask_change_nothing_for_their_batch_mates(engine: TokenRecorder) -> None:
    plain = [Job(custom_id=f"p{i}", model=("kev", "laya")[i % 2], prompt=PROMPTS[i % 5]) for i in range(6)]
    sampled = Job(custom_id="s", model="laya", prompt=PROMPTS[3], temperature=1.2, seed=9)
    before = engine.run([*plain, sampled])
    tokens = {j.custom_id: engine.tokens[j.custom_id] for j in plain}
    sampled_tokens = engine.tokens["s"]
    mixed = [plain[0], asking("a0", top=3), *plain[1:4], asking("a1", model="kev", top=0), *plain[4:], sampled]
    after = engine.run(mixed)
    by_id = {j.custom_id: out for j, out in zip(mixed, after, strict=True)}
    for job, out in zip(plain, before[: len(plain)], strict=True):
        assert by_id[job.custom_id].text == out.text and by_id[job.custom_id].logprobs is None
        assert engine.tokens[job.custom_id] == tokens[job.custom_id]
    if engine.decoders:  # on the static loop a seeded row draws the same whatever its batch-mates ask for
        assert engine.tokens["s"] == sampled_tokens
    # The rows that asked answer as they would without asking.
    for cid in ("a0", "a1"):
        job = next(j for j in mixed if j.custom_id == cid)
        (alone,) = engine.run([Job(custom_id=cid, model=job.model, prompt=job.prompt)])
        assert by_id[cid].text == alone.text and by_id[cid].confidence == pytest.approx(alone.confidence, rel=1e-5)
        assert by_id[cid].logprobs and alone.logprobs is None


def test_a_batch_without_logprobs_runs_the_graph_it_always_did(engines: dict[str, TokenRecorder]) -> None:
    static = engines["static"]
    decoder = next(iter(static.decoders.values()))
    decoder.release()
    static.run([Job(custom_id=f"g{i}", model="laya", prompt=PROMPTS[i]) for i in range(3)])
    assert {key.logprob_slots for key in decoder.graphs.entries} == {0}
    static.run([asking("a"), Job(custom_id="g", model="laya", prompt=PROMPTS[1])])
    assert {key.logprob_slots for key in decoder.graphs.entries} == {0, 8}  # one asking row: 8 slots, as sampling


def test_rows_that_ask_normalise_only_their_own_logits(
    engines: dict[str, TokenRecorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch with rows reporting logprobs chooses every row's token the way a batch without them does (the
    greedy choice, a chunk of rows in float32 at a time, or the fused kernel), and converts only the asking slots'
    logits: converting every row's at once, the plan set aside float32 logits for every row of such a take."""
    import worker.fastpath.decoder as decoder_module
    import worker.fastpath.logprobs as logprobs_module

    static = engines["static"]
    chosen: list[int] = []
    recorded: list[int] = []
    greedy, record = decoder_module.greedy_choice, logprobs_module.LogprobState.record

    def spy_greedy(logits: torch.Tensor, end_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        chosen.append(logits.shape[0])
        return greedy(logits, end_id)

    def spy_record(self: object, logits: torch.Tensor, token: torch.Tensor, step: torch.Tensor) -> None:
        recorded.append(logits.shape[0])
        record(self, logits, token, step)

    monkeypatch.setattr(decoder_module, "greedy_choice", spy_greedy)
    monkeypatch.setattr(logprobs_module.LogprobState, "record", spy_record)
    jobs = [asking("a", top=2), *(Job(custom_id=f"g{i}", model="laya", prompt=PROMPTS[i]) for i in range(1, 4))]
    out = static.run(jobs)
    assert chosen and recorded  # every step's choice went the greedy way, the first token's included
    assert out[0].logprobs and all(o.logprobs is None for o in out[1:])
    check_against_reference(static, jobs[0], out[0].logprobs)


def test_logprobs_round_trip_through_the_result_record(engine: TokenRecorder) -> None:
    (out,) = engine.run([asking("r", top=2)])
    assert out.logprobs
    result = Result(custom_id="r", model="laya", job_id="j", text=out.text, logprobs=out.logprobs)
    back = Result.from_json(result.to_json())
    assert back == result
    first = result.to_dict()["logprobs"][0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
