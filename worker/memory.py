"""Memory planning: KV bytes per token with grouped-query attention, and the largest batch that fits.

The seed's formula (2 x layers x hidden x bytes) ignores grouped-query attention: only `kv_heads` heads of
keys and values are cached, so per token it is 2 x layers x kv_heads x head_dim x bytes -- 28 KiB for a
Qwen2.5-1.5B shape (28 layers, 2 KV heads of 128) in fp16, not 168 KiB.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from shared.errors import ConfigError

GIB = 1024**3
MIB = 1024**2
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# NF4/FP4 weights: 4 bits + one absmax per 64 weights (fp32, or ~8 bits with double quantisation).
QUANT_BYTES_PER_PARAM = {True: 0.5 + 1.0 / 64, False: 0.5 + 4.0 / 64}
# Kept free where nothing is measured (CPU, estimates) for the context, allocator slack and fragmentation; on
# CUDA the engine measures what lies outside the allocator and keeps only the allocator's slack (worker/planner.py).
RESERVE_BYTES = 512 * MIB
# Measured on an H200 capped at 6 GiB (Qwen2.5-1.5B shape, NF4 + LoRA, 192-token prompts): the real peak per
# row ran up to ~1.3x this model's estimate (LoRA temporaries, float32 upcasts); plan with that margin.
SAFETY_FACTOR = 1.4
# The loop's own prefill, measured on the H200 under a 6 GiB budget (`python -m bench prefill`, f369c56): a
# 4,096-token chunk's transients peaked ~340 MiB above its group's held states and first-token logits, whether
# its rows used one adapter or both (LoRA masked per row), one layer's dequantised weights (~89 MiB) included.
# The activation estimate (`prefill_bytes_per_token`, ~282 MiB for such a chunk) is itself above the measured
# ~250 MiB; this margin on it (with the rows' room, `PREFILL_ROW_BLOCK`; gate/up for at most a block,
# `PREFILL_MLP_BLOCK_TOKENS`), two layers' weights exact, sets aside ~513 MiB (424 MiB on one adapter; 523 MiB
# with the MLP whole; the safety factor on all of it set aside 802 MiB: ~18 rows of a Kev take's 512-token cache).
PREFILL_MARGIN = 1.15
# Prefill's matmuls run at row counts that are multiples of this block (worker/fastpath/gemm.py), and a chunk's
# activations hold room for their rows up to the next multiple: what a chunk sets aside counts that many tokens more.
PREFILL_ROW_BLOCK = 256
# The loop's MLP runs a chunk's gate/up in blocks of at most this many tokens (worker/fastpath/weights.py
# `Stack._mlp_in_blocks`): its output, ~50% of a chunk's transients a token, is set aside for a block, not the
# chunk: the planned 4,096-token chunk runs whole, a larger one (up to 8,192 where memory allows) in two. Their
# product and the down projection run over the whole chunk. A multiple of `PREFILL_ROW_BLOCK`.
PREFILL_MLP_BLOCK_TOKENS = 4096
# A decode graph's own per-row buffers over its cache length (worker/fastpath/graphs.py State): the chosen
# tokens (int64), their log-probabilities (float32) and the attention mask (bool).
STATE_BYTES_PER_CACHE_TOKEN = 8 + 4 + 1
# A scored choice token's log-probability, held on the device until the take's one read-back (float32): what a
# row scored inside the prefill keeps past its group.
PICKED_BYTES_PER_TOKEN = 4
# The first token's choice for a take with logprob rows, per row and vocabulary entry: the logits' float32 copy,
# their log-softmax and the finiteness flags.
FIRST_CHOICE_BYTES_PER_VOCAB = 4 + 4 + 1


def parse_bytes(text: str) -> int:
    """'6GiB', '6GB', '512MiB', '1.5G', '123' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ConfigError(f"not a size: {text!r} (use e.g. 6GiB, 512MiB)")
    number, unit, suffix = float(match.group(1)), match.group(2).upper(), (match.group(3) or "")
    base = 1024 if suffix.lower() == "ib" or (unit and not suffix) else 1000
    return int(number * base ** "_KMGT".index(unit or "_")) if unit else int(number)


