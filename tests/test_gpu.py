"""Tests that need a CUDA device (`pytest -m gpu` on the GPU machine, see bench/GPU.md); skipped without one.

What only a GPU shows: a captured CUDA graph reads its inputs by address, so a tensor it reads must outlive
the call that captured it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import tiny_config
from worker.engine import Engine
from worker.fastpath import DecodeRow
from worker.loading import select_adapters

pytestmark = pytest.mark.gpu


def _fill_free_small_blocks(value: int) -> list[torch.Tensor]:
    """Occupy every free block of the caching allocator's small pool with `value`: allocate one-element
    tensors until the allocator has to open a new segment (it only does once no free block fits), so a block
    some tensor freed earlier now holds `value`. The tensors are returned to keep them alive."""
    junk: list[torch.Tensor] = []
    segments = torch.cuda.memory_stats()["segment.small_pool.current"]
    while torch.cuda.memory_stats()["segment.small_pool.current"] == segments:
        junk.extend(torch.full((1,), value, dtype=torch.long, device="cuda") for _ in range(256))
    return junk


def test_a_replayed_graph_reads_the_stop_ids_of_its_own_state(tiny_models: Path) -> None:
    """The stop ids a decode graph reads belong to the graph's state. Built per call (the old code), the
    tensor's block went back to the allocator when `decode` returned, and a later replay of the same graph
    read whatever was put there: here -1, so no row ever stopped."""
    engine = Engine(tiny_config(tiny_models, "none", kev_new=40), device="cuda")
    decoder = engine.decoders["default"]
    assert decoder.use_graphs
    base = engine.base_for("kev")
    pad_id = base.tokenizer.pad_token_id

    def decode(stop: int) -> torch.Tensor:
        rows = [DecodeRow(ids=[5 + i, 6, 7, 8, 9], max_new=40, adapter=base.adapters["kev"]) for i in range(2)]
        select = lambda names: select_adapters(base, names)  # noqa: E731
        return decoder.decode(rows, stop_ids=[stop], pad_id=pad_id, select=select).tokens

    free = decode(decoder.stack.head.out_features + 7)[0].tolist()  # an id past the vocabulary: no stop
    assert len(free) == 40
    # The stop: row 0's first token that it had not emitted before, at least three steps in.
    at = next(k for k in range(3, 40) if free[k] not in free[:k] and free[k] != pad_id)
    stop = free[at]
    first = decode(stop)  # captures this (rows, length, stops) graph and replays it
    assert first[0, : at + 1].tolist() == free[: at + 1]
    assert first[0, at + 1 :].eq(pad_id).all()  # stopped there: padding after it
    captured = decoder.captures
    junk = _fill_free_small_blocks(-1)
    second = decode(stop)  # the same graph, replayed: it must still stop row 0 at `at`
    del junk
    assert decoder.captures == captured  # replayed, not captured again
    assert torch.equal(second, first)


def test_logprobs_from_a_replayed_graph_match_hf_generate(tiny_models: Path) -> None:
    """Rows asking for logprobs on captured graphs (their slots owned by the graph's state) record what HF
    generate's scores give, replay after replay; the rows that do not ask are untouched by them."""
    from bench.fastpath import TokenRecorder
    from shared.job import Job

    config = tiny_config(tiny_models, "none", laya_new=16)
    graphs = TokenRecorder(config, device="cuda", decode="auto")
    eager = TokenRecorder(config, device="cuda", decode="eager", bases=graphs.bases)
    prompts = ["Approve a loan of 12000?", "Income 52000, debt low.", "x"]
    jobs = [
        Job(custom_id=f"j{i}", model="laya", prompt=p, logprobs=i != 1, top_logprobs=3 * (i != 1))
        for i, p in enumerate(prompts)
    ]
    want = eager.run(jobs)
    for _ in range(2):  # captured, then replayed
        got = graphs.run(jobs)
        for job, a, b in zip(jobs, got, want, strict=True):
            assert graphs.tokens[job.custom_id] == eager.tokens[job.custom_id]
            assert (a.logprobs is None) == (b.logprobs is None) == (not job.logprobs)
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert x.bytes == y.bytes and x.logprob == pytest.approx(y.logprob, abs=1e-3)
                assert [t.bytes for t in x.top_logprobs] == [t.bytes for t in y.top_logprobs]
    assert graphs.decoders["default"].use_graphs


def test_sampled_rows_on_a_replayed_graph_draw_what_the_loop_draws_without_graphs(tiny_models: Path) -> None:
    """Seeded sampled rows (with and without a top-p / top-k cut) beside greedy ones, captured then replayed: the
    same tokens as the static loop without graphs on the same device and weights. The draw converts only the
    sampler slots' rows to float32 and the greedy part is chosen a chunk of rows at a time, inside the graph."""
    from bench.fastpath import TokenRecorder
    from shared.job import Job

    config = tiny_config(tiny_models, "none", laya_new=16)
    graphs = TokenRecorder(config, device="cuda", decode="auto")
    plain = TokenRecorder(config, device="cuda", decode="static", bases=graphs.bases)
    prompts = ["Approve a loan of 12000?", "Income 52000, debt low.", "x", "Step 1: check income " * 5]
    jobs = [Job(custom_id=f"g{i}", model="laya", prompt=p) for i, p in enumerate(prompts)] + [
        Job(custom_id="s0", model="laya", prompt=prompts[0], temperature=1.3, seed=11),
        Job(custom_id="s1", model="laya", prompt=prompts[1], temperature=0.8, seed=12, top_p=0.9),
        Job(custom_id="s2", model="laya", prompt=prompts[3], temperature=1.0, seed=13, top_k=5),
    ]
    plain.run(jobs)
    for _ in range(2):  # captured, then replayed
        graphs.run(jobs)
        assert {j.custom_id: graphs.tokens[j.custom_id] for j in jobs} == {
            j.custom_id: plain.tokens[j.custom_id] for j in jobs
        }
    assert graphs.decoders["default"].use_graphs and not plain.decoders["default"].use_graphs


def test_captures_do_not_leave_memory_behind_once_their_graphs_are_gone(tiny_models: Path) -> None:
    """What the allocator holds after graphs of many shapes were captured and released comes back to what it held
    after the first round: a capture leaves nothing of its own behind. Capturing each on a stream of its own
    left a cuBLAS workspace per stream for the life of the process (held memory grew with every capture, and
    every take after a few dozen captures was planned smaller)."""
    engine = Engine(tiny_config(tiny_models, "none", kev_new=8), device="cuda")
    decoder = engine.decoders["default"]
    assert decoder.use_graphs
    base = engine.base_for("kev")
    select = lambda names: select_adapters(base, names)  # noqa: E731

    def a_round() -> int:
        for rows in (1, 3, 7, 12, 20, 40, 70):
            batch = [DecodeRow(ids=[5 + i % 9, 6, 7], max_new=8, adapter=base.adapters["kev"]) for i in range(rows)]
            decoder.decode(batch, stop_ids=[-1], pad_id=0, select=select)
        decoder.release()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return int(torch.cuda.memory_reserved())

    first = a_round()
    captured = decoder.captures
    for _ in range(4):
        last = a_round()
    assert decoder.captures - captured >= 4 * 7  # every round captured its seven graphs again
    assert last <= first + 2 * 1024**2, (first, last)


def test_the_plan_reads_a_capture_into_a_fresh_pool_and_not_one_beside_it(tiny_models: Path) -> None:
    """The pool's bookkeeping the memory plan reads (`StaticDecoder.pool_readings`): the first capture into a
    fresh pool is kept at its rows, with what it grew the pool by; a capture beside it into the same pool is not
    (it grows the pool only past what the first left); a release starts a fresh pool and keeps the readings."""
    engine = Engine(tiny_config(tiny_models, "none", kev_new=8), device="cuda")
    decoder = engine.decoders["default"]
    base = engine.base_for("kev")
    select = lambda names: select_adapters(base, names)  # noqa: E731

    def decode(rows: int) -> None:
        batch = [DecodeRow(ids=[5 + i % 9, 6, 7], max_new=4, adapter=base.adapters["kev"]) for i in range(rows)]
        decoder.decode(batch, stop_ids=[-1], pad_id=0, select=select)

    decoder.release()
    decoder.pool_readings.clear()
    decode(12)
    graphs = decoder.graphs
    assert graphs.pool_captures == 1 and graphs.last_pool_growth_bytes > 0
    assert decoder.pool_readings == {decoder.graph_rows: graphs.last_pool_growth_bytes}
    first = dict(decoder.pool_readings)
    decode(3)  # a graph of its own, captured into the same pool
    assert graphs.pool_captures == 2 and decoder.pool_readings == first
    decoder.release()
    assert graphs.pool_captures == 0 and decoder.pool_readings == first


BF16_PROMPTS = ["Approve a loan of 12000?", "Income 52000, debt low.", "x", "Step 1: check income " * 5]


def bf16_engine(tiny_models: Path, name: str, **kw: Any) -> Engine:
    """The tiny models in bfloat16 on the GPU (the dtype our kernels run in), under a config file `name`."""
    from worker.config import load_config

    path = tiny_models / name
    path.write_text(tiny_config(tiny_models, "none").path.read_text().replace('"float32"', '"bfloat16"'))
    return Engine(load_config(path), device="cuda", decode="auto", **kw)


def bf16_batches(base: Any) -> Iterator[tuple[list[str], list[DecodeRow], dict[str, Any]]]:
    """(adapters, rows, decode keywords): the prompts once with Kev alone, once with Kev and Laya mixed."""
    ids = [base.tokenizer(p).input_ids for p in BF16_PROMPTS]
    kw = {"stop_ids": [-1], "pad_id": base.tokenizer.pad_token_id, "select": lambda n: select_adapters(base, n)}
    for adapters in (["kev"], ["kev", "laya"]):
        rows = [DecodeRow(ids=r, max_new=12, adapter=adapters[i % len(adapters)]) for i, r in enumerate(ids)]
        yield adapters, rows, kw


def test_our_pointwise_kernels_decode_on_replayed_graphs_as_the_compiled_functions(tiny_models: Path) -> None:
    """In bfloat16 on replayed graphs, a decoder with our rotary and SiLU x up kernels (in its prefill and its
    decode steps) emits the tokens of one with the eager functions (both without torch.compile, whose kernels
    are not bit-equal to eager; ours are, as `bench kernels` measured on the H200)."""
    from worker.fastpath import OpsOptions, StaticDecoder

    engine = bf16_engine(tiny_models, "models-bf16-gpu.toml", ops=OpsOptions(compile_ops=False))
    (base,), (plain,) = engine.bases.values(), engine.decoders.values()
    eager_ours = OpsOptions(compile_ops=False, pointwise_kernels=True)
    ours = StaticDecoder(base.model, torch.device("cuda"), use_graphs=True, ops=eager_ours)
    assert ours.stack.step_ops.kernels and ours.stack.prefill_ops.kernels and plain.use_graphs
    assert not plain.stack.step_ops.kernels and not plain.stack.prefill_ops.kernels
    # Prefill's residual-add-and-norm kernel sums its squares in another order than eager: its own test below.
    ours.prefill.ops = ours.stack.step_ops
    for adapters, rows, kw in bf16_batches(base):
        want = plain.decode(rows, **kw)
        for _ in range(2):  # captured, then replayed
            got = ours.decode(rows, **kw)
            assert torch.equal(got.tokens, want.tokens), adapters
            torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0)


