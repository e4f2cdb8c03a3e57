"""A prompt prefix every row of a take shares, run once (worker/fastpath/prefix.py): which prefix a take shares,
and prefill and scoring with it against the same rows run whole -- the same K/V cache and first-token logits up
to float rounding (the prefix's matmuls and attention run apart from the rows'), the same tokens, choice scores
equal to HF's log-likelihood -- with the prefix made by a take and kept for the next."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.job import Job
from tests import test_prefill as layer_major
from tests.conftest import tiny_config
from tests.test_scoring import reference
from worker.engine import Engine
from worker.fastpath import DecodeRow, ScoreRow, StaticDecoder
from worker.fastpath.ops import causal_attention
from worker.fastpath.prefix import (
    KEPT_TOKENS,
    MAX_TOKENS,
    MIN_TOKENS,
    PrefixCache,
    SharedPrefix,
    Suffix,
    common_prefix,
    suffixes,
)

LAYERS = 2
# The static loops of test_prefill (float32, 4-bit, bfloat16, 4-bit dequantised by the loop), as fixtures here.
loop = layer_major.loop
decoder = layer_major.decoder
PREFIX = [(5 * t) % 40 + 3 for t in range(20)]  # 20 tokens every row below starts with


def rows_after(prefix: Sequence[int], lengths: Sequence[int], adapter: str | None = "kev") -> list[DecodeRow]:
    return [
        DecodeRow(ids=[*prefix, *[(7 * i + 3 * t) % 50 + 3 for t in range(n)]], max_new=4, adapter=adapter)
        for i, n in enumerate(lengths)
    ]


def made(ids: Sequence[int], adapter: str | None = "kev") -> SharedPrefix:
    prefix = SharedPrefix(ids=tuple(ids), adapter=adapter)
    prefix.kv = [(torch.zeros(1), torch.zeros(1))] * LAYERS
    return prefix


# ---- which prefix a take shares --------------------------------------------------------------------------------


def test_the_common_prefix_is_what_every_row_starts_with_leaving_each_a_token_of_its_own() -> None:
    rows = rows_after(PREFIX, [3, 9, 1])
    assert common_prefix(rows, 16) == tuple(PREFIX)
    # A row that is the prefix and one token more keeps that token; one that is only the prefix shortens it.
    assert common_prefix([*rows, DecodeRow(ids=PREFIX, max_new=1, adapter="kev")], 16) == tuple(PREFIX[:19])
    assert common_prefix(rows, 21) is None  # fewer in common than asked for
    other = DecodeRow(ids=[*PREFIX[:17], 99, 98], max_new=1, adapter="kev")
    assert common_prefix([*rows, other], 16) == tuple(PREFIX[:17])
    assert common_prefix(rows_after(PREFIX, [3]) + rows_after(PREFIX, [4], "laya"), 16) is None  # two adapters
    assert common_prefix(rows_after(PREFIX, [5, 6], None), 16) == tuple(PREFIX)  # the base model alone
    assert common_prefix([], 16) is None
    assert common_prefix(rows, 16, most=18) == tuple(PREFIX[:18])


def test_the_rows_own_tokens_follow_the_prefix() -> None:
    rows = rows_after(PREFIX, [3, 5])
    prefix = made(PREFIX)
    assert suffixes(rows, prefix) == [Suffix(ids=r.ids[20:], adapter="kev") for r in rows]
    assert suffixes(rows, None) is rows


def test_a_kept_prefix_serves_the_takes_that_start_with_it() -> None:
    cache = PrefixCache(min_tokens=16, kept=2)
    rows = rows_after(PREFIX, [3, 9])
    new = cache.for_rows(rows, LAYERS)
    assert new is not None and new.ids == tuple(PREFIX) and not new.made(LAYERS)
    assert cache.for_rows(rows, LAYERS) is not new  # not kept until a take has made it through every layer
    cache.keep(new, LAYERS)  # made by none: not kept
    assert cache.for_rows(rows, LAYERS) is not new
    kept = made(PREFIX)
    cache.keep(kept, LAYERS)
    assert cache.for_rows(rows_after(PREFIX, [4, 2]), LAYERS) is kept
    # A take sharing a few tokens more than the kept prefix is served by it; sharing `min_tokens` more, it makes
    # the longer one; sharing less, its own shorter one.
    assert cache.for_rows(rows_after([*PREFIX, 1, 2], [3, 4]), LAYERS) is kept
    longer = cache.for_rows(rows_after([*PREFIX, *range(1, 17)], [3, 4]), LAYERS)
    assert longer is not None and longer.length == 36
    shorter = cache.for_rows(rows_after(PREFIX[:18], [3, 4]), LAYERS)
    assert shorter is not None and shorter.length == 18
    # Another adapter's rows are not served by the kept one; at most `kept` are kept, the least recent dropped.
    laya = cache.for_rows(rows_after(PREFIX, [3, 4], "laya"), LAYERS)
    assert laya is not None and laya is not kept and laya.adapter == "laya"
    cache.keep(made([*PREFIX, 1]), LAYERS)
    cache.keep(made(PREFIX, "laya"), LAYERS)
    assert cache.for_rows(rows_after(PREFIX, [4, 2]), LAYERS) is not kept


def test_a_new_prefix_settles_on_what_it_shares_with_a_kept_one() -> None:
    """Rows numbered 100-199 share "Case 1" beyond the template; the next take's, "Case 2": its prefix is cut back
    to the part both share, which then serves every take after it."""
    cache = PrefixCache(min_tokens=16)
    first = made([*PREFIX, 7, 1])
    cache.keep(first, LAYERS)
    second = cache.for_rows(rows_after([*PREFIX, 7, 2], [3, 4]), LAYERS)
    assert second is not None and second.ids == (*PREFIX, 7)
    settled = made([*PREFIX, 7])
    cache.keep(settled, LAYERS)
    assert cache.made == 2
    assert cache.for_rows(rows_after([*PREFIX, 7, 3], [3, 4]), LAYERS) is settled
    cache.keep(settled, LAYERS)  # kept again by the take it served: not made again
    assert cache.made == 2


def test_a_kept_prefix_two_kinds_of_take_settled_on_serves_them_again() -> None:
    """Takes of kind A share the template and 20 tokens more, takes of kind B the template and 20 others: once B
    settled on the template, it is what B's takes get (kept, not made again), however much more they share."""
    cache = PrefixCache(min_tokens=16)
    a, b = [*PREFIX, *range(100, 120)], [*PREFIX, *range(200, 220)]
    cache.keep(made(a), LAYERS)
    settled = cache.for_rows(rows_after(b, [3, 4]), LAYERS)
    assert settled is not None and settled.ids == tuple(PREFIX)
    cache.keep(made(PREFIX), LAYERS)
    (kept,) = [p for p in cache._made.values() if p.ids == tuple(PREFIX)]
    for _ in range(3):
        assert cache.for_rows(rows_after(b, [5, 6]), LAYERS) is kept
    assert cache.for_rows(rows_after(a, [5, 6]), LAYERS) is not kept  # A's own longer one still serves A