# The memory-efficient attention kernel reads a mask's rows at this alignment (entries): torch pads (copies) a
# mask whose rows are not aligned, on every call; choice scoring's masks are built aligned.
MASK_ALIGN = 16


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    params: int
    linear_params: int

    @classmethod
    def from_config_file(cls, path: Path) -> ModelShape:
        cfg = json.loads((path / "config.json").read_text())
        return cls.from_dict(cfg.get("text_config", cfg))

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelShape:
        hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]
        attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
        linear = layers * (attn + 3 * hidden * inter)
        embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
        return cls(
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=inter,
            vocab=vocab,
            params=linear + embed,
            linear_params=linear,
        )

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return self.layers * self.layer_kv_bytes_per_token(dtype_bytes)

    def layer_kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """One layer's keys and values of a token."""
        return 2 * self.kv_heads * self.head_dim * dtype_bytes

    def weight_bytes(self, *, quantized: bool, double_quant: bool, dtype_bytes: int = 2) -> int:
        """Estimated resident weight bytes: linears in 4 bit when quantised, embeddings in the compute dtype."""
        if not quantized:
            return self.params * dtype_bytes
        linear = self.linear_params * QUANT_BYTES_PER_PARAM[double_quant]
        return int(linear + (self.params - self.linear_params) * dtype_bytes)

    def prefill_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Transient activations per prompt token during prefill (MLP gate/up/act dominate)."""
        return (3 * self.intermediate + 6 * self.hidden) * dtype_bytes

    def prefill_chunk_activation_bytes(self, tokens: int, dtype_bytes: int = 2) -> int:
        """Transient activations of a chunk of `tokens` in the loop's own prefill: the attention's side a token
        (`prefill_bytes_per_token` less the MLP's), the MLP's gate/up for at most `PREFILL_MLP_BLOCK_TOKENS` of
        them (it runs in blocks of that many), and SiLU x up's product for all of them (written block by block
        into one buffer, which the down projection reads whole; a block's input is a view of the chunk's, no
        memory of its own)."""
        block = min(tokens, PREFILL_MLP_BLOCK_TOKENS)
        return (tokens * 6 * self.hidden + (2 * block + tokens) * self.intermediate) * dtype_bytes

    def prefill_held_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """What the static loop's layer-major prefill (worker/fastpath/prefill.py) holds per (padded) prompt
        token while a group of chunks goes through the layers one at a time: each chunk's residual stream and
        its normed copy (two hidden-size vectors in the compute dtype), its token ids and cache columns (two
        int64). Held across layers, but only for one group at a time: 6,160 bytes for a Qwen2.5-1.5B shape in
        bfloat16, ~192 MiB for a group of 32,768 tokens."""
        return 2 * self.hidden * dtype_bytes + 2 * 8

    def rotary_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """A token's own rotary cos and sin (a chunk with a tail keeps a table per row, not one row for all)."""
        return 2 * self.head_dim * dtype_bytes

    def choice_held_bytes_per_token(self, row_tokens: int, dtype_bytes: int = 2) -> int:
        """What a choice token scored inside the prefill (worker/fastpath/scoring.py) holds while its group goes
        through the layers: a prompt token's held states, its additive attention mask over its row's
        `row_tokens` (prompt and choices, the row aligned to `MASK_ALIGN` entries; one for every query head of its KV
        head, in the compute dtype), its rotary cos and sin, and its int64 token, position and scoring indices
        (a bound: a prompt token of a scored row holds less)."""
        mask = self.heads // self.kv_heads * (row_tokens + MASK_ALIGN - 1) * dtype_bytes
        rotary = self.rotary_bytes_per_token(dtype_bytes)
        return self.prefill_held_bytes_per_token(dtype_bytes) + mask + rotary + 5 * 8

    def attention_bytes_per_row(self, input_tokens: int) -> int:
        """Prefill attention scores when SDPA falls back to the math kernel (a padding mask does that):
        heads x T x T in the compute dtype plus a float32 softmax. Quadratic: long prompts dominate."""
        return self.heads * input_tokens * input_tokens * 6

    def layer_weight_bytes(self, dtype_bytes: int = 2) -> int:
        """One decoder layer's linear weights in the compute dtype: what prefill dequantises per layer."""
        return self.linear_params // self.layers * dtype_bytes

    def sampling_bytes_per_slot(self) -> int:
        """What one sampler slot's draw holds at once (worker/fastpath/sampling.py): its gathered logits, the
        scaled ones, their log-softmax, probabilities and cumulative sums, and for top-p/top-k the sorted
        values with their int64 order: about 12 fp32-sized vectors over the vocabulary."""
        return 12 * self.vocab * 4

    def decode_bytes_per_row(self, dtype_bytes: int = 2, *, choice_chunk_rows: int | None = None) -> int:
        """Per-row decode temporaries over the vocabulary: fp32 logits and their log-softmax -- or, where the
        token choice converts `choice_chunk_rows` rows at a time (the static loop's greedy batches), only the
        logits in the compute dtype (the chunk's float32 work is `choice_chunk_bytes`, once per batch)."""
        return 3 * self.vocab * 4 if choice_chunk_rows is None else self.vocab * dtype_bytes

    def choice_chunk_bytes(self, choice_chunk_rows: int) -> int:
        """One chunk of greedy choice: its rows' float32 logits, log-softmax and finiteness flags."""
        return choice_chunk_rows * self.vocab * 9


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    max_rows: int
    kv_bytes_per_token: int
    bytes_per_row: int  # everything a row costs, its KV cache and decode temporaries included
    free_bytes: int  # what the budget leaves for rows, the KV pool already allocated counted as left
    kv_row_bytes: int = 0  # the part of `bytes_per_row` that is the row's KV cache (the static loop's pool)
    kv_pool_bytes: int = 0  # the KV pool already allocated (counted in the resident bytes), reused by a take it holds
    decode_row_bytes: int = 0  # the part of `bytes_per_row` a decode step's temporaries take (the graphs' pool)
    graph_rows: int = 0  # the most rows of a captured decode graph: its step's temporaries are resident already
    held_row_bytes: int = 0  # the layer-major prefill's held hidden states a row adds (its padded prompt)...
    held_cap_bytes: int = 0  # ...up to one group's
    released: bool = False  # planned as though the loop's KV pool and graphs were released: true once they are

    def take_bytes(self, rows: int) -> int:
        """What a take of `rows` adds to what is resident. Rows the allocated KV pool holds reuse it (their KV is
        no new memory); a take it cannot hold replaces it, the old pool freed first. A decode step's
        temporaries live in the captured graphs' shared pool, which already holds a step of `graph_rows` rows:
        only rows past that need more. The prefill's held hidden states grow with the rows up to one group."""
        kv = rows * self.kv_row_bytes
        other = self.bytes_per_row - self.kv_row_bytes - self.decode_row_bytes
        held = min(self.held_cap_bytes, rows * self.held_row_bytes)
        return (
            rows * other
            + max(0, rows - self.graph_rows) * self.decode_row_bytes
            + max(0, kv - self.kv_pool_bytes)
            + held
        )