def test_prefill_with_our_norm_kernel_decodes_as_without_it(tiny_models: Path) -> None:
    """Prefill's residual-add-and-norm kernel (the default wherever our kernels run) against the compiled
    function, both in bfloat16 with graphs replayed: the same tokens, log-probabilities within bfloat16 rounding
    (its sum of squares runs in another order, as the compiled function's does against eager's)."""
    from worker.fastpath import StaticDecoder

    engine = bf16_engine(tiny_models, "models-bf16-norm.toml")
    (base,), (ours,) = engine.bases.values(), engine.decoders.values()
    assert ours.prefill.ops.norm_kernel and ours.prefill.ops.kernels and not ours.stack.step_ops.norm_kernel
    compiled = StaticDecoder(base.model, torch.device("cuda"), use_graphs=True)
    compiled.prefill.ops = compiled.stack.step_ops  # the compiled residual-add-and-norm, ours otherwise
    for adapters, rows, kw in bf16_batches(base):
        want = compiled.decode(rows, **kw)
        got = ours.decode(rows, **kw)
        assert torch.equal(got.tokens, want.tokens), adapters
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0.05)


def test_prefill_in_row_blocks_decodes_as_in_whole_matmuls(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch, blocked_rows: list[int]
) -> None:
    """Prefill's matmuls in row blocks (`gemm`: here of 64 rows, so the tiny chunks split and smaller counts run
    rounded up to 8; 256 and 32 in the worker) against whole matmuls, in bfloat16 with graphs replayed: the same
    tokens, log-probabilities within bfloat16 rounding (a block's rows may run in another kernel than the whole
    matmul's)."""
    from worker.fastpath import gemm

    engine = bf16_engine(tiny_models, "models-bf16-blocks.toml")
    (base,), (decoder,) = engine.bases.values(), engine.decoders.values()
    assert blocked_rows  # the warm-up's largest take ran its chunks in blocks of 256
    blocked_rows.clear()
    for adapters, rows, kw in bf16_batches(base):
        with monkeypatch.context() as whole:
            whole.setattr(gemm, "block_on", lambda is_cuda: None)  # every matmul whole, at its own count
            want = decoder.decode(rows, **kw)
        assert not blocked_rows
        monkeypatch.setattr(gemm, "ROW_BLOCK", 64)
        got = decoder.decode(rows, **kw)
        # The blocks and the steps below them ran.
        assert blocked_rows and all(m % 64 == 0 or (m < 64 and m % 8 == 0) for m in blocked_rows), adapters
        blocked_rows.clear()
        assert torch.equal(got.tokens, want.tokens), adapters
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0.05)


