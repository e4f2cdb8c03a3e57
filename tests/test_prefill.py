"""The layer-major prefill (worker/fastpath/prefill.py) against the chunk-major loop it replaced, kept here as
the reference: the same K/V cache and first-token logits bit for bit, and so the same tokens, over several
chunks of rows of different lengths with Kev, Laya, base and mixed chunks -- in float32 (PEFT's LoRA
arithmetic), 4-bit on the CPU (bitsandbytes runs its layers), bfloat16 (LoRA merged into a copy of the
weights) and 4-bit in bfloat16 dequantised by the loop itself (LoRA merged in place) -- with the take in one
group of chunks and in several (`group_tokens`, boundaries inside one adapter's chunks). Also: each layer is
dequantised once per group, K/V are never expanded to the query heads, the chunk tensors built at once hold
what row-by-row building gave, and a group holds at most `group_tokens` tokens' hidden states."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tiny_config
from worker.config import load_config
from worker.engine import Engine
from worker.fastpath import DecodeRow, StaticDecoder, gemm
from worker.fastpath import weights as weights_module
from worker.fastpath.graphs import KV
from worker.fastpath.ops import Ops, causal_attention, repeat_kv
from worker.fastpath.prefill import (
    GROUP_TOKENS,
    HEAD_WARM_ROWS,
    MAX_CHUNK_TOKENS,
    Chunk,
    Passes,
    Prefill,
    PromptRow,
    row_masks,
    to_device,
)
from worker.fastpath.weights import Dense, Layer, Masks, Proj, is_mixed, mlp_blocks, only_adapter
from worker.loading import select_adapters

CHUNK_TOKENS = 24  # small chunks: the rows below make seven of them
# (prompt length, adapter), in no particular order: sorted by length they chunk into Kev only, Laya only,
# Kev + Laya (mixed), base + Kev (mixed), Laya alone, Laya alone, Kev alone.
SHAPES = [(12, "kev"), (3, "kev"), (8, "laya"), (13, "laya"), (5, "kev"), (11, None), (20, "laya")]
SHAPES += [(4, "kev"), (7, "laya"), (9, "kev"), (10, "laya"), (23, "kev")]
# Their seven chunks hold 15, 16, 20, 24, 13, 20 and 23 padded tokens: groups of at most 40 tokens are
# [Kev, Laya], [Kev + Laya], [base + Kev, Laya], [Laya], [Kev] -- Laya's own chunks across three groups.
SPLIT_LAYA = 40


@dataclass(frozen=True)
class Loop:
    decoder: StaticDecoder
    base: Any  # its LoadedBase, for the decode's adapter selection


def bf16_config(tiny_models: Path, quantization: str) -> Any:
    path = tiny_models / f"models-{quantization}-bf16.toml"
    path.write_text(tiny_config(tiny_models, quantization).path.read_text().replace('"float32"', '"bfloat16"'))
    return load_config(path)


@pytest.fixture(scope="module", params=["float32", "nf4", "bfloat16", "nf4-bfloat16-own"])
def loop(request: pytest.FixtureRequest, tiny_models: Path) -> Iterator[Loop]:
    """The static loop of a freshly loaded tiny base. `nf4-bfloat16-own`: 4-bit weights the loop dequantises
    itself on the CPU too (as on a GPU), so LoRA merges into the dequantised buffers in place."""
    kind = request.param
    with pytest.MonkeyPatch.context() as patch:
        if kind == "float32":
            config = tiny_config(tiny_models, "none")
        elif kind == "nf4":
            config = tiny_config(tiny_models, "nf4")
        elif kind == "bfloat16":
            config = bf16_config(tiny_models, "none")
        else:
            patch.setattr(weights_module, "OWN_4BIT_DEVICES", frozenset({"cuda", "cpu"}))
            config = bf16_config(tiny_models, "nf4")
        engine = Engine(config, device="cpu", decode="static")
    ((decoder,), (base,)) = engine.decoders.values(), engine.bases.values()
    decoder.prefill.tokens = CHUNK_TOKENS
    yield Loop(decoder=decoder, base=base)


@pytest.fixture
def decoder(loop: Loop) -> StaticDecoder:
    return loop.decoder


def decode_rows(shapes: Sequence[tuple[int, str | None]] = SHAPES, max_new: int = 5) -> list[DecodeRow]:
    return [
        DecodeRow(ids=[(7 * i + 3 * t) % 50 + 3 for t in range(n)], max_new=max_new, adapter=adapter)
        for i, (n, adapter) in enumerate(shapes)
    ]


# ---- the chunk-major loop this prefill replaced, as the reference ----------------------------------------------


def reference_chunk(prefill: Prefill, rows: Sequence[PromptRow], group: list[int], width: int, pad_id: int) -> Chunk:
    """A chunk's tensors built row by row, as before."""
    device = prefill.stack.device
    lengths = [len(rows[i].ids) for i in group]
    span = max(lengths)
    ids = torch.full((len(group), span), pad_id, dtype=torch.long)
    columns = torch.empty((len(group), span), dtype=torch.long)
    steps = torch.arange(span)
    for j, (i, n) in enumerate(zip(group, lengths, strict=True)):
        ids[j, :n] = torch.tensor(rows[i].ids, dtype=torch.long)
        columns[j] = torch.where(steps < n, width - n + steps, steps - n)
    contiguous = group == list(range(group[0], group[0] + len(group)))
    index = to_device(torch.tensor(group)[:, None], device)
    return Chunk(
        where=slice(group[0], group[0] + len(group)) if contiguous else index[:, 0],
        ids=to_device(ids, device),
        rows=index,
        columns=to_device(columns, device),
        reads=to_device(torch.tensor(lengths)[:, None] - 1, device),
        masks=row_masks([rows[i] for i in group], prefill.stack.dtype, device),
    )