def test_one_row_makes_no_prefix_and_kept_ones_stay_small() -> None:
    """A take of one row has nothing to share (its prompt less a token would be kept for nobody); a kept prefix
    serves it. What is kept stays within `KEPT_TOKENS` tokens together, and a prefix within `MAX_TOKENS`."""
    cache = PrefixCache(min_tokens=16)
    assert cache.for_rows(rows_after(PREFIX, [300]), LAYERS) is None
    kept = made(PREFIX)
    cache.keep(kept, LAYERS)
    assert cache.for_rows(rows_after(PREFIX, [30]), LAYERS) is kept
    document = [7 + t % 90 for t in range(MAX_TOKENS + 200)]
    long = cache.for_rows(rows_after(document, [5, 9]), LAYERS)
    assert long is not None and long.length == MAX_TOKENS
    for n in range(3):
        cache.keep(made([n, *document[: MAX_TOKENS - 1]]), LAYERS)
    assert sum(p.length for p in cache._made.values()) <= KEPT_TOKENS
    cache.clear()
    assert not cache._made


def test_no_prefix_is_shared_where_sharing_is_off_or_the_rows_share_too_little() -> None:
    rows = rows_after(PREFIX, [3, 9])
    assert PrefixCache(min_tokens=0).for_rows(rows, LAYERS) is None
    assert PrefixCache(min_tokens=MIN_TOKENS).for_rows(rows_after(PREFIX[: MIN_TOKENS - 1], [3, 9]), LAYERS) is None
    # 20 shared tokens of rows of 420 (under 5%): not worth a pass; of rows of 320, they are.
    assert PrefixCache(min_share=0.05).for_rows(rows_after(PREFIX, [400, 400]), LAYERS) is None
    assert PrefixCache(min_share=0.05).for_rows(rows_after(PREFIX, [300, 300]), LAYERS) is not None


