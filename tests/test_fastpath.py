"""The static decode loop (the CUDA-graph fast path's logic, run here without graphs) against HF generate:
token for token on greedy decoding, with ragged prompts, per-row limits, bucket padding, mixed adapters,
deadlines; and the engine's fallbacks around it. (tests/test_engine.py runs every engine test, poisoned
rows included, on both paths.)"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench.fastpath import TokenRecorder
from shared.errors import TIMEOUT, ConfigError
from shared.job import Job
from tests.conftest import tiny_config
from worker.engine import Engine
from worker.fastpath import ROW_BUCKETS, DecodeRow, length_bucket, row_bucket, unsupported_reason
from worker.loading import select_adapters, stop_ids
from worker.memory import GIB, MIB, RESERVE_BYTES, ModelShape, plan_batch
from worker.tools.tinymodel import QWEN25_1_5B

PROMPTS = ["Approve a loan of 12000?", "Income 52000, debt low.", "不确定的情况", "x", "Step 1: check income " * 7]


@pytest.fixture(scope="module", params=["none", "nf4"])
def pair(request: pytest.FixtureRequest, tiny_models: Path) -> tuple[TokenRecorder, TokenRecorder]:
    config = tiny_config(tiny_models, request.param)
    eager = TokenRecorder(config, device="cpu", decode="eager")
    return eager, TokenRecorder(config, device="cpu", decode="static", bases=eager.bases)


def batch(models: str, n: int, **kw: Any) -> list[Job]:
    return [
        Job(
            custom_id=f"{models}{i}",
            model=("kev", "laya")[i % 2] if models == "mixed" else models,
            prompt=PROMPTS[i % len(PROMPTS)] + f" case {i}",
            **kw,
        )
        for i in range(n)
    ]


def assert_same(eager: TokenRecorder, static: TokenRecorder, jobs: list[Job]) -> None:
    want, got = eager.run(jobs), static.run(jobs)
    for job, a, b in zip(jobs, want, got, strict=True):
        assert static.tokens[job.custom_id] == eager.tokens[job.custom_id], job.custom_id
        assert (b.text, b.decision, b.completion_tokens, b.error) == (a.text, a.decision, a.completion_tokens, a.error)
        assert b.confidence == pytest.approx(a.confidence, rel=1e-4)


@pytest.mark.parametrize("models", ["kev", "laya", "mixed"])
@pytest.mark.parametrize("n", [1, 5, 17])  # 5 and 17 are padded up to buckets 8 and 24
def test_token_identical_to_hf_generate(pair: tuple[TokenRecorder, TokenRecorder], models: str, n: int) -> None:
    assert_same(*pair, batch(models, n))
    assert next(iter(pair[1].decoders.values())).own_prefill  # the loop's own prefill ran, no fallback


def test_prefill_through_the_models_forward_is_identical_too(pair: tuple[TokenRecorder, TokenRecorder]) -> None:
    decoder = next(iter(pair[1].decoders.values()))
    decoder.prefill.own = False
    try:
        assert_same(*pair, batch("mixed", 9))
    finally:
        decoder.prefill.own = True


def _failing(message: str) -> Any:
    """A stand-in for a loop method that raises what a device that cannot run it would."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(message)

    return broken


def test_a_failing_own_prefill_hands_over_to_the_models_forward(tiny_models: Path) -> None:
    config = tiny_config(tiny_models, "none")
    eager = TokenRecorder(config, device="cpu", decode="eager")
    static = TokenRecorder(config, device="cpu", decode="static", bases=eager.bases)
    decoder = next(iter(static.decoders.values()))
    decoder.prefill.own_layers = _failing("kernel not available")
    assert_same(eager, static, batch("kev", 5))
    assert decoder.own_prefill is False and static.decoders  # the loop itself carries on


def test_small_prefill_chunks_of_their_own_widths_stay_exact(pair: tuple[TokenRecorder, TokenRecorder]) -> None:
    """Prompts of many lengths split into many prefill chunks, each padded only to its own longest prompt."""
    decoder = next(iter(pair[1].decoders.values()))
    decoder.prefill.tokens = 24
    try:
        jobs = [
            Job(custom_id=f"c{i}", model=("kev", "laya")[i % 2], prompt=PROMPTS[i % 5] * (1 + i % 4)) for i in range(11)
        ]
        assert_same(*pair, jobs)
        assert len(decoder.prefill.chunks([_row(len(j.prompt)) for j in jobs], 200, 0)) > 3
    finally:
        decoder.prefill.tokens = 4096


def _row(n: int, adapter: str | None = "kev") -> DecodeRow:
    return DecodeRow(ids=list(range(3, 3 + n)), max_new=4, adapter=adapter)


