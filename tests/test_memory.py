"""The memory planner: GQA-aware KV bytes, size parsing, and batch sizing within the budget."""

from __future__ import annotations

import math

import pytest

from shared.errors import ConfigError
from worker.fastpath import length_bucket
from worker.fastpath.prefill import GROUP_TOKENS
from worker.memory import GIB, MIB, RESERVE_BYTES, ModelShape, parse_bytes, plan_batch

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
    tokens -- or one chunk, where a chunk is larger (a prompt longer than a chunk). A fixed cost, set aside
    once: never per row, never past the budget."""
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
            held = max(GROUP_TOKENS, inputs) * per_token
            assert plan.bytes_per_row == chunk_major.bytes_per_row
            assert plan.free_bytes == chunk_major.free_bytes - held
            assert chunk_major.free_bytes <= int(budget_gib * GIB) - resident - RESERVE_BYTES
            assert plan.max_rows <= chunk_major.max_rows
            assert plan.max_rows * plan.bytes_per_row <= max(0, plan.free_bytes), (inputs, new)
            # Every planned row's KV, plus one group's held states and the one chunk set aside, within the budget.
            kv = plan.max_rows * common["cache_tokens"] * shape.kv_bytes_per_token(2)
            assert resident + RESERVE_BYTES + held + kv <= int(budget_gib * GIB)
    assert plan_batch(shape, **{**common, "budget_bytes": resident + RESERVE_BYTES + MIB}).max_rows == 0


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