def most_rows(plan: BatchPlan, cap: int) -> int:
    """The most rows, up to `cap`, whose `take_bytes` fits the plan's free bytes (it grows with the rows)."""
    low, high = 0, max(0, cap)
    while low < high:
        mid = (low + high + 1) // 2
        if plan.take_bytes(mid) <= plan.free_bytes:
            low = mid
        else:
            high = mid - 1
    return low


def prefill_chunk_bytes(
    shape: ModelShape,
    *,
    chunk_tokens: int,
    input_tokens: int,
    dtype_bytes: int = 2,
    flash: bool = False,
    one_adapter: bool = False,
) -> int:
    """What the static loop's chunked prefill sets aside for one chunk of `chunk_tokens` prompt tokens going
    through a layer: its activations, and the layer's dequantised weights -- two layers' worth: the weights merged
    with one adapter's LoRA are a copy where a group also runs another adapter's chunks, unless `one_adapter`
    (every row on one adapter, or all on none, in the loop's own prefill: the LoRA merges into the dequantised
    buffers themselves). Unplanned, the weights OOMed long-prompt
    batches on the H200 under a 6 GiB budget.

    `flash`: the loop's own prefill (worker/fastpath/prefill.py), whose K/V go straight into the planned cache and
    whose attention builds no score matrix; its transients were measured (`PREFILL_MARGIN`). Rows after a shared
    prompt prefix get a copy of its K/V in each layer step, at most a chunk's tokens of them (`chunk_rows`), ~1/90
    of a token's transients each. Otherwise the
    model's own forward: its chunk's K/V in a cache of its own, copied over, and (without flash attention) the
    score matrices of the chunk's rows, all with the estimates' safety factor."""
    weights = (1 if flash and one_adapter else 2) * shape.layer_weight_bytes(dtype_bytes)
    if flash:
        padded = chunk_tokens + PREFILL_ROW_BLOCK  # its rows padded to the matmuls' block
        return int(shape.prefill_chunk_activation_bytes(padded, dtype_bytes) * PREFILL_MARGIN) + weights
    activations = chunk_tokens * shape.prefill_bytes_per_token(dtype_bytes)
    chunk = activations + chunk_tokens * shape.kv_bytes_per_token(dtype_bytes) + weights
    chunk += max(1, chunk_tokens // max(1, input_tokens)) * shape.attention_bytes_per_row(input_tokens)
    return int(chunk * SAFETY_FACTOR)


def prefill_chunk_tokens_within(shape: ModelShape, free_bytes: int, *, held_tokens: int, dtype_bytes: int = 2) -> int:
    """The most prompt tokens a chunk of the loop's own prefill may hold in `free_bytes`, beside a layer-major
    group's held states of `held_tokens`: the largest chunk whose set-aside (`prefill_chunk_bytes`, the plan's
    own figure: measured transients with their margin, two layers' weights) fits what is left. 0 where none."""

    def chunk(tokens: int) -> int:
        return prefill_chunk_bytes(shape, chunk_tokens=tokens, input_tokens=1, dtype_bytes=dtype_bytes, flash=True)

    left = free_bytes - held_tokens * shape.prefill_held_bytes_per_token(dtype_bytes) - chunk(0)
    if left <= 0:
        return 0

    def fits(tokens: int) -> bool:
        return chunk(tokens) - chunk(0) <= left

    # The set-aside grows with the tokens, by steps that change where the MLP's blocks are full: a bisection.
    low, high = 0, 1
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def choice_chunk_set_aside_bytes(shape: ModelShape, choice_chunk_rows: int) -> int:
    """What a plan sets aside for the token choice's float32 chunk of `choice_chunk_rows` rows (with the margin)."""
    return int(shape.choice_chunk_bytes(choice_chunk_rows) * SAFETY_FACTOR)


def graph_pool_fixed_bytes(readings: Mapping[int, int], decode_row_bytes: int, planned_bytes: int = 0) -> int:
    """What a fresh decode graphs' pool holds beyond what a plan counts for it -- `decode_row_bytes` a row and
    `planned_bytes` in all: the most any reading (rows -> what a capture of that many rows grew a fresh pool by)
    exceeds that for its rows, or 0."""
    excess = (grew - rows * decode_row_bytes - planned_bytes for rows, grew in readings.items())
    return max(0, max(excess, default=0))


def plan_batch(
    shape: ModelShape,
    *,
    budget_bytes: int,
    resident_bytes: int,
    input_tokens: int,
    new_tokens: int,
    dtype_bytes: int = 2,
    max_rows_cap: int = 512,
    prefill_chunk_tokens: int | None = None,
    cache_tokens: int | None = None,
    flash_prefill: bool = False,
    prefill_group_tokens: int | None = None,
    reserve_bytes: int = RESERVE_BYTES,
    sampler_slots: int = 0,
    choice_chunk_rows: int | None = None,
    kv_pool_bytes: int = 0,
    graph_rows: int = 0,
    graph_row_slack: float = 1.0,
    logprob_rows: int = 0,
    scored_in_prefill: bool = False,
    one_adapter: bool = False,
    pool_readings: Mapping[int, int] | None = None,
) -> BatchPlan:
    """The largest number of rows of `input_tokens + new_tokens` that fits in what the budget leaves.

    With `prefill_chunk_tokens` (the static decode loop), prompts are prefilled in chunks of that many tokens:
    prefill activations are one fixed chunk's, not a per-row cost, and each row keeps `cache_tokens` of KV
    (allocated exactly, so planned without the safety margin the estimates get). `flash_prefill`: the loop's
    own prefill, whose unmasked causal attention never builds a score matrix (flash / memory-efficient).
    `prefill_group_tokens`: that prefill runs groups of chunks holding at most that many prompt tokens through
    a layer before the next, holding the group's hidden states between layers (`prefill_held_bytes_per_token`):
    per row up to one group's, then a fixed cost (planned per row past a group, they cost nightly-like takes
    ~12% of their rows).
    `sampler_slots`: the batch's sampled rows, bucketed, each drawing over the vocabulary in every step.
    `choice_chunk_rows`: the static loop's token choice, converting that many rows' logits to float32 at a time
    (sampled rows' draws convert only their slots' rows; a batch with `logprob_rows` converts them all at once).
    `kv_pool_bytes`: the static loop's KV pool as already allocated, part of `resident_bytes`. A take whose cache
    it holds reuses the whole pool (its rows' KV is no new memory, but neither is the rest of the pool free); a
    larger take replaces it. Planned without the pool, a take of 192 rows beside a 256-row pool ran out of
    memory on the H200 (~560 MiB unplanned); planned with the pool and each row's KV both, every take after the
    first was planned at 0 rows.
    `graph_rows`: the most rows of a decode graph already captured. The graphs share one memory pool, part of
    `resident_bytes`, that holds a greedy step's temporaries for that many rows: counted again per row, they cut
    takes beside a large pool to a third (64 rows where 156 fit, on the H200). A take with logprob rows gets no
    such credit, and each row pays float32 logits and the first choice's float32 work, as when the step
    converted every row's logits: it now converts only the reporting rows' (worker/fastpath/logprobs.py), but
    planned by the slots alone, 88-row Laya takes at 1,024-token prompts ran out of memory on the H100 under a
    6 GiB budget (the allocator's free space split among live blocks, twice in each of two `bench mixed --set
    edges` workloads): the per-row figure is kept as that margin until fragmentation is planned for.
    `graph_row_slack`: a captured graph of up to this many times a take's rows may serve it (its extra rows
    idle along, their first-token logits allocated too).
    `scored_in_prefill`: rows whose `new_tokens` choice tokens are scored inside the loop's own prefill
    (worker/fastpath/scoring.py): no cache, no decode step, no logits held for the take -- each chunk's choices
    run in its own layer steps (counted among its tokens), and the LM head after the group's layers, in the same
    set-aside -- only the group's held states (prompts and choices, their masks and rotary tables) and each
    row's picked log-probabilities.
    `one_adapter`: every row runs on one adapter (or none): the prefill's set-aside holds one layer's weights,
    not two (`prefill_chunk_bytes`).
    `pool_readings`: where the static loop holds no graphs' pool yet (a take's capture makes one, beside the
    prefill's set-aside: the graph is captured before the prompts run), rows -> what a capture of that many
    rows into a fresh pool grew it by, as the loop measured it. Whatever of that the plan's own terms for a
    step (its rows' decode estimate, the float32 choice chunk) do not cover is set aside too
    (`graph_pool_fixed_bytes`; on an H100, Qwen2.5-1.5B shape: ~11 MiB at 16 rows, ~2 MiB at 320, nothing between).
    A pool already held is part of `resident_bytes`."""
    free = budget_bytes - resident_bytes - reserve_bytes
    # Sampled rows draw in a fixed number of slots (not per row of the batch): a fixed cost, with the margin.
    free -= int(sampler_slots * shape.sampling_bytes_per_slot() * SAFETY_FACTOR)
    kv = shape.kv_bytes_per_token(dtype_bytes)
    if prefill_chunk_tokens is None:
        per_row = (input_tokens + new_tokens) * kv + input_tokens * shape.prefill_bytes_per_token(dtype_bytes)
        per_row += shape.attention_bytes_per_row(input_tokens) + shape.decode_bytes_per_row()
        per_row = int(per_row * SAFETY_FACTOR)
    else:
        free -= prefill_chunk_bytes(
            shape, chunk_tokens=prefill_chunk_tokens, input_tokens=input_tokens, dtype_bytes=dtype_bytes,
            flash=flash_prefill, one_adapter=one_adapter,
        )  # fmt: skip
        held_row = held_cap = 0
        if prefill_group_tokens is not None:
            # A layer-major group's held hidden states: exact tensors, no margin. A group holds at most
            # `prefill_group_tokens` padded tokens, or one chunk alone where a chunk is larger (`prefill_chunk_tokens`,
            # or a single prompt longer than that), and never more than the take's rows pad to (each at most
            # `input_tokens`): a take smaller than a group sets aside only its own. They live beside the cache and
            # the decode graphs' pool.
            per_token = shape.prefill_held_bytes_per_token(dtype_bytes)
            held_row = input_tokens * per_token
            held_cap = max(prefill_group_tokens, prefill_chunk_tokens, input_tokens) * per_token
            if scored_in_prefill:
                # Its rows' choices are held beside their prompts (each prompt token with its own rotary table),
                # and a group counts them among its tokens: bounded at the dearer choice token's figure.
                row_tokens = input_tokens + new_tokens
                choice = shape.choice_held_bytes_per_token(row_tokens, dtype_bytes)
                held_row += input_tokens * shape.rotary_bytes_per_token(dtype_bytes) + new_tokens * choice
                held_cap = max(prefill_group_tokens, prefill_chunk_tokens, row_tokens) * choice
        if scored_in_prefill:
            plan = BatchPlan(
                max_rows=0,
                kv_bytes_per_token=kv,
                bytes_per_row=new_tokens * PICKED_BYTES_PER_TOKEN,
                free_bytes=int(free),
                kv_pool_bytes=kv_pool_bytes,
                held_row_bytes=held_row,
                held_cap_bytes=held_cap,
            )
            return replace(plan, max_rows=most_rows(plan, max_rows_cap))
        # The loop allocates its cache exactly (rows x cache_tokens), and the first-token logits the prefill
        # hands over in the compute dtype -- for the rows of the graph that serves the take, up to
        # `graph_row_slack` x its own: no margin on those, only on the estimated decode temporaries.
        cache = cache_tokens or input_tokens + new_tokens
        kv_row = cache * kv
        exact = kv_row + cache * STATE_BYTES_PER_CACHE_TOKEN + int(shape.vocab * dtype_bytes * graph_row_slack)
        chunked = choice_chunk_rows if choice_chunk_rows and not logprob_rows else None
        decode_row = int(shape.decode_bytes_per_row(dtype_bytes, choice_chunk_rows=chunked) * SAFETY_FACTOR)
        if chunked:
            chunk = choice_chunk_set_aside_bytes(shape, chunked)
            # The readings are of greedy steps, whose float32 chunk is this one. A take with logprob rows plans
            # ~6x their per-row figure already (a margin, see `logprob_rows` above): no more on top.
            free -= chunk + graph_pool_fixed_bytes(pool_readings or {}, decode_row, chunk)
        else:
            # The first token is chosen outside the graph, over every row's logits at once in float32 (a copy,
            # its log-softmax, finiteness flags), beside the graph's own temporaries.
            exact += shape.vocab * FIRST_CHOICE_BYTES_PER_VOCAB
            # A graph's pool holds bf16 logits and one float32 chunk, far less than such a step needs.
            graph_rows = 0
        plan = BatchPlan(
            max_rows=0,
            kv_bytes_per_token=kv,
            bytes_per_row=exact + decode_row,
            free_bytes=int(free),
            kv_row_bytes=kv_row,
            kv_pool_bytes=kv_pool_bytes,
            decode_row_bytes=decode_row,
            graph_rows=graph_rows,
            held_row_bytes=held_row,
            held_cap_bytes=held_cap,
        )
        return replace(plan, max_rows=most_rows(plan, max_rows_cap))
    rows = max(0, min(max_rows_cap, free // per_row)) if free > 0 else 0
    return BatchPlan(max_rows=int(rows), kv_bytes_per_token=kv, bytes_per_row=int(per_row), free_bytes=int(free))
