"""A seeded randomized differential test of the engine's fast path (the static loop: its own layer-major prefill,
shared prompt prefixes, choice scoring in the prefill, per-row sampling, stop tokens, per-row limits) against the
reference path, in float32 on the tiny models.

Each seed builds a random take: Kev and Laya rows together, prompts under a few shared headers (prefixes past
the templates) and unique ones, from one token (Laya's template here is the bare prompt) to the model's input
limit and past it (with and without `truncate`), per-row `max_new_tokens`, `choices` with labels of different
token lengths (some sharing their first token, unicode ones), seeded sampled rows beside greedy rows, rows asking
for logprobs, and extra configured stop tokens the random models do emit; on two layouts: Kev and Laya each on
its adapter, and Laya on the bare base beside Kev's adapter (both on bare-prompt templates). Then:

- greedy rows: tokens identical to HF generate (the eager engine) on the same rows, confidence within float32
  rounding;
- choice rows: each choice's probability equal to the softmax of a plain per-sequence log-likelihood (one
  unpadded forward pass a prompt + choice, summed in float64);
- every row, whatever batch it runs in -- shuffled, in takes of random sizes one after another on the same engine
  (so prefixes kept by an earlier take meet later takes of other rows), one job at a time, one model a take, with
  small sub-batches and small prefill chunks -- gives the same answer in its own place (sampled rows the same
  tokens as alone: their draws are a function of the row alone);
- rows past the limit fail with input_too_long (or are cut to it with `truncate`), each row ends at a stop
  token or its own limit.

16 seeds a layout, ~0.4 s each with one thread. A longer search: KEVLAYA_FUZZ_SEEDS=1000 (and KEVLAYA_FUZZ_QUANT=nf4
for the 4-bit base with float32 compute).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.fastpath import TokenRecorder
from shared.errors import INPUT_TOO_LONG, ConfigError
from shared.job import Job
from tests.conftest import tiny_config
from worker.config import ModelsConfig, load_config
from worker.fastpath.sampling import uniform
from worker.loading import load_all, select_adapters, stop_ids
from worker.outputs import RowOutput
from worker.templates import prompt_pieces_many
from worker.tools.tinymodel import tiny_toml

# Float32 weights; KEVLAYA_FUZZ_QUANT=nf4 runs the same on the 4-bit base (float32 compute).
QUANTIZATION = os.environ.get("KEVLAYA_FUZZ_QUANT", "none")
KEV_INPUT, LAYA_INPUT = 96, 64  # small input limits: prompts at and past them stay cheap
KEV_NEW, LAYA_NEW = 12, 6
# Tokens of the tiny byte-level tokenizer the random models emit often: extra configured stops, so rows end on
# a stop token at every step, not only at their limits.
EXTRA_STOPS = ["Ġasks", "Ġdecide"]

WORDS = [
    "approve", "reject", "review", "income", "debt", "loan", "12000", "52000", "Step", "1:", "check", "the",
    "applicant", "history", "clean", "stable", "不确定", "可能", "信息", "é", "ü", "?", ",", ".", "x", "case",
]  # fmt: skip
# Shared headers (prefixes every row of a take may start with past the template) of 16+ tokens.
HEADERS = [
    "Case file A: the applicant earns 52000 a year and asks for a loan of 12000. Notes: ",
    "Step 1: check income. Step 2: check debt. Step 3: decide. Details: ",
    "不确定，可能需要更多信息 -- review the history, clean or not: ",
]
LABELS = [
    ("approve", "reject"),
    ("approve", "approve it", "approval"),  # a one-token label and two sharing its first token
    ("review", "reject", "rejected"),  # sharing a first token, of 2-3 tokens
    ("不确定", "✓ yes", "é"),  # unicode, one to six tokens
    ("need more information", "x"),
    ("<|im_end|>", " approve", "approve"),  # control-token text (tokenised as text), a leading space
    tuple(f"option {k}" for k in range(12)),  # a tail longer than a small prefill chunk
]
SAMPLINGS = [
    {"temperature": 0.7, "seed": 11},
    {"temperature": 1.3, "seed": 2**62 + 5, "top_p": 0.9},
    {"temperature": 1.0, "seed": 0, "top_k": 5},
    {"temperature": 0.9, "seed": 77, "top_p": 0.8, "top_k": 20},
    {"temperature": 0.05, "seed": 3},  # all but greedy
    {"temperature": 2.0, "seed": 9, "top_k": 1},  # greedy by its cut
]


def fuzz_toml(*, bare_laya: bool = False) -> str:
    """The tiny models in float32 with small limits; Laya's template the bare prompt (one-token prompts). With
    `bare_laya`, Laya has no adapter (its rows on the base model beside Kev's adapter rows) and Kev's template is
    the bare prompt too: rows of both start with the same headers, so a prefix kept for one adapter meets rows of
    the other."""
    text = tiny_toml(quantization=QUANTIZATION, kev_new=KEV_NEW, laya_new=LAYA_NEW)
    kev_template = ""
    if bare_laya:
        text = text.replace('adapter = "adapter-laya"\n', "")
        kev_template = '\ntemplate = "{prompt}"'
    text = text.replace("max_input_tokens = 512", f"max_input_tokens = {KEV_INPUT}{kev_template}", 1)
    text = text.replace("max_input_tokens = 512", f'max_input_tokens = {LAYA_INPUT}\ntemplate = "{{prompt}}"', 1)
    stops = ", ".join(f'"{s}"' for s in ["<|im_end|>", "<|endoftext|>", *EXTRA_STOPS])
    return f"stop_strings = [{stops}]\n" + text


@dataclass
class Engines:
    config: ModelsConfig
    eager: TokenRecorder  # the reference: HF generate, HF forward passes
    static: TokenRecorder  # the fast path


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for this module's many tiny matmuls: on 2 shared cores, with other processes busy, two
    threads waiting for each other made each 64-wide matmul ~0.7 ms instead of ~6 us (the fuzz 25x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["two adapters", "laya on the bare base"])
def engines(request: pytest.FixtureRequest, tiny_models: Path, one_thread: None) -> Engines:
    bare = request.param == "laya on the bare base"
    path = tiny_models / f"models-fuzz-{QUANTIZATION}{'-bare' if bare else ''}.toml"
    path.write_text(fuzz_toml(bare_laya=bare))
    config = load_config(path)
    assert config.models["laya"].template == "{prompt}"
    assert (config.models["laya"].adapter is None) == bare
    eager = TokenRecorder(config, device="cpu", decode="eager")
    static = TokenRecorder(config, device="cpu", decode="static", bases=eager.bases)
    assert static.decoders, "the static loop must run these models"
    return Engines(config, eager, static)


# ---- random takes ------------------------------------------------------------------------------------------------
def prompt_len(engines: Engines, model: str, prompt: str) -> int:
    """The prompt's tokens as the template renders it, before any limit."""
    spec = engines.config.models[model]
    tok = engines.static.base_for(model).tokenizer
    (pieces,) = prompt_pieces_many(tok, [(spec, Job(custom_id="n", model=model, prompt=prompt))])
    assert not isinstance(pieces, Exception)
    return sum(len(ids) for ids, _ in pieces)


def prompt_of(engines: Engines, rng: random.Random, model: str, header: str | None, kind: str) -> str:
    """A prompt: `kind` short (a word or two), any (a random length within the limit), at (exactly the model's
    input limit), past (a few tokens past it)."""
    limit = KEV_INPUT if model == "kev" else LAYA_INPUT
    text = header or ""
    if kind == "short":
        return text + rng.choice(WORDS) if header or rng.random() < 0.5 else "x"
    target = {"any": rng.randint(1, limit), "at": limit, "past": limit + rng.randint(1, 9)}[kind]
    # Words until the prompt would pass the target, then single characters to meet it exactly.
    while True:
        more = text + " " + rng.choice(WORDS)
        if _length(engines, model, more) > target:
            break
        text = more
    for _ in range(64):
        n = _length(engines, model, text)
        if n >= target:
            break
        text += rng.choice("xyz.,;")
    return text or "x"


def _length(engines: Engines, model: str, prompt: str) -> int:
    return prompt_len(engines, model, prompt) if prompt else 0


def random_take(engines: Engines, rng: random.Random, seed: int) -> list[Job]:
    jobs: list[Job] = []
    n = rng.randint(6, 10) if rng.random() < 0.85 else rng.randint(16, 24)
    headers = rng.sample(HEADERS, 2)
    shared = rng.random()  # how many rows start with a shared header
    for i in range(n):
        if jobs and rng.random() < 0.1:  # a row like an earlier one (same prompt, maybe another kind)
            like = rng.choice(jobs)
            jobs.append(Job(custom_id=f"s{seed}-{i}-again", model=like.model, prompt=like.prompt, truncate=True))
            continue
        model = rng.choice(("kev", "laya"))
        header = rng.choice([*headers, None]) if rng.random() < shared else None
        kind = rng.choices(("short", "any", "at", "past"), weights=(3, 5, 1, 1))[0]
        kw: dict[str, Any] = {}
        if kind == "past" or rng.random() < 0.2:
            kw["truncate"] = rng.random() < 0.6
        role = rng.choices(("greedy", "choices", "sampled"), weights=(5, 3, 2))[0]
        if role == "choices":
            kw["choices"] = rng.choice(LABELS)
        else:
            if rng.random() < 0.6:
                limit = KEV_NEW if model == "kev" else LAYA_NEW
                kw["max_new_tokens"] = rng.randint(1, limit + 3)  # past the model's limit: capped
            if role == "sampled":
                kw.update(rng.choice(SAMPLINGS))
            elif rng.random() < 0.25:
                kw.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        prompt = prompt_of(engines, rng, model, header, kind)
        jobs.append(Job(custom_id=f"s{seed}-{i}-{role}", model=model, prompt=prompt, **kw))
    return jobs


# ---- references --------------------------------------------------------------------------------------------------
@torch.inference_mode()
def plain_loglik(engines: Engines, job: Job) -> list[float]:
    """Each choice's log-likelihood (its tokens and the end token) after the prompt: one unpadded forward pass per
    prompt + choice through PEFT's own path, float64 sums."""
    e = engines.eager
    base = e.base_for(job.model)
    item = e.encoder.encode(job)
    end = stop_ids(base, engines.config.stop_strings)[0]
    out = []
    for label in job.choices or ():
        choice = [*base.tokenizer(label, add_special_tokens=False, split_special_tokens=True).input_ids, end]
        with select_adapters(base, [item.adapter]):
            logits = base.model(input_ids=torch.tensor([item.ids + choice])).logits[0]
        logp = logits.double().log_softmax(-1)
        out.append(sum(float(logp[len(item.ids) - 1 + k, t]) for k, t in enumerate(choice)))
    return out


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    w = [math.exp(v - top) for v in values]
    return [x / sum(w) for x in w]


@dataclass(frozen=True)
class Answer:
    """What must be the same for a job wherever it runs."""

    error: str | None
    text: str | None
    decision: str | None
    truncated: bool
    tokens: tuple[int, ...] | None  # generated rows: the token ids
    prompt_tokens: int
    completion_tokens: int
    confidence: float | None
    choices: tuple[tuple[str, float], ...] | None
    # Rows that asked for logprobs: per token its text and log-probability, its top alternatives' texts and theirs.
    logprobs: tuple[tuple[str, float, tuple[str, ...], tuple[float, ...]], ...] | None


def answers(engine: TokenRecorder, jobs: list[Job], **run: Any) -> list[Answer]:
    outs = engine.run(jobs, **run)
    assert len(outs) == len(jobs)
    return [answer(engine, job, out) for job, out in zip(jobs, outs, strict=True)]


def answer(engine: TokenRecorder, job: Job, out: RowOutput) -> Answer:
    generated = out.error is None and not job.scores_choices
    tokens = tuple(engine.tokens.pop(job.custom_id)) if generated else None
    return Answer(
        error=None if out.error is None else out.error.type,
        text=out.text,
        decision=out.decision,
        truncated=out.truncated,
        tokens=tokens,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        confidence=out.confidence,
        choices=None if out.choices is None else tuple(out.choices.items()),
        logprobs=None
        if out.logprobs is None
        else tuple(
            (t.token, t.logprob, tuple(a.token for a in t.top_logprobs), tuple(a.logprob for a in t.top_logprobs))
            for t in out.logprobs
        ),
    )


def assert_same(got: Answer, want: Answer, what: str) -> None:
    assert (got.error, got.text, got.decision, got.truncated, got.tokens, got.prompt_tokens) == (
        want.error, want.text, want.decision, want.truncated, want.tokens, want.prompt_tokens
    ), what  # fmt: skip
    assert got.completion_tokens == want.completion_tokens, what
    # Float32 sums in another order (other padding, chunking, a shared prefix's separate matmuls): the last bits.
    if want.confidence is None:
        assert got.confidence is None, what
    else:
        assert got.confidence == pytest.approx(want.confidence, rel=2e-4, abs=1e-6), what
    if want.choices is not None:
        assert got.choices is not None and [k for k, _ in got.choices] == [k for k, _ in want.choices], what
        assert [v for _, v in got.choices] == pytest.approx([v for _, v in want.choices], abs=2e-5), what
    assert (got.logprobs is None) == (want.logprobs is None), what
    for g, w in zip(got.logprobs or (), want.logprobs or (), strict=True):
        assert (g[0], g[2]) == (w[0], w[2]), what
        assert [g[1], *g[3]] == pytest.approx([w[1], *w[3]], abs=1e-4), what


# ---- the test ----------------------------------------------------------------------------------------------------
def check_row(engines: Engines, job: Job, a: Answer) -> None:
    """What holds of one answer by itself: limits, stops, truncation, errors."""
    spec = engines.config.models[job.model]
    untruncated = prompt_len(engines, job.model, job.prompt or "")
    if untruncated > spec.max_input_tokens and not job.truncate:
        assert a.error == INPUT_TOO_LONG, job.custom_id
        return
    assert a.error is None, (job.custom_id, a.error)
    assert a.prompt_tokens == min(untruncated, spec.max_input_tokens)
    if job.scores_choices:
        assert a.choices is not None and sum(p for _, p in a.choices) == pytest.approx(1.0)
        return
    assert a.tokens is not None
    limit = min(job.max_new_tokens or spec.max_new_tokens, spec.max_new_tokens)
    stops = set(stop_ids(engines.static.base_for(job.model), engines.config.stop_strings))
    assert 1 <= a.completion_tokens == len(a.tokens) <= limit
    assert not stops & set(a.tokens[:-1]), "a row runs past a stop token"
    assert a.tokens[-1] in stops or a.completion_tokens == limit, "a row ended before its stop and its limit"


# How near a sampled row's draw may lie to the edge between two tokens' shares of its distribution for a last-bits
# difference in its logits to move it across: float32 logits that differ by ~1e-7 between batches (other padding
# and chunks sum in another order), times 1/temperature, move the cumulative sums by ~1e-6 at most.
EDGE = 1e-5


@torch.inference_mode()
def on_a_boundary(engines: Engines, job: Job, a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> bool:
    """Whether two sampled answers of one job part only where the row's draw (the same number in every batch) lies
    within float32 rounding of the edge between the two tokens drawn. Not a difference the engine can avoid
    short of batch-invariant matmuls: a draw inverts a cumulative distribution, a step function of the logits
    (seen once in 300 seeds: temperature 0.05, the draw 3.7e-7 below the edge). Anything else is a difference."""
    if a is None or b is None or a == b:
        return False
    k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if k is None:
        return False
    base = engines.eager.base_for(job.model)
    item = engines.eager.encoder.encode(job)
    with select_adapters(base, [item.adapter]):
        logits = base.model(input_ids=torch.tensor([item.ids + list(a[:k])])).logits[0, -1].double()
    # The documented draw (worker/fastpath/sampling.py): over the vocabulary in its own order, or with a top-k or
    # top-p cut in descending order (stable), the first token whose cumulative probability reaches u x the total.
    scaled = logits / job.temperature
    order = torch.arange(scaled.shape[0])
    if job.top_p < 1.0 or job.top_k > 0:
        scaled, order = scaled.sort(descending=True, stable=True)
        probs = scaled.softmax(-1)
        keep = torch.arange(scaled.shape[0]) < (job.top_k or scaled.shape[0])
        keep &= (probs.cumsum(-1) - probs) < job.top_p
        scaled = scaled.masked_fill(~keep, float("-inf"))
    cdf = scaled.softmax(-1).cumsum(-1)
    draw = float(uniform(torch.tensor([job.seed]), torch.tensor([k]))) * float(cdf[-1])
    i, j = sorted(int((order == t).nonzero()) for t in (a[k], b[k]))
    # Neighbours in the draw's order (any tokens between them of no probability), the draw at the edge of the first.
    return abs(draw - float(cdf[i])) < EDGE and float(cdf[j - 1] - cdf[i]) < EDGE


def takes(rng: random.Random, jobs: list[Job]) -> list[list[Job]]:
    """`jobs` (shuffled) cut into takes of random sizes."""
    order = rng.sample(jobs, len(jobs))
    cuts = sorted(rng.sample(range(1, len(jobs)), rng.randint(1, min(3, len(jobs) - 1))))
    return [order[a:b] for a, b in zip([0, *cuts], [*cuts, len(jobs)], strict=True)]


def by_header(jobs: list[Job]) -> list[list[Job]]:
    """A take per model and shared header (the rows with none in takes of their own model)."""
    groups: dict[tuple[str, str | None], list[Job]] = {}
    for job in jobs:
        header = next((h for h in HEADERS if (job.prompt or "").startswith(h)), None)
        groups.setdefault((job.model, header), []).append(job)
    return list(groups.values())


# More seeds for a longer search: KEVLAYA_FUZZ_SEEDS=200 pytest tests/test_fastpath_fuzz.py
# Seed 168: on the bare-base layout a sampled row at temperature 0.05 draws 3.7e-7 below an edge (`on_a_boundary`).
SEEDS = [*range(int(os.environ.get("KEVLAYA_FUZZ_SEEDS", "16"))), 168]


@pytest.mark.parametrize("seed", SEEDS)
def test_fast_path_matches_the_reference_whatever_the_batch(engines: Engines, seed: int) -> None:
    rng = random.Random(seed)
    decoder = engines.static.decoders["default"]
    decoder.prefill.tokens = rng.choice((24, 64, 4096))  # prompts split into several chunks, or one
    decoder.prefill.group_tokens = rng.choice((48, 32768))  # layer-major over several groups, or one
    try:
        jobs = random_take(engines, rng, seed)
        full = answers(engines.static, jobs)

        # The reference: HF generate for the greedy rows, plain log-likelihoods for the choices.
        greedy = [j for j in jobs if not j.scores_choices and j.temperature == 0]
        reference = dict(zip([j.custom_id for j in greedy], answers(engines.eager, greedy), strict=True))
        for job, got in zip(jobs, full, strict=True):
            check_row(engines, job, got)
            if job.custom_id in reference:
                assert_same(got, reference[job.custom_id], f"seed {seed}: {job.custom_id} against HF generate")
            elif job.scores_choices and got.error is None:
                want = softmax(plain_loglik(engines, job))
                assert got.choices is not None
                # Float32 forward passes that differ only in how they sum (joined projections, the choices beside
                # the prompt, merged LoRA): log-likelihoods agree to ~1e-5, probabilities to well within 1e-4.
                assert [p for _, p in got.choices] == pytest.approx(want, abs=1e-4), f"seed {seed}: {job.custom_id}"

        # The same answer in every arrangement, on the same engine one take after another (kept prefixes included).
        arrangements: list[tuple[str, list[list[Job]], dict[str, Any]]] = [
            ("shuffled", [rng.sample(jobs, len(jobs))], {}),
            ("takes", takes(rng, jobs), {}),
            ("by model", [[j for j in jobs if j.model == m] for m in ("kev", "laya")], {}),
            ("by model and header", by_header(jobs), {}),  # every row of a take shares a prefix past the template
            ("alone", [[j] for j in rng.sample(jobs, len(jobs))], {}),
            ("sub-batches of 2", [rng.sample(jobs, len(jobs))], {"max_batch_rows": 2}),
        ]
        want = {j.custom_id: a for j, a in zip(jobs, full, strict=True)}
        for name, parts, settings in arrangements:
            kept = engines.static.max_batch_rows
            engines.static.max_batch_rows = settings.get("max_batch_rows", kept)
            try:
                for part in filter(None, parts):
                    for job, got in zip(part, answers(engines.static, part), strict=True):
                        what = f"seed {seed}: {job.custom_id} {name}"
                        if job.temperature > 0 and on_a_boundary(engines, job, got.tokens, want[job.custom_id].tokens):
                            continue
                        assert_same(got, want[job.custom_id], what)
            finally:
                engines.static.max_batch_rows = kept
    finally:
        decoder.prefill.tokens, decoder.prefill.group_tokens = 4096, 32768


# ---- what the fuzz found, minimised ------------------------------------------------------------------------------
def test_a_stop_string_that_is_the_tokenizers_unknown_token_is_a_stop(tiny_models: Path) -> None:
    """The tiny tokenizer's unknown token (as transformers 5 reports it) is `<|endoftext|>`, a real token: it was
    taken for "no such token", so the default stops silently lost it and a config naming it was refused."""
    path = tiny_models / "models-fuzz-stops.toml"
    path.write_text('stop_strings = ["<|im_end|>", "<|endoftext|>"]\n' + tiny_toml(quantization="none"))
    config = load_config(path)
    (base,) = load_all(config, torch.device("cpu")).values()
    tok = base.tokenizer
    assert tok.unk_token == "<|endoftext|>"  # the case this is about
    want = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    assert stop_ids(base, config.stop_strings) == want
    unset = tiny_config(tiny_models, "none")  # the default stop strings: the same two
    assert stop_ids(base, unset.stop_strings) == want
    path.write_text('stop_strings = ["<|im_end|>", "no such token"]\n' + tiny_toml(quantization="none"))
    with pytest.raises(ConfigError, match="no such token"):
        load_all(load_config(path), torch.device("cpu"))