def test_choice_scores_in_bfloat16_match_a_plain_log_likelihood(tiny_models: Path) -> None:
    """On the GPU, choices run beside their prompts inside the prefill with our kernels, one adapter's LoRA
    merged into the weights (Kev alone) or each adapter's masked per row (Kev and Laya mixed), in chunks small
    enough to split the rows: each choice's log-likelihood is HF's for prompt + choice alone, within bfloat16
    rounding, and no KV pool is allocated."""
    from worker.fastpath import ScoreRow

    engine = bf16_engine(tiny_models, "models-bf16-score.toml")
    (base,), (decoder,) = engine.bases.values(), engine.decoders.values()
    decoder.release()
    decoder.prefill.tokens = decoder.prefill.max_tokens = 48
    labels = (" approve", " reject now", " needs review by the committee")
    choice_ids = tuple((*base.tokenizer(c).input_ids, 2) for c in labels)
    for adapters in (["kev"], ["kev", "laya"]):
        rows = [
            ScoreRow(
                ids=base.tokenizer(p).input_ids, choices=choice_ids[: 1 + i % 3], adapter=adapters[i % len(adapters)]
            )
            for i, p in enumerate(BF16_PROMPTS)
        ]
        scored = decoder.score(rows, pad_id=base.tokenizer.pad_token_id)
        assert scored is not None and decoder.pool.buffer is None
        assert scored.bad == [False] * len(rows)
        for row, got in zip(rows, scored.loglik, strict=True):
            want = []
            for choice in row.choices:
                with select_adapters(base, [row.adapter]), torch.inference_mode():
                    ids = torch.tensor([row.ids + list(choice)], device="cuda")
                    logp = base.model(input_ids=ids).logits[0].float().log_softmax(-1)
                want.append(sum(float(logp[len(row.ids) - 1 + i, t]) for i, t in enumerate(choice)))
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0.02, atol=0.15)