def test_rows_in_any_order_decode_as_when_sorted(pair: tuple[TokenRecorder, TokenRecorder]) -> None:
    """The engine hands rows sorted by length; rows in another order are chunked through an index."""
    static = pair[1]
    decoder = next(iter(static.decoders.values()))
    base = static.base_for("kev")
    rows = [_row(n, adapter) for n, adapter in [(9, "kev"), (2, "laya"), (14, "kev"), (5, "laya"), (1, "kev")]]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids))
    decoder.prefill.tokens = 20
    try:

        def run(rows: list[DecodeRow]) -> torch.Tensor:
            kw = {"stop_ids": stop_ids(base, static.config.stop_strings), "pad_id": base.tokenizer.pad_token_id}
            return decoder.decode(rows, select=lambda names: static._adapters(base, names), **kw).tokens

        shuffled, ordered = run(rows), run([rows[i] for i in order])
    finally:
        decoder.prefill.tokens = 4096
    assert torch.equal(shuffled[order], ordered)


def test_per_row_limits_and_ragged_prompts(pair: tuple[TokenRecorder, TokenRecorder]) -> None:
    jobs = [
        Job(custom_id=f"r{i}", model="kev", prompt=PROMPTS[i % 5] * (1 + i % 3), max_new_tokens=1 + 5 * i)
        for i in range(8)
    ]
    assert_same(*pair, jobs)
    _, static = pair
    assert [len(static.tokens[j.custom_id]) <= j.max_new_tokens for j in jobs] == [True] * 8


def test_reused_buckets_stay_exact(pair: tuple[TokenRecorder, TokenRecorder]) -> None:
    """A second batch of another size and length reuses (and regrows) the cache: no stale state leaks in."""
    eager, static = pair
    assert_same(eager, static, batch("kev", 12))
    assert_same(eager, static, batch("laya", 3))
    assert_same(eager, static, batch("mixed", 12))
    decoder = next(iter(static.decoders.values()))
    assert len(decoder.graphs.entries) >= 2  # entries per (rows bucket, length bucket, adapters)


def test_a_captured_bucket_a_little_larger_serves_a_batch(pair: tuple[TokenRecorder, TokenRecorder]) -> None:
    """With graphs, a batch runs in an existing entry of up to 1.5x its rows rather than capturing another."""
    eager = pair[0]
    static = TokenRecorder(eager.config, device="cpu", decode="static", bases=eager.bases)
    decoder = next(iter(static.decoders.values()))
    decoder.graphs.reuse_slack = 1.5
    assert_same(eager, static, batch("kev", 20))  # bucket 24
    entries = set(decoder.graphs.entries)
    assert_same(eager, static, batch("kev", 15))  # bucket 16: 24 <= 1.5 x 16 serves it, its extra rows idle
    assert set(decoder.graphs.entries) == entries
    assert_same(eager, static, batch("kev", 7))  # bucket 8: 24 is too large, a new entry
    assert len(decoder.graphs.entries) == len(entries) + 1


def test_a_captured_graph_a_little_longer_serves_a_batch_the_pool_already_holds(
    pair: tuple[TokenRecorder, TokenRecorder],
) -> None:
    """With graphs, a batch runs in an entry of up to `length_slack` x its cache length (extra slots masked)
    when the KV pool already holds that entry: no capture, no memory beyond what is allocated."""
    eager = pair[0]
    static = TokenRecorder(eager.config, device="cpu", decode="static", bases=eager.bases)
    decoder = next(iter(static.decoders.values()))
    decoder.graphs.length_slack = 4.0  # whatever the two lengths, the longer serves
    long = [Job(custom_id=f"l{i}", model="kev", prompt=PROMPTS[4] * 4 + str(i)) for i in range(4)]
    short = [Job(custom_id=f"s{i}", model="kev", prompt=PROMPTS[0] + str(i)) for i in range(4)]
    assert_same(eager, static, long)
    (entry,) = decoder.graphs.entries
    assert_same(eager, static, short)
    assert list(decoder.graphs.entries) == [entry]  # served by the longer entry
    smaller = replace(entry, length=entry.length - 64)
    assert decoder.graphs.reusable(smaller, decoder.pool.fits) == entry
    assert decoder.graphs.reusable(smaller, lambda rows, length: False) == smaller  # the pool must hold it