def reference_groups(rows: Sequence[PromptRow], tokens: int) -> list[list[int]]:
    order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids))
    groups: list[list[int]] = [[]]
    for i in order:
        if groups[-1] and (len(groups[-1]) + 1) * len(rows[i].ids) > tokens:
            groups.append([])
        groups[-1].append(i)
    return groups


def reference_merged(layer: Layer, masks: Masks) -> Dense | None:
    """The weights with a single-adapter chunk's LoRA merged into a copy (out of place), as before."""
    if is_mixed(masks):
        return None
    dense, adapter = layer.dense(), only_adapter(masks)
    return layer.merge(dense, adapter, in_place=False) if layer.mergeable(dense, adapter) else None


def chunk_major(
    prefill: Prefill,
    kv: KV,
    rows: Sequence[PromptRow],
    width: int,
    pad_id: int,
    logits: torch.Tensor,
    tokens: int | None = None,
    *,
    every_position: bool = False,
):
    """Each chunk (of about `tokens`, default the prefill's own) through every layer before the next chunk:
    weights dequantised (and merged) per chunk and layer, K/V repeated to every query head, rotary per chunk
    from its (rows, span) positions. The last layer's output projection and MLP run at each row's last position
    only, as the loop's do (`every_position`: at every position, as HF's forward does)."""
    s = prefill.stack
    for group in reference_groups(rows, tokens or prefill.tokens):
        c = reference_chunk(prefill, rows, group, width, pad_id)
        h = s.embed(c.ids)
        count, span = c.ids.shape
        positions = torch.arange(span, device=s.device).expand(count, span)
        cos, sin = s.rotary(h, positions)
        x = s.ops.norm(s.layers[0].norm1, h)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(s.layers, kv, strict=True)):
            merged = reference_merged(layer, c.masks) if prefill.merge_lora else None
            dense, masks = (merged, []) if merged is not None else (layer.dense(), c.masks)
            q, k, v = s.qkv(layer, x, masks, cos, sin, dense)
            k_cache[c.rows, :, c.columns] = k.transpose(1, 2)
            v_cache[c.rows, :, c.columns] = v.transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, repeat_kv(k, s.groups), repeat_kv(v, s.groups), is_causal=True, scale=layer.scaling
            )
            attn = out.transpose(1, 2).reshape(count, span, s.heads * s.head_dim)
            if i == len(s.layers) - 1 and not every_position:
                at = torch.arange(count, device=s.device)[:, None]
                attn, h = attn[at, c.reads], h[at, c.reads]
            h, x = s.rest(layer, h, attn, masks, s.next_norm(i), dense)
        last = x[torch.arange(count), c.reads[:, 0]] if every_position else x[:, 0]
        logits[c.where] = s.head(last)


# ---- helpers ---------------------------------------------------------------------------------------------------


def fresh_kv(loop: StaticDecoder, rows: int, length: int) -> KV:
    s = loop.stack
    shape = (rows, s.kv_heads, length, s.head_dim)
    return [(torch.zeros(shape, dtype=s.dtype), torch.zeros(shape, dtype=s.dtype)) for _ in s.layers]


def prefill_both(loop: StaticDecoder, rows: Sequence[DecodeRow]) -> tuple[KV, torch.Tensor, KV, torch.Tensor]:
    """(K/V, logits) of the layer-major prefill, then of the chunk-major reference, on fresh caches."""
    width = max(len(r.ids) for r in rows)
    vocab = loop.stack.head.out_features
    kv_new, kv_old = fresh_kv(loop, len(rows), width + 4), fresh_kv(loop, len(rows), width + 4)
    with torch.inference_mode():
        new = loop.prefill.run(kv_new, rows, width=width, out_rows=len(rows), pad_id=0, select=_no_fallback)
        old = torch.zeros(len(rows), vocab, dtype=loop.stack.head.weight.dtype)
        chunk_major(loop.prefill, kv_old, rows, width, 0, old)
    return kv_new, new, kv_old, old


def _no_fallback(names: Sequence[str | None]) -> Any:
    raise AssertionError("the loop's own prefill fell back to the model's forward")


def assert_same_cache(a: KV, b: KV) -> None:
    for layer, ((ka, va), (kb, vb)) in enumerate(zip(a, b, strict=True)):
        assert torch.equal(ka, kb), f"keys of layer {layer}"
        assert torch.equal(va, vb), f"values of layer {layer}"


# ---- the tests -------------------------------------------------------------------------------------------------