# ---- attention after a prefix ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (2, 2)])
def test_queries_after_a_prefix_see_it_and_their_own_earlier_tokens(heads: int, kv_heads: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(3, heads, 5, 8)
    k, v = torch.randn(3, kv_heads, 9, 8), torch.randn(3, kv_heads, 9, 8)
    got = causal_attention(q, k, v, scale=0.3)
    groups = heads // kv_heads
    sees = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=4)  # query i: the 4 prefix keys and its own up to i
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=sees, scale=0.3
    )
    torch.testing.assert_close(got, want)


# ---- prefill and scoring with a shared prefix ------------------------------------------------------------------


def prefill_with(decoder: StaticDecoder, rows: Sequence[DecodeRow], *, share: bool) -> tuple[list, torch.Tensor]:
    """(K/V, first-token logits) of a prefill of `rows` on a fresh cache, sharing their prefix or not."""
    prefill = decoder.prefill
    kept = prefill.prefixes
    prefill.prefixes = kept if share else PrefixCache(min_tokens=0)
    try:
        width = max(len(r.ids) for r in rows)
        kv = layer_major.fresh_kv(decoder, len(rows), width + 4)
        with torch.inference_mode():
            logits = prefill.run(kv, rows, width=width, out_rows=len(rows), pad_id=0, select=layer_major._no_fallback)
    finally:
        prefill.prefixes = kept
    return kv, logits


def assert_close_prefill(
    decoder: StaticDecoder, rows: Sequence[DecodeRow], a: tuple[list, torch.Tensor], b: tuple[list, torch.Tensor]
) -> None:
    """The same K/V in every row's real columns (its padding's slots hold whatever its chunk's padding made:
    chunks differ in padding, and those slots are never read) and the same first-token logits and tokens."""
    bf16 = decoder.stack.dtype == torch.bfloat16
    # bitsandbytes' own 4-bit matmuls on the CPU round differently by how many rows they run: ~5e-4 apart.
    tolerance = {"atol": 3e-2, "rtol": 3e-2} if bf16 else {"atol": 2e-3, "rtol": 2e-3}
    width = max(len(r.ids) for r in rows)
    for (ka, va), (kb, vb) in zip(a[0], b[0], strict=True):
        for i, row in enumerate(rows):
            real = slice(width - len(row.ids), width)
            torch.testing.assert_close(ka[i, :, real], kb[i, :, real], **tolerance)
            torch.testing.assert_close(va[i, :, real], vb[i, :, real], **tolerance)
    torch.testing.assert_close(a[1].float(), b[1].float(), **tolerance)
    assert torch.equal(a[1].float().argmax(-1), b[1].float().argmax(-1))


@pytest.mark.parametrize("group_tokens", [1000, 30])  # one layer-major group; several, the prefix made in the first
def test_prefill_after_a_shared_prefix_is_prefill_of_the_whole_rows(decoder: StaticDecoder, group_tokens: int) -> None:
    rows = rows_after(PREFIX, [3, 9, 1, 14, 6, 6, 11, 2])  # several chunks of 24 tokens, rows out of order
    decoder.prefill.prefixes = PrefixCache()
    decoder.prefill.group_tokens = group_tokens
    layers = len(decoder.stack.layers)
    try:
        whole = prefill_with(decoder, rows, share=False)
        first = prefill_with(decoder, rows, share=True)
        (kept,) = decoder.prefill.prefixes._made.values()
        assert kept.ids == tuple(PREFIX) and kept.made(layers) and kept.hidden is None
        for k, v in kept.kv:  # copies of their own, not views holding the layer step's whole outputs
            assert k.is_contiguous() and k.untyped_storage().nbytes() == k.nbytes
            assert v.is_contiguous() and v.untyped_storage().nbytes() == v.nbytes
        again = prefill_with(decoder, rows[2:], share=True)  # the kept prefix, not made again
    finally:
        decoder.prefill.group_tokens = 32768
    assert_close_prefill(decoder, rows, first, whole)
    whole_again = prefill_with(decoder, rows[2:], share=False)
    assert_close_prefill(decoder, rows[2:], again, whole_again)
    assert list(decoder.prefill.prefixes._made.values()) == [kept]