def test_prefill_and_scoring_after_a_shared_prefix_are_those_of_the_whole_rows(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows that all start with the same tokens (Kev alone, its LoRA merged): their prefix runs once, is kept,
    and each chunk's attention reads its K/V before the chunk's own through flash's bottom-right causal kernel
    (grouped KV heads as they are). Decoded with it -- made by the first take, kept for the second -- the same
    tokens as the rows run whole, log-probabilities within bfloat16 rounding; choices scored after it, HF's
    log-likelihood of prompt + choice within bfloat16 rounding."""
    from worker.fastpath import ScoreRow
    from worker.fastpath.prefix import PrefixCache

    engine = bf16_engine(tiny_models, "models-bf16-prefix.toml")
    (base,), (decoder,) = engine.bases.values(), engine.decoders.values()
    decoder.prefill.tokens = decoder.prefill.max_tokens = 96  # chunks small enough to split the rows
    shared = base.tokenizer("You review loan decisions for a bank and answer with a single word, nothing else.")
    assert len(shared.input_ids) >= 16
    ids = [shared.input_ids + base.tokenizer(p).input_ids for p in BF16_PROMPTS]
    rows = [DecodeRow(ids=r, max_new=12, adapter="kev") for r in ids]
    kw = {"stop_ids": [-1], "pad_id": base.tokenizer.pad_token_id, "select": lambda n: select_adapters(base, n)}
    decoder.prefill.prefixes = PrefixCache(min_tokens=0)
    want = decoder.decode(rows, **kw)
    flash: list[int] = []
    real = torch.ops.aten._scaled_dot_product_flash_attention
    spy = lambda q, k, *a, **k2: (flash.append(k.shape[2] - q.shape[2]), real(q, k, *a, **k2))[1]  # noqa: E731
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", spy)
    decoder.prefill.prefixes = PrefixCache()
    for take in range(2):
        got = decoder.decode(rows, **kw)
        assert torch.equal(got.tokens, want.tokens), take
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0.05)
        (kept,) = decoder.prefill.prefixes._made.values()
        assert kept.length >= len(shared.input_ids) - 1
        assert flash and all(k == kept.length for k in flash)  # every chunk: flash, the prefix's keys first
        flash.clear()
    labels = (" approve", " reject now", " needs review by the committee")
    choice_ids = tuple((*base.tokenizer(c).input_ids, 2) for c in labels)
    scored_rows = [ScoreRow(ids=r, choices=choice_ids[: 1 + i % 3], adapter="kev") for i, r in enumerate(ids)]
    scored = decoder.score(scored_rows, pad_id=base.tokenizer.pad_token_id)
    assert scored is not None and scored.bad == [False] * len(rows)
    assert flash and all(k == kept.length for k in flash)
    for row, got_scores in zip(scored_rows, scored.loglik, strict=True):
        expected = []
        for choice in row.choices:
            with select_adapters(base, ["kev"]), torch.inference_mode():
                logp = base.model(input_ids=torch.tensor([row.ids + list(choice)], device="cuda")).logits[0]
                logp = logp.float().log_softmax(-1)
            expected.append(sum(float(logp[len(row.ids) - 1 + i, t]) for i, t in enumerate(choice)))
        torch.testing.assert_close(torch.tensor(got_scores), torch.tensor(expected), rtol=0.02, atol=0.15)


def test_our_nf4_kernel_is_bitsandbytes_dequantise_in_bfloat16() -> None:
    """Our NF4 kernel (worker/fastpath/nf4.py) on the GPU, bf16 out: bit-equal to bitsandbytes' CUDA dequantise,
    in blocks of 64, 128 and 4,096 (two blocks a program), with a short last block, with rows appended exactly."""
    import bitsandbytes.functional as bnb

    from worker.fastpath import nf4

    torch.manual_seed(0)
    shapes = ((2048, 1536, 64), (8960, 1536, 64), (1536, 8960, 128), (3, 64, 64), (2, 4096, 4096), (5, 24, 64))
    for rows, cols, blocksize in shapes:
        weight = torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda")
        packed, state = bnb.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4")
        want = torch.ops.bitsandbytes.dequantize_4bit.default(
            packed, state.absmax, blocksize, "nf4", [rows, cols], torch.bfloat16
        )
        extra = torch.randn(40, cols, dtype=torch.bfloat16, device="cuda")
        assert nf4.serves(packed.device, torch.bfloat16, "nf4", blocksize)
        code = nf4.code_table(state.code.to(device="cuda"))
        got = nf4.dequantize(
            packed, state.absmax, code, shape=(rows, cols), blocksize=blocksize, dtype=torch.bfloat16, extra=extra
        )
        assert got is not None and nf4.KERNEL.on
        assert torch.equal(got[:rows], want), (rows, cols, blocksize)
        assert torch.equal(got[rows:], extra)


def test_the_fused_greedy_choice_is_torchs_on_a_vocabulary_of_qwens_size() -> None:
    """Our greedy-choice kernel (worker/fastpath/greedy.py) on bf16 logits of 256 rows x 151,936: the token of
    torch's argmax over the float32 logits (the first of equal maxima), its log-probability within float32
    rounding, non-finite rows flagged and ending with `end_id`."""
    from worker.fastpath import greedy, sampling

    torch.manual_seed(0)
    logits = (torch.randn(256, 151936, device="cuda") * 4).to(torch.bfloat16)
    logits[1, 7] = logits[1, 100000] = logits[1].max() + 1
    logits[2, 5] = float("nan")
    logits[3, 9] = float("inf")
    assert greedy.KERNEL.serves(logits)
    token, logprob, finite = greedy.KERNEL(logits, 2)
    want_token, want_logprob, want_finite, _ = sampling.token_choice(logits.float(), 2)
    assert torch.equal(token, want_token) and torch.equal(finite, want_finite) and int(token[1]) == 7
    ok = want_finite
    torch.testing.assert_close(logprob[ok], want_logprob[ok], rtol=1e-5, atol=1e-5)


def test_the_lora_folded_nf4_matmul_is_the_separate_one_within_bfloat16_rounding(tiny_models: Path) -> None:
    """4-bit bf16 weights on the GPU: a projection's matmul by our NF4 kernel with every adapter's LoRA shrink
    folded in (`weights.Fold`) against bitsandbytes' dequantise with the separate LoRA matmuls, Kev alone and Kev
    with Laya masked per row, for a joint group (q/k/v, with its bias) and a single projection (down). The same
    products in another cuBLAS kernel (the folded matmul has the shrink's extra columns): within bf16 rounding,
    not bit for bit -- so tokens of this random tiny model may part (the CPU test checks them in float16)."""
    from worker.config import load_config
    from worker.fastpath import nf4

    path = tiny_models / "models-nf4-bf16-gpu.toml"
    path.write_text(tiny_config(tiny_models, "nf4").path.read_text().replace('"float32"', '"bfloat16"'))
    engine = Engine(load_config(path), device="cuda", decode="auto")
    (decoder,) = engine.decoders.values()
    layer = decoder.stack.layers[0]
    assert layer.qkv.joint is not None and layer.qkv.joint.quant is not None and layer.qkv.joint.quant.folds()
    torch.manual_seed(0)
    rows = 48
    kev = (torch.arange(rows, device="cuda") % 2 == 0).to(torch.bfloat16).view(rows, 1, 1)
    try:
        for masks in ([("kev", None)], [("kev", kev), ("laya", 1 - kev)]):
            for proj in (layer.qkv, layer.down):
                features = proj.joint.quant.shape[1] if proj is layer.qkv else proj.base.in_features
                x = torch.randn(rows, 1, features, dtype=torch.bfloat16, device="cuda")
                nf4.KERNEL.on = True
                got = proj._folded(x, masks)
                assert got is not None and nf4.KERNEL.on
                nf4.KERNEL.on = False
                want = proj(x, masks)
                want = want[1] if isinstance(want, tuple) else want  # a group: (members' outputs, joint output)
                scale = float(want.abs().max())
                torch.testing.assert_close(got, want, rtol=0.02, atol=0.01 * scale)
    finally:
        nf4.KERNEL.on = True


def test_the_merged_dequantise_candidate_is_dequantise_then_addmm_in_bfloat16() -> None:
    """`bench nf4merge`'s kernel on the GPU in bf16 (Triton's interpreter multiplies bf16 tiles wrongly, so the CPU
    test runs fp16 and fp32): a Qwen2.5-1.5B gate/up and down weight in NF4 with a rank-16 and a rank-24 LoRA merged,
    against bitsandbytes' dequantise then `addmm_` -- within 2^-6 of |W + B A| + |B A| (about two bf16 units in
    the last place), at every tile `bench nf4merge` times. The two round differently (the reference rounds W to
    bf16 before adding B A, and each result is rounded once more), so they may sit a unit apart: on the H100,
    ~3% of the elements were more than 2^-8 of that sum apart, none more than 1.98 x 2^-8. A wrong weight, scale
    or LoRA row is off by the value itself, far past the bound."""
    from bench import nf4merge
    from bench.kernels import random_nf4

    torch.manual_seed(0)
    for (rows, cols), rank in (((17920, 1536), 16), ((1536, 8960), 24)):
        weight = random_nf4((rows, cols), torch.device("cuda"))
        layout, packed = weight.layout, weight.packed
        b = torch.randn(rows, rank, device="cuda", dtype=torch.bfloat16) * 0.02
        a = torch.randn(rank, cols, device="cuda", dtype=torch.bfloat16) * 0.02
        want = layout.dense(packed).addmm_(b, a)
        bound = 2**-6 * (want.float().abs() + (b.float() @ a.float()).abs()) + 1e-6
        for tile in nf4merge.TILES:
            got = nf4merge.dense_merged(layout, packed, b, a, tile)
            diff = (got.float() - want.float()).abs()
            off = diff > bound
            worst = float((diff / bound).max())
            assert not off.any(), f"tile {tile}: {int(off.sum())} of {off.numel()} elements past it ({worst:.1f}x)"


def test_the_pinned_ring_never_overwrites_bytes_a_queued_copy_has_not_read() -> None:
    """Copies queued behind a long kernel, through a ring a fraction of their total size: the host comes round to
    each region while the GPU has not yet run the copies from it, and must wait for them; every tensor arrives as
    it was sent (without the wait, later tensors' bytes would overwrite earlier ones' before their copies ran).
    The buffer is pinned, and the first pass round the ring does not wait (pageable memory would copy at once,
    and the test could not fail)."""
    import time

    from worker.fastpath.staging import REGIONS, PinnedRing, to_cuda

    device = torch.device("cuda", torch.cuda.current_device())
    ring = PinnedRing(device, nbytes=16 * 1024)
    assert ring.buffer.is_pinned()
    sent = [torch.full((300,), i, dtype=torch.int64) for i in range(64)]  # 2,400 bytes each: 150 KiB in all
    warm = [torch.empty(300, dtype=torch.int64, device=device) for _ in sent]  # the allocator's blocks ready
    del warm
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU time ahead of every copy below
    started = time.perf_counter()
    arrived = [ring.send(sent[i]) for i in range(REGIONS)]
    first_pass_s = time.perf_counter() - started
    arrived += [ring.send(t) for t in sent[REGIONS:]]
    torch.cuda.synchronize()
    assert first_pass_s < 0.2, "the first pass round the ring waited for the GPU"
    for want, got in zip(sent, arrived, strict=True):
        assert torch.equal(got.cpu(), want)
    assert torch.equal(to_cuda(torch.arange(5), torch.device("cuda")).cpu(), torch.arange(5))


def test_the_pinned_ring_waits_for_copies_queued_on_a_side_stream() -> None:
    """Copies queued on a side stream behind a long kernel, while the default stream idles: the ring's events are
    recorded on the stream the copies went on, so it still waits before reusing their bytes."""
    from worker.fastpath.staging import PinnedRing

    device = torch.device("cuda", torch.cuda.current_device())
    ring = PinnedRing(device, nbytes=16 * 1024)
    assert torch.equal(ring.send(torch.arange(3)).cpu(), torch.arange(3))  # a region begun on the default stream
    sent = [torch.full((300,), i, dtype=torch.int64) for i in range(32)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)
        arrived = [ring.send(t) for t in sent]
    torch.cuda.synchronize()
    for want, got in zip(sent, arrived, strict=True):
        assert torch.equal(got.cpu(), want)


def test_our_decode_attention_is_sdpa_under_the_mask_in_bfloat16_and_on_a_replayed_graph() -> None:
    """A 256-row step's attention at Qwen2.5-1.5B's heads (2 KV heads of 6 queries, 128 features) over a
    512-column cache, each row from its own first column: within bf16 rounding of SDPA under the rows' mask (in
    float32); captured in a graph, a replay reads the firsts and the last column written into its inputs since."""
    from worker.fastpath.decode_attention import decode_attention, serves

    torch.manual_seed(0)
    rows, kv_heads, groups, length, dim = 256, 2, 6, 512, 128
    q = torch.randn(rows, kv_heads, groups, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(rows, kv_heads, length, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    first = torch.zeros(rows, dtype=torch.long, device="cuda")
    last = torch.zeros(1, dtype=torch.long, device="cuda")
    assert serves(q, k, v)

    def want() -> torch.Tensor:
        cols = torch.arange(length, device="cuda")
        mask = ((cols >= first[:, None]) & (cols <= last)).view(rows, 1, 1, length)
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)

    def fill(top: int) -> None:
        last.fill_(top)
        first.copy_(torch.randint(0, top + 1, (rows,), device="cuda"))
        first[:3] = torch.tensor([top, 0, min(64, top)])  # one column (bucket padding), all, a block edge

    fill(300)
    got = decode_attention(q, k, v, first, last, scale=dim**-0.5)
    assert got is not None
    torch.testing.assert_close(got.float(), want(), rtol=0.02, atol=0.02)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, first, last, scale=dim**-0.5)
    assert out is not None
    for top in (450, 17, 511):
        fill(top)
        graph.replay()
        torch.testing.assert_close(out.float(), want(), rtol=0.02, atol=0.02)


def test_decode_with_our_attention_on_replayed_graphs_keeps_its_tokens(
    tiny_models: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16, graphs replayed: a decoder whose steps run our attention kernel emits the tokens of one whose steps
    run SDPA under the mask (the kernel switched off before that one captured), log-probabilities within bf16
    rounding. (The tiny batches are far below the rows the kernel waits for on a GPU: allowed any here.)"""
    from worker.fastpath import StaticDecoder, decode_attention

    monkeypatch.setattr(decode_attention, "MIN_PROGRAMS", 1)
    engine = bf16_engine(tiny_models, "models-bf16-attention.toml")
    (base,), (ours,) = engine.bases.values(), engine.decoders.values()
    assert ours.use_graphs and decode_attention.KERNEL.on
    calls = [0]
    real = decode_attention.decode_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    batches = list(bf16_batches(base))
    try:
        decode_attention.decode_attention = counted
        got = [ours.decode(rows, **kw) for _, rows, kw in batches for _ in range(2)][1::2]  # captured, replayed
        assert calls[0] > 0
        decode_attention.KERNEL.on = False
        sdpa = StaticDecoder(base.model, torch.device("cuda"), use_graphs=True)
        for (adapters, rows, kw), mine in zip(batches, got, strict=True):
            want = sdpa.decode(rows, **kw)
            assert torch.equal(mine.tokens, want.tokens), adapters
            torch.testing.assert_close(mine.logprobs, want.logprobs, rtol=0, atol=0.05)
    finally:
        decode_attention.decode_attention = real
        decode_attention.KERNEL.on = True