def test_the_rows_make_single_adapter_base_and_mixed_chunks(decoder: StaticDecoder) -> None:
    rows = decode_rows()
    chunks = decoder.prefill.chunks(rows, 23, 0)
    passes = Passes.of([c.masks for c in chunks], merge=True)
    assert len(chunks) == 7
    assert set(passes.merged) == {"kev", "laya"}
    assert sum(is_mixed(c.masks) for c in chunks) == 2
    assert any(isinstance(c.where, torch.Tensor) for c in chunks)  # rows out of order: an index


@pytest.mark.parametrize("merge_lora", [True, False])
def test_same_cache_and_logits_as_chunk_major(decoder: StaticDecoder, merge_lora: bool) -> None:
    decoder.prefill.merge_lora = merge_lora
    try:
        kv_new, new, kv_old, old = prefill_both(decoder, decode_rows())
    finally:
        decoder.prefill.merge_lora = True
    assert_same_cache(kv_new, kv_old)
    assert torch.equal(new, old)
    assert decoder.own_prefill


# The setups whose prefill runs its matmuls on dequantised weights through `gemm` (the "nf4" loop's 4-bit weights
# run inside bitsandbytes on the CPU).
THROUGH_GEMM = ["float32", "bfloat16", "nf4-bfloat16-own"]


@pytest.mark.parametrize("loop", THROUGH_GEMM, indirect=True)
@pytest.mark.parametrize("merge_lora", [True, False])
def test_matmuls_in_row_blocks_give_the_same_cache_and_logits(
    decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch, blocked_rows: list[int], merge_lora: bool
) -> None:
    """Prefill with its matmuls in blocks of 8 rows (`gemm`, a GPU's 256 scaled to the tiny chunks; blocks only
    inside the prefill's own `row_blocks`, so the chunk-major reference runs whole matmuls) against that
    reference: the blocks change which rows a matmul computes together, not the values."""
    assert _tensors(decoder.stack.layers[0].dense())  # dequantised weights: its matmuls go through `gemm`
    monkeypatch.setattr(gemm, "block_of", lambda x: 8 if gemm._blocks.get() else None)
    decoder.prefill.merge_lora = merge_lora
    try:
        kv_new, new, kv_old, old = prefill_both(decoder, decode_rows())
    finally:
        decoder.prefill.merge_lora = True
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if decoder.stack.dtype == torch.bfloat16 else {}
    for (ka, va), (kb, vb) in zip(kv_new, kv_old, strict=True):
        torch.testing.assert_close(ka, kb, **tolerance)
        torch.testing.assert_close(va, vb, **tolerance)
    torch.testing.assert_close(new, old, **tolerance)
    assert torch.equal(new.argmax(-1), old.argmax(-1))
    assert blocked_rows and all(m % 8 == 0 for m in blocked_rows)