def test_a_kept_prefix_is_not_run_again(decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    decoder.prefill.prefixes = PrefixCache()
    rows = rows_after(PREFIX, [3, 9, 4])
    calls: list[int] = []
    real = decoder.prefill._prefix_layer
    monkeypatch.setattr(decoder.prefill, "_prefix_layer", lambda i, *a, **k: (calls.append(i), real(i, *a, **k)))
    prefill_with(decoder, rows, share=True)
    assert calls == list(range(len(decoder.stack.layers)))
    prefill_with(decoder, rows_after(PREFIX, [5, 2]), share=True)
    assert len(calls) == len(decoder.stack.layers)


def test_a_chunks_rows_times_the_prefix_stay_within_its_tokens(decoder: StaticDecoder) -> None:
    """Each layer step copies the prefix's K/V before every row's own: a chunk of short rows after a long
    prefix holds no more rows than its tokens hold copies of the prefix."""
    rows = [DecodeRow(ids=[5, 6], max_new=1, adapter="kev") for _ in range(40)]
    assert max(map(len, decoder.prefill.chunk_rows(rows, 100))) == 40  # alone: 80 tokens, one chunk
    chunks = decoder.prefill.chunk_rows(rows, 100, shared=30)
    assert sorted(i for c in chunks for i in c) == list(range(40))
    assert max(len(c) * 30 for c in chunks) <= 100


def test_the_loop_hands_its_kept_prefixes_back_with_its_pool(decoder: StaticDecoder) -> None:
    decoder.prefill.prefixes = PrefixCache()
    prefill_with(decoder, rows_after(PREFIX, [3, 9]), share=True)
    assert decoder.prefill.prefixes._made
    decoder.release()
    assert not decoder.prefill.prefixes._made


def test_rows_on_two_adapters_share_no_prefix(decoder: StaticDecoder) -> None:
    decoder.prefill.prefixes = PrefixCache()
    rows = rows_after(PREFIX, [3, 9]) + rows_after(PREFIX, [4], "laya")
    shared, whole = prefill_with(decoder, rows, share=True), prefill_with(decoder, rows, share=False)
    assert_close_prefill(decoder, rows, shared, whole)
    assert not decoder.prefill.prefixes._made


@pytest.fixture(scope="module")
def engine(tiny_models: Path) -> Engine:
    return Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static")


def test_choice_scores_after_a_shared_template_prefix_equal_a_plain_log_likelihood(engine: Engine) -> None:
    """Kev's rows all start with its template's system part: scored with it shared (and kept, then again with
    the kept one), every choice's log-likelihood is HF's for prompt + choice."""
    decoder = engine.decoders["default"]
    decoder.prefill.prefixes = PrefixCache()
    pad = engine.base_for("kev").tokenizer.pad_token_id
    prompts = ["Approve a loan of 12000?", "Income 52000, debt low.", "x", "Step 1: check income " * 7]
    choices = ("approve", "reject now", "need more review")
    jobs = [Job(custom_id=str(i), model="kev", prompt=prompts[i % 4], choices=choices[: 2 + i % 2]) for i in range(6)]
    items = [engine.encoder.encode(job, index=i) for i, job in enumerate(jobs)]
    rows = [ScoreRow(ids=it.ids, choices=engine.choices.ids(it.job), adapter=it.adapter) for it in items]
    shared = common_prefix(rows, MIN_TOKENS)
    assert shared is not None  # the template's system part, at least
    decoder.prefill.tokens = 40  # several prefill chunks
    try:
        first = decoder.score(rows, pad_id=pad)
        assert len(decoder.prefill.prefixes._made) == 1
        again = decoder.score(rows[::-1], pad_id=pad)
    finally:
        decoder.prefill.tokens = 4096
    assert first is not None and again is not None
    for job, row, got, back in zip(jobs, rows, first.loglik, again.loglik[::-1], strict=True):
        want = [reference(engine, job.model, row.ids, c) for c in row.choices]
        assert got == pytest.approx(want, abs=2e-4, rel=1e-4), job.custom_id
        assert back == pytest.approx(want, abs=2e-4, rel=1e-4), job.custom_id