def test_a_captured_graph_with_idle_sampler_or_logprob_slots_serves_a_greedy_batch(
    pair: tuple[TokenRecorder, TokenRecorder],
) -> None:
    """With graphs, a greedy batch runs in an entry captured for a few sampled rows, or for a few rows asking for
    logprobs, rather than capturing its own: the idle slots change none of its tokens. Beyond `idle_slots` a
    batch wanting none gets its own entry."""
    eager = pair[0]
    static = TokenRecorder(eager.config, device="cpu", decode="static", bases=eager.bases)
    decoder = next(iter(static.decoders.values()))
    decoder.graphs.idle_slots = 8
    greedy = batch("laya", 6)
    sampled = [*greedy[:5], replace(greedy[5], temperature=0.9, seed=5)]
    static.run(sampled)
    (entry,) = decoder.graphs.entries
    assert entry.samplers == 8
    assert_same(eager, static, greedy)
    assert list(decoder.graphs.entries) == [entry]  # served by the sampled entry, its slots idle
    asking = [*greedy[:5], replace(greedy[5], logprobs=True)]
    static.run(asking)
    assert len(decoder.graphs.entries) == 2
    logprob_entry = next(k for k in decoder.graphs.entries if k.logprob_slots)
    assert decoder.graphs.reusable(replace(logprob_entry, logprob_slots=0), decoder.pool.fits) == logprob_entry
    assert_same(eager, static, greedy)  # now in the logprob entry (no idle sampler slots): the same tokens
    assert len(decoder.graphs.entries) == 2
    # One row asking, in an entry of 8 logprob slots made by 5 rows asking: its record is the one the entry its
    # own batch made gave, and the rows not asking report none.
    other = TokenRecorder(eager.config, device="cpu", decode="static", bases=eager.bases)
    other_decoder = next(iter(other.decoders.values()))
    other_decoder.graphs.idle_slots = 8
    other.run([replace(j, logprobs=True) for j in greedy[:5]] + [greedy[5]])
    (eight,) = other_decoder.graphs.entries
    assert eight.logprob_slots == 8
    want, got = static.run(asking), other.run(asking)
    assert list(other_decoder.graphs.entries) == [eight]
    assert got[5].logprobs is not None and got[5].logprobs == want[5].logprobs
    assert all(r.logprobs is None for r in got[:5])
    decoder.graphs.idle_slots = 0
    assert decoder.graphs.reusable(replace(entry, samplers=0), decoder.pool.fits) == replace(entry, samplers=0)


def test_takes_of_one_to_eight_rows_asking_for_logprobs_share_one_graph(
    pair: tuple[TokenRecorder, TokenRecorder],
) -> None:
    """Logprob slots are bucketed as sampler slots (at least 8): takes of 1, 3 and 8 asking rows (and none) run
    in one entry, an asking row's record the same whoever else asks; 9 asking rows get an entry of 16."""
    from worker.fastpath.decoder import logprob_slots

    assert [logprob_slots(n) for n in (0, 1, 2, 7, 8, 9, 16, 17)] == [0, 8, 8, 8, 8, 16, 16, 24]
    eager = pair[0]
    static = TokenRecorder(eager.config, device="cpu", decode="static", bases=eager.bases)
    decoder = next(iter(static.decoders.values()))
    greedy = batch("laya", 10)
    records = []
    for asking in (1, 3, 8):
        out = static.run([replace(j, logprobs=i < asking) for i, j in enumerate(greedy[:8])])
        records.append(out[0].logprobs)
        assert all((r.logprobs is not None) == (i < asking) for i, r in enumerate(out))
    assert records[0] is not None and records[0] == records[1] == records[2]
    assert_same(eager, static, greedy[:8])
    assert {k.logprob_slots for k in decoder.graphs.entries} - {0} == {8}  # (0: the greedy batch's, no graphs)
    static.run([replace(j, logprobs=i < 9) for i, j in enumerate(greedy)])
    assert 16 in {k.logprob_slots for k in decoder.graphs.entries}  # (its larger KV pool dropped the others)


def test_deadline_fails_rows_it_cut_short(tiny_models: Path) -> None:
    engine = Engine(tiny_config(tiny_models, "none", kev_new=400), device="cpu", decode="static")
    jobs = batch("kev", 4)
    outs = engine.run(jobs, time_limit_s=1e-6)
    cut = [o for o in outs if o.error is not None]
    assert cut and all(o.error.type == TIMEOUT for o in cut)
    for o in outs:
        if o.error is None:  # finished before the first check: it stopped on its own
            assert o.completion_tokens < 400