@pytest.mark.parametrize("merge_lora", [True, False])
def test_the_mlp_in_blocks_of_a_few_tokens_gives_the_same_cache_and_logits(
    decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch, merge_lora: bool
) -> None:
    """The MLP run in blocks (`Stack._mlp_in_blocks`: gate/up and SiLU x up at most 7 tokens a block here, a
    GPU's 4,096 scaled to the tiny chunks; whole rows in blocks, a row longer than a block in spans; both
    adapters, masked per row and merged; the down projection over the whole chunk) against the reference with
    the MLP whole: the same cache and logits, within the dtype's rounding."""
    stack = decoder.stack
    seen: list[tuple[int, int]] = []  # (rows, tokens a row) of each SiLU x up
    downs: list[int] = []  # tokens of each down projection
    act_mul, down = Ops.act_mul, Proj.__call__

    def recording(ops: Ops, act: Any, gate: torch.Tensor, up: torch.Tensor, out: Any = None) -> torch.Tensor:
        seen.append((gate.shape[0], gate.shape[-2]))
        return act_mul(ops, act, gate, up, out)

    def recording_down(proj: Proj, x: torch.Tensor, *args: Any) -> torch.Tensor:
        if any(proj is layer.down for layer in stack.layers):
            downs.append(x.numel() // x.shape[-1])
        return down(proj, x, *args)

    monkeypatch.setattr(Ops, "act_mul", recording)
    monkeypatch.setattr(Proj, "__call__", recording_down)
    rows = decode_rows()
    width = max(len(r.ids) for r in rows)
    vocab = stack.head.out_features
    kv_new, kv_old = fresh_kv(decoder, len(rows), width + 4), fresh_kv(decoder, len(rows), width + 4)
    decoder.prefill.merge_lora = merge_lora
    try:
        with torch.inference_mode():
            stack.mlp_block_tokens = 7
            new = decoder.prefill.run(kv_new, rows, width=width, out_rows=len(rows), pad_id=0, select=_no_fallback)
            blocked, blocked_downs = list(seen), list(downs)
            stack.mlp_block_tokens = 1 << 30
            old = torch.zeros(len(rows), vocab, dtype=stack.head.weight.dtype)
            chunk_major(decoder.prefill, kv_old, rows, width, 0, old)
    finally:
        decoder.prefill.merge_lora = True
        stack.mlp_block_tokens = weights_module.PREFILL_MLP_BLOCK_TOKENS
    assert blocked and all(n * t <= 7 for n, t in blocked)  # no call past its block
    assert any(tokens > 7 for tokens in blocked_downs)  # the down projection ran over whole chunks
    assert any(n > 1 for n, _ in blocked) and any(n == 1 and t == 7 for n, t in blocked)  # rows, and spans
    assert any(t > 7 for _, t in seen[len(blocked) :])  # the reference ran whole spans
    tolerance: dict[str, float] = {"atol": 2e-2, "rtol": 2e-2} if stack.dtype == torch.bfloat16 else {}
    if stack.dtype == torch.float32 and getattr(stack.layers[0].down.base.weight, "quant_state", None) is not None:
        # 4-bit float32 within a few ulps of its logits: the CPU's sgemm sums in another order at a few rows than
        # at many (a matmul of 40 rows differs from the same rows 1-7 at a time by ~3e-5), and the down
        # projection runs at the whole chunk's rows where gate/up ran at a block's.
        tolerance = {"atol": 1e-4, "rtol": 1e-4}
    for (ka, va), (kb, vb) in zip(kv_new, kv_old, strict=True):
        torch.testing.assert_close(ka, kb, **tolerance)
        torch.testing.assert_close(va, vb, **tolerance)
    torch.testing.assert_close(new, old, **tolerance)
    assert torch.equal(new.argmax(-1), old.argmax(-1))


@pytest.mark.parametrize(("rows", "width", "block"), [(37, 1, 18), (5, 3, 7), (1, 1, 4096), (3, 10, 4), (2, 9, 9)])
def test_the_mlp_blocks_cover_every_token_once_within_a_block_and_even_out_their_rows(
    rows: int, width: int, block: int
) -> None:
    blocks = mlp_blocks(rows, width, block)
    covered = [(r, t) for b in blocks for r in range(b.row, b.row + b.rows) for t in range(b.token, b.token + b.span)]
    assert sorted(covered) == [(r, t) for r in range(rows) for t in range(width)]
    assert all(b.rows * b.span <= block for b in blocks)
    if width <= block:  # whole rows, their counts at most one apart
        assert all(b.token == 0 and b.span == width for b in blocks)
        assert max(b.rows for b in blocks) - min(b.rows for b in blocks) <= 1
    else:  # a row past a block: spans of one row
        assert all(b.rows == 1 for b in blocks)
    if (rows, width, block) == (37, 1, 18):
        assert [b.rows for b in blocks] == [13, 12, 12]


def test_silu_times_up_into_a_slice_is_eagers_and_a_wrong_out_is_refused_without_switching_the_kernels_off() -> None:
    """`Ops.act_mul(..., out=)` where our kernel does not run (the CPU): eagerly in place, bit-equal to eager's
    `silu_mul`, the rest of the buffer untouched; an `out` of the wrong shape or layout is refused before any
    kernel runs, so the kernels stay on (a refusal is the caller's error, not the kernel's)."""
    torch.manual_seed(0)
    joint = torch.randn(3, 4, 2 * 24)
    gate, up = joint.split(24, dim=-1)  # halves of a joint output: strided
    whole = torch.full((5, 4, 24), 7.0)
    ops = Ops(compiled=False)
    got = ops.act_mul(torch.nn.SiLU(), gate, up, out=whole[1:4])
    assert got.data_ptr() == whole[1:4].data_ptr()
    assert torch.equal(whole[1:4], F.silu(gate) * up)
    assert bool((whole[0] == 7).all()) and bool((whole[4] == 7).all())
    gelu = ops.act_mul(torch.nn.GELU(), gate, up, out=whole[1:4])
    assert gelu.data_ptr() == whole[1:4].data_ptr() and torch.equal(whole[1:4], F.gelu(gate) * up)
    kernels = ops.with_kernels()
    for bad in (whole[1:4, :2], torch.zeros(3, 4, 30)[..., :24]):
        with pytest.raises(ValueError, match="act_mul: out must be contiguous"):
            kernels.act_mul(torch.nn.SiLU(), gate, up, out=bad)
    assert kernels.kernels


@pytest.mark.parametrize("loop", THROUGH_GEMM, indirect=True)
def test_the_warm_up_runs_a_layers_four_matmuls_and_the_lm_head_at_each_row_count(
    decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _tensors(decoder.stack.layers[0].dense())  # dequantised weights: its matmuls go through `gemm`
    seen: list[int] = []
    real = gemm.block_of

    def spy(x: torch.Tensor) -> int | None:
        seen.append(x.numel() // x.shape[-1])
        return real(x)

    monkeypatch.setattr(gemm, "row_counts", lambda most, device: [5, 9, HEAD_WARM_ROWS + 1])
    monkeypatch.setattr(gemm, "block_of", spy)
    with torch.inference_mode():
        assert decoder.prefill.warm_row_counts() == 3
    # Four matmuls a count, and the LM head (a plain linear: through `gemm` too) up to its most rows.
    assert sorted(seen) == [5] * 5 + [9] * 5 + [HEAD_WARM_ROWS + 1] * 4


def test_the_last_layer_runs_its_projection_and_mlp_only_at_the_last_prompt_positions(
    decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last layer's output projection and MLP see one position a row (every other layer a chunk's every
    position); its K/V are the whole prompt's as before, and the first-token logits are those of a run through
    every position up to float rounding (fewer rows in a matmul may round differently), their argmax the same."""
    seen: list[tuple[int, tuple[int, ...]]] = []
    index = {id(layer): i for i, layer in enumerate(decoder.stack.layers)}
    record = lambda layer, h, x, *a, **k: seen.append((index[id(layer)], tuple(x.shape[:2])))  # noqa: E731
    monkeypatch.setattr(decoder.stack, "mlp", _counting(decoder.stack.mlp, record))
    rows = decode_rows()
    width = max(len(r.ids) for r in rows)
    kv_new, kv_old = fresh_kv(decoder, len(rows), width + 4), fresh_kv(decoder, len(rows), width + 4)
    with torch.inference_mode():
        new = decoder.prefill.run(kv_new, rows, width=width, out_rows=len(rows), pad_id=0, select=_no_fallback)
        seen_new = list(seen)
        old = torch.zeros_like(new)
        chunk_major(decoder.prefill, kv_old, rows, width, 0, old, every_position=True)
    last = len(decoder.stack.layers) - 1
    chunks = decoder.prefill.chunks(rows, width, 0)
    assert sorted(shape for i, shape in seen_new if i == last) == sorted((len(c.ids), 1) for c in chunks)
    assert sorted(shape for i, shape in seen_new if i == 0) == sorted(tuple(c.ids.shape) for c in chunks)
    assert_same_cache(kv_new, kv_old)
    tolerance = 1e-4 if new.dtype == torch.float32 else 5e-2
    torch.testing.assert_close(new.float(), old.float(), rtol=tolerance, atol=tolerance)
    assert torch.equal(new.float().argmax(-1), old.float().argmax(-1))


@pytest.mark.parametrize(
    "shapes",
    [
        [(9, "kev")] * 6,  # one adapter: every chunk merged, in place
        [(3, "laya"), (17, "laya"), (6, "laya"), (24, "laya")],
        [(5, None), (16, None), (2, None)],  # the base model alone
        [(4, "kev"), (4, "laya")] * 5,  # mixed chunks only
    ],
)
def test_same_cache_and_logits_for_one_adapter_the_base_or_mixed_takes(
    decoder: StaticDecoder, shapes: list[tuple[int, str | None]]
) -> None:
    kv_new, new, kv_old, old = prefill_both(decoder, decode_rows(shapes))
    assert_same_cache(kv_new, kv_old)
    assert torch.equal(new, old)


@pytest.mark.parametrize("group_tokens", [GROUP_TOKENS, SPLIT_LAYA])
def test_same_tokens_as_chunk_major(loop: Loop, monkeypatch: pytest.MonkeyPatch, group_tokens: int) -> None:
    """Decoding after either prefill: the same tokens and log-probabilities (the steps read only the cache and
    the first logits), the take in one group or in five."""
    decoder, base = loop.decoder, loop.base
    monkeypatch.setattr(decoder.prefill, "group_tokens", group_tokens)
    kw = {"stop_ids": [-1], "pad_id": 0, "select": lambda names: select_adapters(base, names)}
    rows = decode_rows(max_new=6)
    new = decoder.decode(rows, **kw)
    monkeypatch.setattr(decoder.prefill, "own_layers", lambda *args: chunk_major(decoder.prefill, *args))
    old = decoder.decode(rows, **kw)
    assert torch.equal(new.tokens, old.tokens)
    assert torch.equal(new.logprobs, old.logprobs)


@pytest.mark.parametrize("group_tokens", [GROUP_TOKENS, SPLIT_LAYA])
def test_each_layer_is_dequantised_once_per_group_and_merged_without_a_copy_when_it_can(
    decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch, group_tokens: int
) -> None:
    """However many chunks a group holds: one `dense()` per layer and group (the whole take in one group by
    default). Merges: in each group, a copy for every adapter but the last a layer serves, which merges in place
    (into the dequantised buffers where the loop made them)."""
    monkeypatch.setattr(decoder.prefill, "group_tokens", group_tokens)
    dense_calls: list[int] = []
    merges: list[tuple[str | None, bool]] = []
    for i, layer in enumerate(decoder.stack.layers):
        monkeypatch.setattr(layer, "dense", _counting(layer.dense, lambda *a, i=i: dense_calls.append(i)))
        monkeypatch.setattr(layer, "merge", _counting(layer.merge, lambda d, a, in_place: merges.append((a, in_place))))
    layers = len(decoder.stack.layers)
    for shapes, adapters in (
        (SHAPES, ["kev", "laya"]),
        ([(9, "kev")] * 6, ["kev"]),
    ):
        dense_calls.clear()
        merges.clear()
        kv = fresh_kv(decoder, len(shapes), 30)
        rows = decode_rows(shapes)
        assert len(decoder.prefill.chunks(rows, 24, 0)) > 1
        with torch.inference_mode():
            decoder.prefill.run(kv, rows, width=24, out_rows=len(rows), pad_id=0, select=_no_fallback)
        groups = decoder.prefill.layer_groups(rows)
        assert (len(groups) == 1) == (group_tokens == GROUP_TOKENS)
        assert dense_calls == [i for _ in groups for i in range(layers)]
        mergeable = bool(decoder.stack.layers[0].qkv.lora)  # fused compute-dtype LoRA: bfloat16 models
        if mergeable:
            merged = [merged_adapters(rows, group) for group in groups]
            assert sorted({a for m in merged for a in m}) == adapters
            want = [(a, a == m[-1]) for m in merged for _ in range(layers) for a in m]
            assert merges == want
        else:
            assert merges == []


def merged_adapters(rows: Sequence[PromptRow], group: list[list[int]]) -> list[str]:
    """The adapters a group's single-adapter chunks merge, in the order a layer merges them."""
    alone = [{rows[i].adapter for i in chunk} for chunk in group]
    return sorted({a for names in alone if len(names) == 1 for a in names if a is not None})


def _counting(fn: Any, record: Any) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        record(*args, **kwargs)
        return fn(*args, **kwargs)

    return counted


# The setups whose LoRA is fused in a bfloat16 compute dtype and merges (float32 compute, 4-bit or not, keeps
# PEFT's arithmetic: nothing merges).
MERGING = ["bfloat16", "nf4-bfloat16-own"]


@pytest.mark.parametrize("loop", MERGING, indirect=True)
def test_a_merge_in_place_writes_the_dequantised_buffer_and_never_the_models_weights(decoder: StaticDecoder) -> None:
    """In place and out of place give the same weights bit for bit; in place reuses a buffer the loop
    dequantised, and leaves a layer's own weights (a plain model's) untouched."""
    layer = decoder.stack.layers[0]
    assert layer.qkv.lora, "this setup should merge its LoRA"
    with torch.inference_mode():
        before = [p.detach().clone() for p in decoder.model.parameters()]
        copy = layer.merge(layer.dense(), "kev", in_place=False)
        dense = layer.dense()
        merged = layer.merge(dense, "kev", in_place=True)
        after = list(decoder.model.parameters())
    for a, b in zip(_tensors(copy), _tensors(merged), strict=True):
        assert torch.equal(a, b)
    own = layer.qkv.joint is not None and layer.qkv.joint.quant is not None
    assert (merged[0][0].data_ptr() == dense[0][0].data_ptr()) == own
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def _tensors(dense: Dense) -> list[torch.Tensor]:
    qkv, o, gate_up, down = dense
    return [t for t in (*qkv, o, *gate_up, down) if t is not None]


def test_prefill_never_expands_kv_to_the_query_heads(decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA reads the grouped KV heads itself (`enable_gqa`): `repeat_kv` is not called."""
    assert decoder.stack.groups > 1

    def refused(*args: Any) -> None:
        raise AssertionError("repeat_kv called")

    monkeypatch.setattr("worker.fastpath.ops.repeat_kv", refused)
    rows = decode_rows()
    kv = fresh_kv(decoder, len(rows), 30)
    with torch.inference_mode():
        decoder.prefill.run(kv, rows, width=24, out_rows=len(rows), pad_id=0, select=_no_fallback)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_attention_equals_attention_over_repeated_kv(dtype: torch.dtype, monkeypatch) -> None:
    """Both ways `causal_attention` may run (GQA kernel; K/V repeated where none reads grouped heads)."""
    torch.manual_seed(0)
    q = torch.randn(3, 6, 17, 16).to(dtype)
    k, v = torch.randn(3, 2, 17, 16).to(dtype), torch.randn(3, 2, 17, 16).to(dtype)
    want = F.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), is_causal=True, scale=0.25)
    assert torch.equal(causal_attention(q, k, v, scale=0.25), want)
    monkeypatch.setattr("worker.fastpath.ops.reads_grouped_heads", lambda *args: False)
    assert torch.equal(causal_attention(q, k, v, scale=0.25), want)


def test_chunk_tensors_built_at_once_hold_what_row_by_row_building_gave(decoder: StaticDecoder) -> None:
    rows = decode_rows()
    width = 29
    chunks = decoder.prefill.chunks(rows, width, pad_id=1)
    groups = reference_groups(rows, decoder.prefill.tokens)
    assert len(chunks) == len(groups)
    for got, group in zip(chunks, groups, strict=True):
        want = reference_chunk(decoder.prefill, rows, group, width, 1)
        for name in ("ids", "rows", "columns", "reads"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        if isinstance(want.where, slice):
            assert got.where == want.where
        else:
            assert torch.equal(got.where, want.where)
        assert [n for n, _ in got.masks] == [n for n, _ in want.masks]
        for (_, a), (_, b) in zip(got.masks, want.masks, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


def test_left_pad_built_at_once_pads_each_row_on_the_left() -> None:
    from worker.fastpath import left_pad

    ids, mask = left_pad([[5, 6, 7], [8], [], [1, 2]], 0, torch.device("cpu"), width=4)
    assert ids.tolist() == [[0, 5, 6, 7], [0, 0, 0, 8], [0, 0, 0, 0], [0, 0, 1, 2]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 1, 1]]
    assert left_pad([[4, 3], [2]], 9, torch.device("cpu"))[0].tolist() == [[4, 3], [9, 2]]


@pytest.mark.parametrize("group_tokens", [GROUP_TOKENS, SPLIT_LAYA, 1])
def test_held_bytes_are_the_hidden_states_of_the_largest_group(
    decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch, group_tokens: int
) -> None:
    """What the prefill measured it held between layers: two hidden vectors per (padded) token plus ids and
    cache columns, of the group holding most -- within what `ModelShape.prefill_held_bytes_per_token` plans
    for a group of `group_tokens` (or one chunk, where a chunk is larger)."""
    from worker.memory import ModelShape

    monkeypatch.setattr(decoder.prefill, "group_tokens", group_tokens)
    rows = decode_rows()
    width = max(len(r.ids) for r in rows)
    kv = fresh_kv(decoder, len(rows), width + 4)
    with torch.inference_mode():
        decoder.prefill.run(kv, rows, width=width, out_rows=len(rows), pad_id=0, select=_no_fallback)
    s = decoder.stack
    padded = max(sum(len(c) * len(rows[c[-1]].ids) for c in g) for g in decoder.prefill.layer_groups(rows))
    if group_tokens == GROUP_TOKENS:  # one group: every chunk
        assert padded == sum(c.ids.numel() for c in decoder.prefill.chunks(rows, width, 0))
    assert decoder.prefill.held_bytes == padded * (2 * s.embed.embedding_dim * s.dtype.itemsize + 16)
    shape = ModelShape.from_dict(decoder.model.config.to_dict())
    planned = max(group_tokens, decoder.prefill.tokens, width) * shape.prefill_held_bytes_per_token(s.dtype.itemsize)
    assert decoder.prefill.held_bytes <= planned


@pytest.mark.parametrize(
    ("group_tokens", "sizes"),
    [
        (1, [[15], [16], [20], [24], [13], [20], [23]]),  # every chunk alone (each larger than a group)
        (SPLIT_LAYA, [[15, 16], [20], [24, 13], [20], [23]]),
        (131, [[15, 16, 20, 24, 13, 20, 23]]),  # exactly everything
        (GROUP_TOKENS, [[15, 16, 20, 24, 13, 20, 23]]),
    ],
)
def test_groups_are_consecutive_chunks_of_at_most_group_tokens(
    decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch, group_tokens: int, sizes: list[list[int]]
) -> None:
    monkeypatch.setattr(decoder.prefill, "group_tokens", group_tokens)
    rows = decode_rows()
    groups = decoder.prefill.layer_groups(rows)
    assert [c for g in groups for c in g] == decoder.prefill.chunk_rows(rows)
    assert [[len(c) * len(rows[c[-1]].ids) for c in g] for g in groups] == sizes


@pytest.mark.parametrize(
    ("shapes", "group_tokens", "groups"),
    [
        (SHAPES, SPLIT_LAYA, 5),  # Laya's own chunks in three groups, mixed chunks beside single-adapter ones
        (SHAPES, 64, 3),
        (SHAPES, 1, 7),  # one chunk a group: chunk-major, but for the arithmetic's order
        (SHAPES, 131, 1),  # one group holding everything, exactly
        ([(9, "kev")] * 6, 36, 2),  # one adapter: two chunks, then one, each group merging in place
        ([(4, "kev"), (4, "laya")] * 5, 30, 2),  # mixed chunks only
    ],
)
@pytest.mark.parametrize("merge_lora", [True, False])
def test_grouped_prefill_same_cache_and_logits_as_chunk_major(
    decoder: StaticDecoder,
    monkeypatch: pytest.MonkeyPatch,
    shapes: list[tuple[int, str | None]],
    group_tokens: int,
    groups: int,
    merge_lora: bool,
) -> None:
    """The take in groups of chunks, each group through every layer before the next: the same K/V cache and
    first-token logits bit for bit as chunk by chunk."""
    monkeypatch.setattr(decoder.prefill, "group_tokens", group_tokens)
    monkeypatch.setattr(decoder.prefill, "merge_lora", merge_lora)
    rows = decode_rows(shapes)
    assert len(decoder.prefill.layer_groups(rows)) == groups
    kv_new, new, kv_old, old = prefill_both(decoder, rows)
    assert_same_cache(kv_new, kv_old)
    assert torch.equal(new, old)
    assert decoder.own_prefill


def test_chunks_of_consecutive_rows_scatter_their_cache_writes(decoder: StaticDecoder) -> None:
    """A chunk of consecutive rows writes its K/V with one scatter along the columns (`slots`); its slots are the
    same cache columns as the indexed writes', so `test_same_cache_and_logits_as_chunk_major` covers both."""
    chunks = decoder.prefill.chunks(decode_rows(), 23, 0)
    sliced = [c for c in chunks if isinstance(c.where, slice)]
    assert sliced and all(c.slots is not None for c in sliced)
    assert all(c.slots is None for c in chunks if not isinstance(c.where, slice))
    for c in sliced:
        assert c.slots is not None
        assert torch.equal(c.slots[:, 0, :, 0], c.columns)


@pytest.mark.parametrize(("room", "want"), [(None, 24), (10, 24), (37, 37), (10**9, 48)])
@pytest.mark.parametrize("group_tokens", [GROUP_TOKENS, 20])
def test_a_take_runs_larger_chunks_where_the_memory_free_holds_them(
    decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch, room: int | None, want: int, group_tokens: int
) -> None:
    """The planned chunk size at least, the memory's room (asked beside a full group's held states, or the
    largest chunk's where groups are smaller than chunks) up to `max_tokens`; the cache and logits are the
    chunk-major loop's at the chunk size run."""
    asked: list[int] = []
    monkeypatch.setattr(decoder.prefill, "group_tokens", group_tokens)
    monkeypatch.setattr(decoder.prefill, "max_tokens", 2 * CHUNK_TOKENS)
    monkeypatch.setattr(decoder.prefill, "room", lambda held: asked.append(held) or room)
    rows = decode_rows()
    width = max(len(r.ids) for r in rows)
    kv_new, kv_old = fresh_kv(decoder, len(rows), width + 4), fresh_kv(decoder, len(rows), width + 4)
    with torch.inference_mode():
        new = decoder.prefill.run(kv_new, rows, width=width, out_rows=len(rows), pad_id=0, select=_no_fallback)
        old = torch.zeros_like(new)
        chunk_major(decoder.prefill, kv_old, rows, width, 0, old, want)
    assert asked == [max(group_tokens, 2 * CHUNK_TOKENS)]
    assert decoder.prefill.last_tokens == want
    assert_same_cache(kv_new, kv_old)
    assert torch.equal(new, old)


def test_the_largest_chunk_follows_the_planned_one_unless_set(tiny_models: Path) -> None:
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="static")
    (decoder,) = engine.decoders.values()
    prefill = decoder.prefill
    assert (prefill.tokens, prefill.max_tokens) == (4096, MAX_CHUNK_TOKENS)
    prefill.tokens = 10_000  # a larger planned chunk is never capped below itself
    assert prefill.max_tokens == 10_000
    prefill.tokens, prefill.max_tokens = 24, 48
    assert prefill.max_tokens == 48
    assert prefill.chunk_tokens() == 24  # no room figure (the CPU): the planned size


def test_the_first_layer_builds_each_chunk_as_it_reaches_it(
    decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within a group, chunk j + 1's tensors are built after chunk j went through the first layer (the GPU runs
    that layer while the host builds the next), never all before the first layer; later layers build nothing."""
    prefill = decoder.prefill
    events: list[tuple[str, int]] = []
    chunk, layer = Prefill._chunk, Prefill._layer

    def spy_chunk(self: Prefill, *args: Any, **kwargs: Any) -> Chunk:
        c = chunk(self, *args, **kwargs)
        events.append(("build", int(c.rows[0, 0])))
        return c

    def spy_layer(self: Prefill, i: int, *args: Any, **kwargs: Any) -> Any:
        events.append((f"layer {i}", int(args[2].rows[0, 0])))
        return layer(self, i, *args, **kwargs)

    monkeypatch.setattr(Prefill, "_chunk", spy_chunk)
    monkeypatch.setattr(Prefill, "_layer", spy_layer)
    rows = decode_rows()
    width = max(len(r.ids) for r in rows)
    kv = fresh_kv(decoder, len(rows), width + 4)
    with torch.inference_mode():
        prefill.run(kv, rows, width=width, out_rows=len(rows), pad_id=0, select=_no_fallback)
    [group] = prefill.layer_groups(rows)  # one group: every chunk (GROUP_TOKENS)
    assert len(group) > 2
    first = [e for e in events if e[0] in ("build", "layer 0")]
    # Each build is followed at once by that chunk's first layer.
    assert first[0::2] == [("build", r) for _, r in first[0::2]]
    assert [r for _, r in first[0::2]] == [r for _, r in first[1::2]]
    assert [e[0] for e in first[1::2]] == ["layer 0"] * len(group)
    assert sum(e[0] == "build" for e in events) == len(group)


def test_states_held_between_layers_hold_no_room(decoder: StaticDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer step's first norm output (the MLP's input, let go within the step) may hold room for padded rows
    (`gemm.empty_rows`); its last (the next layer's input, held while the group's other chunks run) never does:
    the planner counts held states exactly."""
    from worker.fastpath.ops import Ops

    rooms: list[bool] = []
    real = Ops.add_norm

    def spy(self: Ops, h: torch.Tensor, delta: torch.Tensor, norm: Any, *, room: bool = True) -> Any:
        rooms.append(room)
        return real(self, h, delta, norm, room=room)

    monkeypatch.setattr(Ops, "add_norm", spy)
    rows = decode_rows()
    width = max(len(r.ids) for r in rows)
    kv = fresh_kv(decoder, len(rows), width + 4)
    with torch.inference_mode():
        decoder.prefill.run(kv, rows, width=width, out_rows=len(rows), pad_id=0, select=_no_fallback)
    steps = len(decoder.stack.layers) * len(decoder.prefill.chunks(rows, width, 0))
    assert rooms == [True, False] * steps
