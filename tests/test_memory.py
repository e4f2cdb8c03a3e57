"""The memory planner: GQA-aware KV bytes, size parsing, and batch sizing within the budget."""

from __future__ import annotations

import pytest

from shared.errors import ConfigError
from worker.memory import GIB, ModelShape, parse_bytes, plan_batch

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
