"""The memory planner: GQA-aware KV bytes, size parsing, and batch sizing within the budget."""

from __future__ import annotations

import math

import pytest

from shared.errors import ConfigError
from worker.fastpath import length_bucket
from worker.fastpath.prefill import GROUP_TOKENS
from worker.memory import GIB, MIB, RESERVE_BYTES, SAFETY_FACTOR, ModelShape, parse_bytes, plan_batch

KIB = 1024

QWEN_1_5B = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


def test_kv_bytes_per_token_uses_grouped_query_attention() -> None:
    shape = ModelShape.from_dict(QWEN_1_5B)
    assert shape.kv_bytes_per_token(2) == 28 * 1024
    seed_formula = 2 * 28 * 1536 * 2
    assert seed_formula / shape.kv_bytes_per_token(2) == 6


@pytest.mark.parametrize(
    ("text", "value"),
    [("6GiB", 6 * GIB), ("6GB", 6_000_000_000), ("512MiB", 512 * 1024**2), ("1.5G", int(1.5 * GIB)), ("100", 100)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


def test_parse_bytes_refuses_nonsense() -> None:
    with pytest.raises(ConfigError, match="not a size"):
        parse_bytes("six gigs")


def test_plan_fits_the_budget_and_shrinks_with_longer_rows() -> None:
    shape = ModelShape.from_dict(QWEN_1_5B)
    resident = shape.weight_bytes(quantized=True, double_quant=True)
    short = plan_batch(shape, budget_bytes=6 * GIB, resident_bytes=resident, input_tokens=256, new_tokens=32)
    long = plan_batch(shape, budget_bytes=6 * GIB, resident_bytes=resident, input_tokens=1024, new_tokens=512)
    assert short.max_rows > long.max_rows > 0
    assert short.max_rows * short.bytes_per_row <= short.free_bytes
    none = plan_batch(shape, budget_bytes=1 * GIB, resident_bytes=resident, input_tokens=256, new_tokens=32)
    assert none.max_rows == 0


@pytest.mark.parametrize("budget_gib", [2, 3, 6])
def test_a_layer_major_prefill_is_planned_with_one_groups_held_hidden_states_inside_the_budget(
    budget_gib: float,
) -> None:
    """The static loop's layer-major prefill holds one group's hidden states between layers: two hidden-size
    vectors per padded prompt token (and its int64 ids and cache columns) for at most `prefill_group_tokens`
    tokens -- or one chunk, where a chunk is larger (a prompt longer than a chunk) -- and never more than the
    take's rows pad to. Per row up to one group, then a fixed cost; never past the budget."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    resident = shape.weight_bytes(quantized=True, double_quant=True)
    per_token = shape.prefill_held_bytes_per_token(2)
    assert per_token == 2 * 1536 * 2 + 16
    assert GROUP_TOKENS * per_token == 6160 * 32 * KIB  # ~192 MiB: a modest fixed cost
    for inputs in (1, 16, 200, 1024, 4000, 40000):
        for new in (1, 64, 512):
            common = {
                "budget_bytes": int(budget_gib * GIB),
                "resident_bytes": resident,
                "input_tokens": inputs,
                "new_tokens": new,
                "prefill_chunk_tokens": 4096,
                "cache_tokens": length_bucket(inputs + new),
                "flash_prefill": True,
                "choice_chunk_rows": 32,
            }
            chunk_major = plan_batch(shape, **common)
            plan = plan_batch(shape, **common, prefill_group_tokens=GROUP_TOKENS)
            held = min(max(GROUP_TOKENS, inputs), plan.max_rows * inputs) * per_token
            assert plan.take_bytes(plan.max_rows) - chunk_major.take_bytes(plan.max_rows) == held
            assert (plan.bytes_per_row, plan.free_bytes) == (chunk_major.bytes_per_row, chunk_major.free_bytes)
            assert chunk_major.free_bytes <= int(budget_gib * GIB) - resident - RESERVE_BYTES
            assert plan.max_rows <= chunk_major.max_rows
            assert plan.max_rows * plan.bytes_per_row + held <= max(0, plan.free_bytes), (inputs, new)
            # Every planned row's KV, plus one group's held states and the one chunk set aside, within the budget.
            kv = plan.max_rows * common["cache_tokens"] * shape.kv_bytes_per_token(2)
            assert resident + RESERVE_BYTES + held + kv <= int(budget_gib * GIB)
    assert plan_batch(shape, **{**common, "budget_bytes": resident + RESERVE_BYTES + MIB}).max_rows == 0


def test_a_take_smaller_than_a_group_sets_aside_only_its_own_rows_held_states() -> None:
    """Where a whole group's ~192 MiB would not fit beside a few rows, the rows' own held states do: a small
    budget still plans the rows it plans without the layer-major prefill, less what their prompts hold."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    resident = shape.weight_bytes(quantized=True, double_quant=True)
    common = {
        "resident_bytes": resident,
        "input_tokens": 64,
        "new_tokens": 16,
        "prefill_chunk_tokens": 4096,
        "cache_tokens": length_bucket(64 + 16),
        "flash_prefill": True,
        "choice_chunk_rows": 32,
    }
    roomy = plan_batch(shape, budget_bytes=6 * GIB, **common)
    chunk_set_aside = 6 * GIB - RESERVE_BYTES - resident - roomy.free_bytes
    budget = resident + RESERVE_BYTES + chunk_set_aside + 100 * MIB  # 100 MiB for rows: less than a group holds
    bare = plan_batch(shape, budget_bytes=budget, **common)
    grouped = plan_batch(shape, budget_bytes=budget, **common, prefill_group_tokens=GROUP_TOKENS)
    assert GROUP_TOKENS * shape.prefill_held_bytes_per_token(2) > bare.free_bytes > 0
    own = 64 * shape.prefill_held_bytes_per_token(2)  # a row's prompt's held states
    assert 0 < grouped.max_rows < bare.max_rows
    assert grouped.max_rows >= bare.free_bytes // (bare.bytes_per_row + own) - 1
    assert grouped.take_bytes(grouped.max_rows) <= grouped.free_bytes < grouped.take_bytes(grouped.max_rows + 1)


# 378 rows without the prefill's held states; with 1,200 MiB more held elsewhere 255, about the nightly takes' 260
@pytest.mark.parametrize("held_mib", [0, 1200])
def test_a_nightly_take_keeps_its_rows_with_a_fixed_group_not_a_per_row_term(held_mib: int) -> None:
    """Nightly-like takes (prompts up to 256 tokens, 32 new, 6 GiB): counting the held states per row
    (256 x 6,160 bytes each) cost ~13% of the rows; one group's fixed ~192 MiB costs about 20 rows of ~10 MB."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    common = {
        "budget_bytes": 6 * GIB,
        "resident_bytes": shape.weight_bytes(quantized=True, double_quant=True) + held_mib * MIB,
        "input_tokens": 256,
        "new_tokens": 32,
        "max_rows_cap": 512,
        "prefill_chunk_tokens": 4096,
        "cache_tokens": length_bucket(256 + 32),
        "flash_prefill": True,
        "choice_chunk_rows": 32,
    }
    chunk_major = plan_batch(shape, **common)
    grouped = plan_batch(shape, **common, prefill_group_tokens=GROUP_TOKENS)
    per_row = chunk_major.free_bytes // (chunk_major.bytes_per_row + 256 * shape.prefill_held_bytes_per_token(2))
    assert per_row < 0.9 * chunk_major.max_rows
    assert per_row < grouped.max_rows <= chunk_major.max_rows
    # The group's bytes cost as many rows as they would hold, once: ~20 rows of ~10 MB.
    fixed_rows = math.ceil(GROUP_TOKENS * shape.prefill_held_bytes_per_token(2) / chunk_major.bytes_per_row)
    assert grouped.max_rows >= chunk_major.max_rows - fixed_rows


def test_rows_scored_in_the_prefill_cost_no_cache_so_a_take_holds_the_row_cap() -> None:
    """Choice rows scored inside the loop's prefill (Laya-like prompts up to 434 tokens, 9 choice tokens, 6 GiB
    with a 1,300 MiB KV pool resident): generation-sized plans give them a few hundred rows at most; scored in
    the prefill a row costs its picked log-probabilities and a share of one group's held states, so the take is
    the row cap -- and a budget that leaves no room for the chunk and a group plans none."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    resident = shape.weight_bytes(quantized=True, double_quant=True) + 1300 * MIB
    common = {
        "resident_bytes": resident,
        "input_tokens": 434,
        "new_tokens": 9,
        "max_rows_cap": 1024,
        "prefill_chunk_tokens": 4096,
        "cache_tokens": length_bucket(434 + 9),
        "flash_prefill": True,
        "prefill_group_tokens": GROUP_TOKENS,
        "choice_chunk_rows": 32,
    }
    cached = plan_batch(shape, budget_bytes=6 * GIB, **common)
    scored = plan_batch(shape, budget_bytes=6 * GIB, **common, scored_in_prefill=True)
    assert cached.max_rows < 400 and scored.max_rows == 1024
    assert scored.take_bytes(1024) <= scored.free_bytes and scored.kv_row_bytes == 0
    # The group's held states, bounded at a choice token's dearer figure (its mask over the row's tokens).
    assert scored.held_cap_bytes == GROUP_TOKENS * shape.choice_held_bytes_per_token(434 + 9)
    tight = plan_batch(shape, budget_bytes=6 * GIB - scored.free_bytes + scored.held_cap_bytes // 2, **common,
                       scored_in_prefill=True)  # fmt: skip
    assert 0 < tight.max_rows < 1024 and tight.take_bytes(tight.max_rows) <= tight.free_bytes
    none = plan_batch(shape, budget_bytes=6 * GIB - scored.free_bytes - 1, **common, scored_in_prefill=True)
    assert none.max_rows == 0


def test_memory_command_prints_the_seed_table_estimated_on_cpu(tiny_models) -> None:
    from click.testing import CliRunner

    from producer.cli import cli
    from tests.conftest import tiny_config

    tiny_config(tiny_models, "nf4")
    result = CliRunner().invoke(cli, ["memory", "--config", str(tiny_models / "models-nf4.toml"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "estimated, CPU" in out
    for row in ("after 4-bit load", "after adapters", "~512 tokens", "~1024 tokens", "batch plan under a 6.00 GiB"):
        assert row in out
    assert "kev" in out and "laya" in out and "KiB/token" in out


# Takes of many shapes one after another: (prompt tokens, new tokens). Long and short, growing and shrinking, so
# the pool the previous take left is sometimes larger than the next take needs and sometimes smaller.
TAKE_SHAPES = [(200, 32), (1024, 128), (64, 8), (300, 32), (1024, 512), (120, 16), (700, 64), (200, 32), (40, 4)]


@pytest.mark.parametrize("budget_gib", [3, 4, 6, 12])
def test_a_run_of_takes_beside_the_pool_and_graphs_the_last_ones_left_never_passes_the_budget(budget_gib: int) -> None:
    """The static loop keeps its KV pool between takes and reuses it for any take whose cache it holds; its
    captured graphs keep a shared pool holding a decode step's temporaries for the most rows captured. Over a
    run of takes of every shape, each planned from what is resident then (weights, the KV pool and the graphs'
    pool the previous takes left), what each take really holds stays inside the budget: the KV pool it uses
    (the old one whole, or a new one of its own rows with the old one and the graphs freed first), the graphs'
    pool (grown to its rows if more), its rows' other costs and the fixed ones. And every take still gets rows
    (counting the pool and each row's KV both would plan 0). Where no row fits beside the pool, the engine
    releases it and plans again (`Engine.plan`): so does this run."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    weights = shape.weight_bytes(quantized=True, double_quant=True)
    budget = budget_gib * GIB
    pool = graph_rows = 0
    for inputs, new in TAKE_SHAPES * 2:
        cache = length_bucket(inputs + new)
        common = dict(
            budget_bytes=budget, input_tokens=inputs, new_tokens=new, prefill_chunk_tokens=4096, cache_tokens=cache,
            flash_prefill=True, choice_chunk_rows=32,
        )  # fmt: skip
        alone = plan_batch(shape, resident_bytes=weights, **common)  # the same take with nothing allocated
        step = alone.decode_row_bytes
        resident = weights + pool + graph_rows * step
        plan = plan_batch(shape, resident_bytes=resident, kv_pool_bytes=pool, graph_rows=graph_rows, **common)
        if plan.max_rows == 0:
            pool = graph_rows = 0
            plan = alone
        fixed = alone.free_bytes - (budget - weights - RESERVE_BYTES)  # negative: the prefill chunk and such
        rows = plan.max_rows
        assert rows > 0, (inputs, new, pool)
        kv = rows * cache * shape.kv_bytes_per_token()
        if kv > pool:  # the loop replaces a pool that cannot hold the take, releasing the graphs with it
            pool, graph_rows = kv, 0
        graph_rows = max(graph_rows, rows)
        other = rows * (plan.bytes_per_row - plan.kv_row_bytes - plan.decode_row_bytes)
        held = weights + pool + graph_rows * step + other - fixed
        assert held <= budget - RESERVE_BYTES, (inputs, new, rows)
        assert plan.take_bytes(rows) <= plan.free_bytes
        if rows < 512:  # the most rows that fit: one more would not
            assert plan.take_bytes(rows + 1) > plan.free_bytes


def test_a_take_the_pool_holds_pays_only_its_rows_other_costs() -> None:
    """A pool a long take left (its rows x 1,024 tokens) holds many more rows of short prompts than fit beside it.
    A short take reuses it: its rows' KV costs nothing new (`take_bytes`), so it plans the most rows whose other
    costs fit what the pool leaves -- far more than counting the pool and each row's KV both would -- and still
    fewer than a take without the pool (the engine weighs releasing it: `Engine.plan`). A take the pool cannot
    hold replaces it, the old pool freed first."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    weights = shape.weight_bytes(quantized=True, double_quant=True)
    common = dict(budget_bytes=6 * GIB, prefill_chunk_tokens=4096, flash_prefill=True, choice_chunk_rows=32)
    long = plan_batch(shape, resident_bytes=weights, input_tokens=900, new_tokens=100, cache_tokens=1024, **common)
    pool = long.max_rows * 1024 * shape.kv_bytes_per_token()
    short = dict(input_tokens=100, new_tokens=20, cache_tokens=128, **common)
    plan = plan_batch(shape, resident_bytes=weights + pool, kv_pool_bytes=pool, **short)
    rest = plan.bytes_per_row - plan.kv_row_bytes
    held_rows = pool // plan.kv_row_bytes
    assert plan.kv_row_bytes == 128 * shape.kv_bytes_per_token()
    assert plan.take_bytes(100) == 100 * rest  # held by the pool: no KV of its own
    assert plan.take_bytes(held_rows + 1) == (held_rows + 1) * plan.bytes_per_row - pool  # replaces the pool
    assert 0 < plan.max_rows <= held_rows  # a reusing take
    assert plan.take_bytes(plan.max_rows) <= plan.free_bytes < plan.take_bytes(plan.max_rows + 1)
    assert plan.max_rows > 2 * max(0, plan.free_bytes // plan.bytes_per_row)  # not the pool and each row's KV both
    fresh = plan_batch(shape, resident_bytes=weights, **short)
    assert plan.max_rows < fresh.max_rows


def test_a_step_the_graphs_pool_already_holds_is_not_planned_again() -> None:
    """With decode graphs of 256 rows captured, their shared pool holds a step's temporaries for 256 rows: a take
    of 128 rows pays none, one of 300 rows pays for the 44 rows past them; the plan gets rows by as much."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    weights = shape.weight_bytes(quantized=True, double_quant=True)
    common = dict(
        budget_bytes=5 * GIB, input_tokens=200, new_tokens=32, prefill_chunk_tokens=4096,
        cache_tokens=length_bucket(232), flash_prefill=True, choice_chunk_rows=32,
    )  # fmt: skip
    plain = plan_batch(shape, resident_bytes=weights, **common)
    graphs = plan_batch(shape, resident_bytes=weights, graph_rows=256, **common)
    step = graphs.decode_row_bytes
    assert step > 0
    assert graphs.take_bytes(128) == plain.take_bytes(128) - 128 * step
    assert graphs.take_bytes(300) == plain.take_bytes(300) - 256 * step
    assert graphs.max_rows > plain.max_rows


def test_what_a_fresh_graphs_pool_held_past_the_plans_own_terms_is_set_aside_before_a_capture() -> None:
    """A capture measured into a fresh pool: the part of its growth that the plan's own terms for a greedy step
    (its rows' decode estimate, the float32 choice chunk) do not cover is set aside where a take will capture
    into a fresh pool, and only that part -- the rows still pay their own estimate. The largest excess of
    several readings counts; a reading within those terms sets nothing aside, and neither does any reading for
    a take with logprob rows (its per-row figure is already a margin several times a greedy step's)."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    weights = shape.weight_bytes(quantized=True, double_quant=True)
    common = dict(
        budget_bytes=5 * GIB, resident_bytes=weights, input_tokens=200, new_tokens=32, prefill_chunk_tokens=4096,
        cache_tokens=length_bucket(232), flash_prefill=True, choice_chunk_rows=32,
    )  # fmt: skip
    plain = plan_batch(shape, **common)
    step, chunk = plain.decode_row_bytes, int(shape.choice_chunk_bytes(32) * SAFETY_FACTOR)
    assert plan_batch(shape, pool_readings={288: 288 * step + chunk}, **common) == plain
    assert plan_batch(shape, pool_readings={64: 10 * step}, **common) == plain
    readings = {288: 288 * step + chunk + 100 * MIB, 64: 64 * step + chunk + 40 * MIB, 16: 8 * step}
    planned = plan_batch(shape, pool_readings=readings, **common)
    assert planned.free_bytes == plain.free_bytes - 100 * MIB
    assert planned.bytes_per_row == plain.bytes_per_row and planned.decode_row_bytes == step
    assert planned.max_rows < plain.max_rows
    assert planned.take_bytes(planned.max_rows) <= planned.free_bytes
    assert plain.take_bytes(plain.max_rows) > planned.free_bytes  # the old plan would not have fit beside it
    reporting = plan_batch(shape, logprob_rows=3, **common)
    assert plan_batch(shape, logprob_rows=3, pool_readings=readings, **common) == reporting


def test_a_take_with_logprob_rows_gets_no_credit_from_the_graphs_pool() -> None:
    """A graph's pool holds bf16 logits and one float32 chunk of rows. Sampled rows keep that (the slots draw on
    their own rows' float32 logits, a fixed cost), so a sampled take gets the same credit as a greedy one. A take
    with rows reporting logprobs is planned as though every row's logits went to float32, in the graph and in
    the first token's choice outside it (what the step once did; kept as a margin against fragmentation, see
    `plan_batch`): planned whole whatever graphs exist, paying the first choice's float32 work per row."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    weights = shape.weight_bytes(quantized=True, double_quant=True)
    common = dict(
        budget_bytes=6 * GIB, resident_bytes=weights, input_tokens=1000, new_tokens=24, prefill_chunk_tokens=4096,
        cache_tokens=1024, flash_prefill=True, choice_chunk_rows=32,
    )  # fmt: skip
    greedy = plan_batch(shape, **common)
    sampled = plan_batch(shape, sampler_slots=8, graph_rows=256, **common)
    assert sampled.bytes_per_row == greedy.bytes_per_row
    assert sampled.take_bytes(64) < plan_batch(shape, sampler_slots=8, **common).take_bytes(64)  # the credit
    reporting = plan_batch(shape, sampler_slots=8, logprob_rows=3, **common)
    beside_graphs = plan_batch(shape, sampler_slots=8, logprob_rows=3, graph_rows=256, **common)
    assert beside_graphs.max_rows == reporting.max_rows
    assert beside_graphs.take_bytes(64) == reporting.take_bytes(64)
    assert reporting.decode_row_bytes > greedy.decode_row_bytes  # a step's temporaries, every row in float32
    first = reporting.bytes_per_row - greedy.bytes_per_row - (reporting.decode_row_bytes - greedy.decode_row_bytes)
    assert first == shape.vocab * (4 + 4 + 1)  # float32 logits, their log-softmax, finiteness flags


def test_the_loops_prefill_chunk_is_set_aside_as_measured_and_the_models_forward_with_the_estimates_margin() -> None:
    """The loop's own prefill (flash): a chunk's activation estimate with `PREFILL_MARGIN` (measured ~340 MiB at
    4,096 tokens on the H200, 513 MiB set aside) and two layers' weights exact; the model's own forward keeps its
    K/V, score matrices and the safety factor on everything."""
    from worker.memory import (
        PREFILL_MARGIN,
        PREFILL_MLP_BLOCK_TOKENS,
        PREFILL_ROW_BLOCK,
        SAFETY_FACTOR,
        prefill_chunk_bytes,
    )

    shape = ModelShape.from_dict(QWEN_1_5B)
    weights = 2 * shape.layer_weight_bytes()
    ours = prefill_chunk_bytes(shape, chunk_tokens=4096, input_tokens=256, flash=True)
    # The chunk's rows with their room up to the matmuls' next block (worker/fastpath/gemm.py).
    assert ours == int(shape.prefill_chunk_activation_bytes(4096 + PREFILL_ROW_BLOCK) * PREFILL_MARGIN) + weights
    assert 505 * MIB < ours < 520 * MIB  # 523 MiB with the MLP whole (its padded rows past a block: not run)
    # Gate/up runs in blocks (worker/fastpath/weights.py): past a block, a token adds the attention's side and its
    # SiLU x up product (the down projection reads the whole chunk's), not its gate/up.
    past_block = (6 * shape.hidden + shape.intermediate) * 2
    assert PREFILL_MLP_BLOCK_TOKENS <= 4096
    larger = prefill_chunk_bytes(shape, chunk_tokens=8192, input_tokens=256, flash=True)
    assert larger - ours == pytest.approx(4096 * past_block * PREFILL_MARGIN, abs=1)
    small = prefill_chunk_bytes(shape, chunk_tokens=512, input_tokens=256, flash=True)
    assert small - weights == int((512 + PREFILL_ROW_BLOCK) * shape.prefill_bytes_per_token() * PREFILL_MARGIN)
    theirs = prefill_chunk_bytes(shape, chunk_tokens=4096, input_tokens=256, flash=False)
    per_token = shape.prefill_bytes_per_token() + shape.kv_bytes_per_token()
    attention = (4096 // 256) * shape.attention_bytes_per_row(256)
    assert theirs == int((4096 * per_token + weights + attention) * SAFETY_FACTOR)
    # Rows of one adapter: its LoRA merges into the dequantised buffers in place, one layer's weights at a time
    # (the measured ~340 MiB held one layer's ~89 MiB); the model's own forward keeps its figure.
    one = prefill_chunk_bytes(shape, chunk_tokens=4096, input_tokens=256, flash=True, one_adapter=True)
    assert one == ours - shape.layer_weight_bytes()
    assert prefill_chunk_bytes(shape, chunk_tokens=4096, input_tokens=256, flash=False, one_adapter=True) == theirs


def test_a_take_of_one_adapter_plans_more_rows_in_the_same_memory_by_one_layers_weights() -> None:
    """The set-aside saved (one layer's dequantised weights) goes to rows, for generation and scoring alike."""
    shape = ModelShape.from_dict(QWEN_1_5B)
    common = dict(
        budget_bytes=6 * GIB, resident_bytes=1500 * MIB, input_tokens=256, new_tokens=32, prefill_chunk_tokens=4096,
        flash_prefill=True, prefill_group_tokens=GROUP_TOKENS, choice_chunk_rows=64, cache_tokens=384,
        max_rows_cap=4096,
    )  # fmt: skip
    two, one = plan_batch(shape, **common), plan_batch(shape, one_adapter=True, **common)
    assert one.free_bytes - two.free_bytes == shape.layer_weight_bytes()
    assert one.max_rows > two.max_rows
    assert one.take_bytes(one.max_rows) <= one.free_bytes < one.take_bytes(one.max_rows + 1)


@pytest.mark.parametrize("free_mib", [0, 300, 503, 900, 1400, 3000])
def test_the_largest_prefill_chunk_the_free_memory_holds_is_what_the_plan_would_set_aside_for_it(free_mib: int) -> None:
    """`prefill_chunk_tokens_within` inverts the plan's own chunk set-aside: that chunk plus the held group fits
    the free memory, one token more does not; nothing fits where the held group and the weights alone do not."""
    from worker.fastpath.prefill import MAX_CHUNK_TOKENS
    from worker.memory import prefill_chunk_bytes, prefill_chunk_tokens_within

    shape = ModelShape.from_dict(QWEN_1_5B)
    free = free_mib * MIB
    held = GROUP_TOKENS * shape.prefill_held_bytes_per_token()

    def needs(tokens: int) -> int:
        return held + prefill_chunk_bytes(shape, chunk_tokens=tokens, input_tokens=1, flash=True)

    tokens = prefill_chunk_tokens_within(shape, free, held_tokens=GROUP_TOKENS)
    if needs(0) >= free:
        assert tokens == 0
    else:
        assert needs(tokens) <= free < needs(tokens + 1)
    if free_mib == 900:  # a held group of 32,768 tokens (~192 MiB) beside: past the loop's largest chunk
        assert tokens > MAX_CHUNK_TOKENS