def test_a_failing_loop_falls_back_to_hf_generate(tiny_models: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tiny_config(tiny_models, "none")
    eager = Engine(config, device="cpu", decode="eager")
    static = Engine(config, device="cpu", decode="static", bases=eager.bases)
    decoder = next(iter(static.decoders.values()))
    decoder.decode = _failing("capture refused")
    jobs = batch("laya", 3)
    with caplog.at_level(logging.ERROR, logger="kevlaya.engine"):
        outs = static.run(jobs)
    assert [o.text for o in outs] == [o.text for o in eager.run(jobs)]
    assert static.decoders == {} and "HF generate from now on" in caplog.text


def test_out_of_memory_in_the_loop_splits_the_batch(tiny_models: Path) -> None:
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static")
    decoder = next(iter(engine.decoders.values()))
    real = decoder.decode
    sizes: list[int] = []

    def tight(rows: Any, **kwargs: Any) -> Any:
        sizes.append(len(rows))
        if len(rows) > 2:
            raise torch.OutOfMemoryError("simulated")
        return real(rows, **kwargs)

    decoder.decode = tight
    outs = engine.run(batch("laya", 4))
    assert all(o.error is None for o in outs)
    assert sizes == [4, 2, 2] and engine.decoders  # split, not abandoned


def test_out_of_memory_with_graphs_held_retries_once_before_splitting(tiny_models: Path) -> None:
    """Graphs of earlier buckets pin memory the plan does not count: released, the same batch may fit."""
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static")
    decoder = next(iter(engine.decoders.values()))
    engine.run(batch("laya", 3))
    assert decoder.holds_memory()
    real = decoder.decode
    sizes: list[int] = []

    def once(rows: Any, **kwargs: Any) -> Any:
        sizes.append(len(rows))
        if len(sizes) == 1:
            raise torch.OutOfMemoryError("simulated")
        return real(rows, **kwargs)

    decoder.decode = once
    outs = engine.run(batch("laya", 4))
    assert all(o.error is None for o in outs)
    assert sizes == [4, 4]  # released and retried whole, not split


def test_auto_runs_the_loop_without_graphs_on_cpu_and_eager_turns_it_off(tiny_models: Path) -> None:
    config = tiny_config(tiny_models, "none")
    auto = Engine(config, device="cpu")
    assert set(auto.decoders) == {"default"} and not auto.decoders["default"].use_graphs
    assert not Engine(config, device="cpu", decode="static").decoders["default"].use_graphs
    assert Engine(config, device="cpu", decode="eager").decoders == {}
    with pytest.raises(ValueError, match="decode must be one of"):
        Engine(config, device="cpu", decode="fast")


def test_unsupported_architectures_are_named() -> None:
    def model(**cfg: Any) -> Any:
        attn = SimpleNamespace(q_proj=1, k_proj=1, v_proj=1, o_proj=1)
        layer = SimpleNamespace(self_attn=attn, mlp=SimpleNamespace(gate_proj=1, up_proj=1, down_proj=1))
        config = SimpleNamespace(**{"model_type": "qwen2", **cfg})
        return SimpleNamespace(config=config, model=SimpleNamespace(layers=[layer]))

    assert unsupported_reason(model()) is None
    assert "gpt2" in unsupported_reason(model(model_type="gpt2"))
    assert "sliding" in unsupported_reason(model(use_sliding_window=True))
    assert "sliding" in unsupported_reason(model(layer_types=["full_attention", "sliding_attention"]))


def test_buckets() -> None:
    assert [row_bucket(n) for n in (1, 3, 5, 17, 65, 121, 200, 257, 512)] == [1, 4, 8, 24, 72, 128, 208, 288, 512]
    assert row_bucket(600) == 600  # past the table: the batch as it is
    assert [length_bucket(n) for n in (1, 64, 65, 300)] == [64, 64, 128, 320]


def test_static_plan_fits_more_rows_and_a_whole_bucket() -> None:
    shape = ModelShape.from_dict(
        {
            "hidden_size": QWEN25_1_5B.hidden,
            "num_hidden_layers": QWEN25_1_5B.layers,
            "num_attention_heads": QWEN25_1_5B.heads,
            "num_key_value_heads": QWEN25_1_5B.kv_heads,
            "intermediate_size": QWEN25_1_5B.intermediate,
            "vocab_size": QWEN25_1_5B.model_vocab,
        }
    )
    common = {"budget_bytes": 6 * GIB, "resident_bytes": int(1.2 * GIB), "input_tokens": 256, "new_tokens": 32}
    eager = plan_batch(shape, **common)
    static = plan_batch(shape, **common, prefill_chunk_tokens=4096, cache_tokens=length_bucket(288))
    assert static.max_rows > eager.max_rows  # prefill activations are one chunk's, not every row's
    assert static.free_bytes < eager.free_bytes  # ...which is reserved up front
    assert static.bytes_per_row * static.max_rows <= static.free_bytes
    # The loop's own prefill (flash attention, no score matrix) reserves less per chunk: more rows fit.
    flash = plan_batch(shape, **common, prefill_chunk_tokens=4096, cache_tokens=length_bucket(288), flash_prefill=True)
    assert flash.free_bytes > static.free_bytes and flash.max_rows >= static.max_rows


def test_engine_plan_rounds_down_to_a_bucket(tiny_models: Path) -> None:
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static", memory_budget_bytes=GIB)
    for tokens in (16, 100, 400):
        assert engine.plan("kev", input_tokens=tokens).max_rows in ROW_BUCKETS


def test_a_budget_without_room_for_one_row_is_refused_at_start(tiny_models: Path) -> None:
    """Every take would otherwise run one row past its plan (a take holds at least one): an out-of-memory error
    on a GPU at every take, not a line at start."""
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static", memory_budget_bytes=GIB)
    resident = engine.memory.resident_bytes
    with pytest.raises(ConfigError, match=r"--memory-budget \d+ MiB leaves no room for one (kev|laya) row") as exc:
        Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static", memory_budget_bytes=resident)
    least = int(str(exc.value).rsplit("~", 1)[1].split()[0]) * MIB
    Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static", memory_budget_bytes=least)  # enough


def test_the_take_follows_the_prompt_lengths_last_seen(tiny_models: Path) -> None:
    """After a batch of long prompts the worker takes fewer rows, so its next take is not split in two."""
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static", memory_budget_bytes=GIB)
    engine.memory.total_bytes = engine.memory.resident_bytes + RESERVE_BYTES + 48 * MIB  # a plan below the row cap
    before = engine.capacity("kev")
    engine.run([Job(custom_id="long", model="kev", prompt="loan income debt " * 150, max_new_tokens=1)])
    longest = engine._longest_prompt["kev"]
    assert longest > 256
    # A take of one model is planned as rows of one adapter (`memory.prefill_chunk_bytes`).
    assert engine.capacity("kev") == engine.plan("kev", input_tokens=longest, one_adapter=True).max_rows < before
    engine.run([Job(custom_id="short", model="kev", prompt="hi", max_new_tokens=1)])
    assert engine.capacity("kev") == before  # never planned below the typical prompt


def test_an_expected_follow_up_sizes_its_models_take(tiny_models: Path) -> None:
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static", memory_budget_bytes=GIB)
    engine.memory.total_bytes = engine.memory.resident_bytes + RESERVE_BYTES + 48 * MIB  # a plan below the row cap
    before = engine.capacity("kev")
    engine.expect(Job(custom_id="f", model="kev", prompt="loan income debt " * 150))
    assert engine._longest_prompt["kev"] > 256
    assert engine.capacity("kev") < before
    engine.expect(Job(custom_id="short", model="kev", prompt="hi"))  # never lowers what is expected
    assert engine.capacity("kev") < before
    engine.expect(Job(custom_id="long", model="laya", prompt="x " * 5000))  # too long: fails when it runs
    assert "laya" not in engine._longest_prompt


def test_after_a_batch_that_only_scored_the_take_is_sized_for_scored_rows(tiny_models: Path) -> None:
    """A row scored inside the prefill keeps no cache, where a generating one keeps its prompt and a whole
    answer: after a batch of only choice rows the take is planned for those (more rows), until a generating row
    runs or is expected."""
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static", memory_budget_bytes=GIB)
    engine.memory.total_bytes = engine.memory.resident_bytes + RESERVE_BYTES + 48 * MIB  # a plan below the row cap
    scored = [Job(custom_id=f"c{i}", model="kev", prompt="hi", choices=("yes", "no")) for i in range(2)]
    span = max(engine.choices.count(j) for j in scored)
    longest = 280  # Kev answers up to 48 tokens: 280 + 48 in a 384-token cache, 280 + the choices in 320

    def run(jobs: list[Job]) -> None:
        engine.run(jobs)
        engine._longest_prompt["kev"] = longest  # as after a batch of such prompts

    run([Job(custom_id="g", model="kev", prompt="hi", max_new_tokens=1)])
    generating = engine.capacity("kev")
    run(scored)
    scoring = engine.plan("kev", input_tokens=longest, new_tokens=span, scoring=True, one_adapter=True).max_rows
    assert engine.capacity("kev") == scoring > generating
    as_it_was = engine.plan("laya", input_tokens=256, one_adapter=True).max_rows
    assert engine.capacity("laya") == as_it_was  # another model
    run([*scored, Job(custom_id="g", model="kev", prompt="hi", max_new_tokens=1)])  # both kinds
    assert engine.capacity("kev") == generating
    run(scored)
    engine.expect(Job(custom_id="f", model="kev", prompt="hi"))  # a generating follow-up is coming
    assert engine.capacity("kev") == generating


def _lora_linears(dtype: torch.dtype, outs: tuple[int, ...]) -> tuple[Any, ...]:
    """PEFT LoRA linears reading one 32-wide input (as q and k do), one per output width, each with two
    adapters (ranks 8 and 4, different scales) on a `dtype` base layer, adapters kept in float32 as PEFT keeps
    them, and non-zero B (a fresh adapter's B is zero)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    names = [f"p{i}" for i in range(len(outs))]
    net = torch.nn.ModuleDict({n: torch.nn.Linear(32, out) for n, out in zip(names, outs, strict=True)}).to(dtype)
    model = get_peft_model(net, LoraConfig(r=8, lora_alpha=32, target_modules=names), adapter_name="kev")
    model.add_adapter("laya", LoraConfig(r=4, lora_alpha=4, target_modules=names))
    layers = tuple(model.base_model.model[n] for n in names)
    for layer in layers:
        for name in ("kev", "laya"):
            layer.lora_A[name].float()
            layer.lora_B[name].float()
            torch.nn.init.normal_(layer.lora_B[name].weight, std=0.1)
    return layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loop_lora_matches_peft_and_masks_pick_each_rows_adapter(dtype: torch.dtype) -> None:
    from worker.fastpath.weights import Proj

    (layer,) = _lora_linears(dtype, (48,))
    proj = Proj(layer, dtype)
    assert bool(proj.fused) == (dtype != torch.float32)  # fused only where PEFT would cast
    x = torch.randn(4, 1, 32).to(dtype)
    tol = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    with torch.no_grad():
        for name in ("kev", "laya"):
            layer.set_adapter(name)
            torch.testing.assert_close(proj(x, [(name, None)]), layer(x), **tol)
        mask_kev = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=dtype).view(4, 1, 1)
        mixed = proj(x, [("kev", mask_kev), ("laya", 1 - mask_kev)])
        want = torch.where(mask_kev.bool(), proj(x, [("kev", None)]), proj(x, [("laya", None)]))
        torch.testing.assert_close(mixed, want, **tol)
        torch.testing.assert_close(proj(x, []), layer.base_layer(x), rtol=0, atol=0)


@pytest.mark.parametrize("nested", [True, False])
def test_4bit_weights_without_bitsandbytes_python_match_its_dequantisation(nested: bool) -> None:
    """The loop's 4-bit calls (float32 scales decoded once; one dequantise op for prefill; bitsandbytes' own
    matmul op for decode) compute what bitsandbytes' reference dequantisation gives."""
    import bitsandbytes as bnb

    from worker.fastpath.quant4 import float_absmax
    from worker.fastpath.weights import Proj

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 48, bias=True, compute_dtype=torch.float32, compress_statistics=nested)
    layer.load_state_dict({"weight": torch.randn(48, 64), "bias": torch.randn(48)})
    layer = layer.to("cpu")  # quantises
    state = layer.weight.quant_state
    assert state.nested == nested
    reference = bnb.functional.dequantize_4bit(layer.weight.data, state).to(torch.float32)
    proj = Proj(layer, torch.float32)
    proj.absmax = float_absmax(state)  # what the loop keeps for a GPU layer
    x = torch.randn(5, 3, 64)
    want = torch.nn.functional.linear(x, reference, layer.bias)
    torch.testing.assert_close(proj.dense(), reference, rtol=0, atol=0)
    torch.testing.assert_close(proj(x, [], proj.dense()), want, rtol=0, atol=0)
    torch.testing.assert_close(proj(x, []), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_projections_compute_what_each_does_alone(dtype: torch.dtype) -> None:
    """q/k/v (and gate/up) as one matmul over concatenated weights, LoRA stacked and block-diagonal: each
    member's output as when it runs alone, for one adapter and for a per-row mixed batch."""
    from worker.fastpath.weights import Group, Proj

    layers = _lora_linears(dtype, (48, 16))
    x = torch.randn(4, 3, 32).to(dtype)
    mask_kev = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=dtype).view(4, 1, 1)
    cases = [[("kev", None)], [("laya", None)], [("kev", mask_kev), ("laya", 1 - mask_kev)], []]
    with torch.no_grad():
        alone = Group([Proj(layer, dtype) for layer in layers], dtype, join=False)
        want = [alone(x, masks)[0] for masks in cases]
        peft_before = [layer(x) for layer in layers]
        joint = Group([Proj(layer, dtype) for layer in layers], dtype)
        assert joint.joint is not None and bool(joint.lora) == (dtype != torch.float32)
        for masks, expected in zip(cases, want, strict=True):
            got, whole = joint(x, masks)
            for g, w in zip(got, expected, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert (whole is not None) == bool(joint.lora)
        # The members' weights are views of the joint buffer, and PEFT's own forward is unchanged.
        start = joint.joint.weight.data_ptr()
        assert [layer.base_layer.weight.data_ptr() for layer in layers] == [start, start + 48 * 32 * x.element_size()]
        for layer, before in zip(layers, peft_before, strict=True):
            torch.testing.assert_close(layer(x), before, rtol=0, atol=0)
        # Prefill's merged weights (W + B A): the same outputs to bf16 rounding; float32 keeps PEFT's exact
        # arithmetic, so it does not merge.
        merged = joint.merged("kev")
        assert (merged is None) == (dtype == torch.float32)
        if merged is not None:
            for g, w in zip(joint(x, [], merged)[0], want[0], strict=True):
                torch.testing.assert_close(g, w, rtol=2e-2, atol=3e-2)
        assert joint.merged(None) is not None  # no adapter: the plain weights


def test_joined_4bit_weights_dequantise_as_each_alone() -> None:
    import bitsandbytes as bnb

    from worker.fastpath.quant4 import float_absmax
    from worker.fastpath.weights import Group, Proj

    torch.manual_seed(0)
    layers, refs = [], []
    for out in (48, 16, 16):
        layer = bnb.nn.Linear4bit(64, out, bias=True, compute_dtype=torch.float32, compress_statistics=True)
        layer.load_state_dict({"weight": torch.randn(out, 64), "bias": torch.randn(out)})
        layer = layer.to("cpu")
        refs.append(bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float())
        layers.append(layer)
    projs = [Proj(layer, torch.float32) for layer in layers]
    for p in projs:
        p.absmax = float_absmax(p.base.weight.quant_state)  # what the loop keeps for a GPU layer
    group = Group(projs, torch.float32)
    assert group.joint is not None
    (dense,) = group.dense()
    torch.testing.assert_close(dense, torch.cat(refs), rtol=0, atol=0)
    x = torch.randn(5, 2, 64)
    for given in ((dense,), ()):  # prefill's ready weight; decode's 4-bit matmul op on the joint buffer
        parts, _ = group(x, [], given)
        for part, ref, layer in zip(parts, refs, layers, strict=True):
            torch.testing.assert_close(part, torch.nn.functional.linear(x, ref, layer.bias), rtol=1e-6, atol=1e-6)
    # Each member still dequantises to its own weight from its view of the joint buffer.
    for p, ref in zip(projs, refs, strict=True):
        torch.testing.assert_close(p.dense(), ref, rtol=0, atol=0)


def test_joined_projections_decode_token_for_token_as_separate_ones(tiny_models: Path) -> None:
    """In bfloat16 (where the loop fuses LoRA in the compute dtype and joins it): the same tokens and
    log-probabilities with the joint matmuls as with each projection alone, for Kev, Laya and mixed rows."""
    from worker.fastpath import StaticDecoder

    path = tiny_models / "models-bf16.toml"
    path.write_text(tiny_config(tiny_models, "none").path.read_text().replace('"float32"', '"bfloat16"'))
    from worker.config import load_config

    engine = Engine(load_config(path), device="cpu", decode="static")
    (base,), (joint,) = engine.bases.values(), engine.decoders.values()
    separate = StaticDecoder(base.model, torch.device("cpu"), use_graphs=False, join_projections=False)
    assert joint.stack.layers[0].qkv.joint is not None and separate.stack.layers[0].qkv.joint is None
    for adapters in (["kev"], ["laya"], ["kev", "laya"]):
        ids = [base.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(5)]
        rows = [DecodeRow(ids=r, max_new=6, adapter=adapters[i % len(adapters)]) for i, r in enumerate(ids)]
        kw = {"stop_ids": [-1], "pad_id": base.tokenizer.pad_token_id, "select": lambda n: select_adapters(base, n)}
        a, b = joint.decode(rows, **kw), separate.decode(rows, **kw)
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=0)


