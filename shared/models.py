"""The model names both sides agree on, and each one's shipped defaults (data, not code branches).

Adding a model is a name here (with its defaults) plus a table in the models config; nothing in the
worker names a model. Every default can be overridden in the models config.
"""

from __future__ import annotations

from dataclasses import dataclass

KEV = "kev"
LAYA = "laya"
MODEL_NAMES: tuple[str, ...] = (KEV, LAYA)


@dataclass(frozen=True, kw_only=True)
class ModelDefaults:
    """What a model is when its config table says nothing more (the seed's table)."""

    max_new_tokens: int
    system: str
    escalates_to: str | None = None  # the model that answers this one's unsure answers
    lora_rank: int = 8
    lora_alpha: int = 16
    learning_rate: float = 2e-4


GENERIC_DEFAULTS = ModelDefaults(max_new_tokens=256, system="You are a careful decision assistant.")

MODEL_DEFAULTS: dict[str, ModelDefaults] = {
    # Kev writes long structured answers and needs more low-rank capacity for them.
    KEV: ModelDefaults(
        max_new_tokens=512,
        system="You are Kev. Analyse the case step by step, then end with a line 'Decision: <label>'.",
        lora_rank=16,
        lora_alpha=32,
        learning_rate=1e-4,
    ),
    LAYA: ModelDefaults(
        max_new_tokens=64,
        system="You are Laya. Answer with the decision only.",
        escalates_to=KEV,
    ),
}


def defaults_for(name: str) -> ModelDefaults:
    return MODEL_DEFAULTS.get(name, GENERIC_DEFAULTS)