def test_warm_up_leaves_nothing_behind(
    pair: tuple[TokenRecorder, TokenRecorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up warm-up (run on CUDA; here called by hand) decodes every model and a mixed batch, warms
    prefill's matmul row counts, then drops its graphs and cache: no phase times, no prompt history, and the next
    batch as exact as ever."""
    eager, static = pair
    history = dict(static._longest_prompt)
    (decoder,) = static.decoders.values()
    captures = decoder.captures
    warmed: list[int] = []
    real = decoder.prefill.warm_row_counts
    monkeypatch.setattr(decoder.prefill, "warm_row_counts", lambda: warmed.append(real()) or warmed[-1])
    spans: list[int] = []
    real_layer = decoder.prefill._layer
    spy = lambda i, layer, cache, c, *a, **k: (spans.append(c.span), real_layer(i, layer, cache, c, *a, **k))[1]  # noqa: E731
    monkeypatch.setattr(decoder.prefill, "_layer", spy)
    static.warm_up()
    assert warmed == [0]  # asked once; no row counts to warm off a GPU
    # Its rows (one token repeated) share all but their last: they run whole, as real takes' chunks do, and no
    # prefix of theirs is kept.
    assert spans and min(spans) > 1
    assert decoder.prefill.prefixes.made == 0 and decoder.prefill.prefixes.min_tokens > 0
    assert not decoder.holds_memory() and not decoder.phase_s
    assert static._longest_prompt == history  # the take is sized by real jobs only
    assert decoder.captures == captures  # no graphs on the CPU; the loop ran without them
    assert_same(eager, static, batch("mixed", 5))


def test_a_fused_op_that_fails_to_compile_runs_eagerly_from_then_on(caplog: pytest.LogCaptureFixture) -> None:
    from worker.fastpath.ops import Fused, silu_mul

    op = Fused(silu_mul, compiled=False)
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(op(gate, up), want, rtol=0, atol=0)

    def broken(*args: Any) -> Any:
        raise RuntimeError("no compiler")

    op.compiled = broken
    with caplog.at_level(logging.ERROR, logger="kevlaya.fastpath"):
        torch.testing.assert_close(op(gate, up), want, rtol=0, atol=0)
    assert op.compiled is None and "torch.compile of silu_mul failed" in caplog.text

    def out_of_memory(*args: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory")

    op.compiled = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):  # the engine's retry and split handle that, not a fallback
        op(gate, up)


def test_our_kernels_that_fail_hand_over_to_the_compiled_functions_for_good(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Triton build or launch failure of our rotary / SiLU x up kernels (prefill's, and the decode step's with
    --pointwise-kernels) is logged once and the call goes on with the compiled (here eager) functions; running
    out of memory is not swallowed."""
    from worker.fastpath import ops, pointwise

    def broken(*args: Any) -> Any:
        raise RuntimeError("no Triton here")

    monkeypatch.setattr(pointwise, "rope", broken)
    monkeypatch.setattr(pointwise, "silu_mul", broken)
    step = ops.Ops(compiled=False).with_kernels()
    qk, cos, sin = torch.randn(2, 3, 4, 8), torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    with caplog.at_level(logging.ERROR, logger="kevlaya.fastpath"):
        got = step.rope(qk, cos, sin)
    torch.testing.assert_close(got, ops.rope(qk.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1)), rtol=0, atol=0)
    assert not step.kernels and "our broken kernel failed" in caplog.text
    gate, up = torch.randn(3, 4), torch.randn(3, 4)
    step.kernels = True
    torch.testing.assert_close(step.act_mul(torch.nn.SiLU(), gate, up), ops.silu_mul(gate, up), rtol=0, atol=0)
    assert not step.kernels

    def out_of_memory(*args: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(pointwise, "silu_mul", out_of_memory)
    step.kernels = True
    with pytest.raises(torch.OutOfMemoryError):
        step.act_mul(torch.nn.SiLU(), gate, up)


def test_a_joined_group_skips_an_adapter_none_of_its_members_has() -> None:
    """An adapter that targets other modules only (Laya on the MLP, say) adds nothing to this group."""
    from worker.fastpath.weights import Group, Proj

    layers = _lora_linears(torch.bfloat16, (48, 16))
    projs = [Proj(layer, torch.bfloat16) for layer in layers]
    for p in projs:
        p.lora.pop("laya"), p.fused.pop("laya")
    group = Group(projs, torch.bfloat16)
    assert set(group.lora) == {"kev"}
    x = torch.randn(4, 1, 32).to(torch.bfloat16)
    with torch.no_grad():
        got, _ = group(x, [("laya", None)])
        for g, layer in zip(got, layers, strict=True):
            torch.testing.assert_close(g, layer.base_layer(x), rtol=0, atol=0)
        assert group.merged("laya") is not None  # nothing to merge: the plain weights


def test_graph_cache_drops_large_idle_graphs_and_keeps_small_and_recent_ones(monkeypatch) -> None:
    from worker.fastpath import graphs

    clock = [1000.0]
    monkeypatch.setattr(graphs.time, "monotonic", lambda: clock[0])
    cache = graphs.GraphCache(torch.device("cpu"), use_graphs=False)
    ends = graphs.Ends(end_id=0, pad_id=0, stops=(0,))

    def key(rows: int) -> graphs.GraphKey:
        return graphs.GraphKey(rows=rows, length=64, adapters=("laya",), mixed=False, ends=ends)

    for rows in (1, 144, 256):
        cache.put(key(rows), graphs.Entry(state=None, graph=None))  # type: ignore[arg-type]
    clock[0] += 15
    assert cache.get(key(256)) is not None  # in use
    clock[0] += 10
    assert cache.drop_idle(20.0, min_rows=16) == 1  # the 144-row graph: idle 25 s; the 1-row one is small
    assert set(cache.entries) == {key(1), key(256)}
    clock[0] += 30
    assert cache.drop_idle(20.0, min_rows=16) == 1 and set(cache.entries) == {key(1)}
