"""The models config: one TOML file naming the base(s), and per model its adapter, template and limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from shared.errors import ConfigError
from shared.models import DEFAULT_MAX_NEW_TOKENS, LAYA, MODEL_NAMES
from worker.calibration import Calibration

QUANTIZATIONS = ("nf4", "fp4", "none")
DTYPES = ("float16", "bfloat16", "float32")
DEFAULT_BASE = "default"

# Qwen-style chat framing; `{prompt}` (or any `input` field) is filled with user text, tokenised as text.
DEFAULT_TEMPLATE = (
    "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
)
DEFAULT_SYSTEM = {
    "kev": "You are Kev. Analyse the case step by step, then end with a line 'Decision: <label>'.",
    "laya": "You are Laya. Answer with the decision only.",
}
# Kev's follow-up sees Laya's answer, so it can confirm or overturn it.
DEFAULT_FOLLOWUP_TEMPLATE = (
    "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}\n\n"
    "A quick first answer was: {laya_answer} (confidence {laya_confidence}). Check it.<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DEFAULT_UNSURE_PHRASES = ("不确定", "可能需要更多信息", "not sure", "need more information", "unsure")


@dataclass(frozen=True, kw_only=True)
class BaseSpec:
    name: str
    path: Path
    quantization: str = "nf4"
    compute_dtype: str = "bfloat16"
    double_quant: bool = True


@dataclass(frozen=True, kw_only=True)
class EscalationRule:
    """Laya's answer escalates to Kev when any condition holds (Laya only)."""

    enabled: bool = True
    threshold: float = 0.7
    phrases: tuple[str, ...] = DEFAULT_UNSURE_PHRASES
    max_chars: int = 400


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    name: str
    base: str
    adapter: Path | None
    template: str
    followup_template: str | None
    system: str
    max_input_tokens: int
    max_new_tokens: int
    decision_prefix: str | None
    escalation: EscalationRule | None
    # `[models.NAME.calibration]`, written by `kevlaya calibrate`: maps the raw token-probability confidence
    # to a calibrated one before escalation and in results (worker/calibration.py). None: raw confidences.
    calibration: Calibration | None = None


@dataclass(frozen=True, kw_only=True)
class ModelsConfig:
    path: Path
    bases: dict[str, BaseSpec]
    models: dict[str, ModelSpec]
    stop_strings: tuple[str, ...] = field(default=("<|im_end|>", "<|endoftext|>"))

    def base_of(self, model: str) -> BaseSpec:
        return self.bases[self.models[model].base]


def load_config(path: str | Path, *, check_paths: bool = True) -> ModelsConfig:
    """Parse and validate the TOML file; relative paths resolve against the file's folder."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"models config not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    root = path.parent.resolve()
    bases = _bases(raw, root)
    models = {name: _model(name, raw.get("models", {}).get(name, {}), bases, root) for name in MODEL_NAMES}
    stops = tuple(raw.get("stop_strings", ("<|im_end|>", "<|endoftext|>")))
    config = ModelsConfig(path=path, bases=bases, models=models, stop_strings=stops)
    if check_paths:
        check_files(config)
    return config


def _bases(raw: dict[str, Any], root: Path) -> dict[str, BaseSpec]:
    tables = dict(raw.get("bases", {}))
    if "base" in raw:
        tables[DEFAULT_BASE] = raw["base"]
    if not tables:
        raise ConfigError("the config needs a [base] table (or [bases.NAME] tables)")
    return {name: _base(name, table, root) for name, table in tables.items()}


def _base(name: str, table: dict[str, Any], root: Path) -> BaseSpec:
    _known(table, {"path", "quantization", "compute_dtype", "double_quant"}, f"[bases.{name}]")
    if "path" not in table:
        raise ConfigError(f"[bases.{name}] needs 'path' (a local checkpoint folder)")
    quant = table.get("quantization", "nf4")
    if quant not in QUANTIZATIONS:
        raise ConfigError(f"[bases.{name}] quantization must be one of {QUANTIZATIONS}, got {quant!r}")
    dtype = table.get("compute_dtype", "bfloat16")
    if dtype not in DTYPES:
        raise ConfigError(f"[bases.{name}] compute_dtype must be one of {DTYPES}, got {dtype!r}")
    return BaseSpec(
        name=name,
        path=(root / table["path"]).resolve(),
        quantization=quant,
        compute_dtype=dtype,
        double_quant=bool(table.get("double_quant", True)),
    )


_MODEL_KEYS = {
    "base",
    "adapter",
    "template",
    "followup_template",
    "system",
    "max_input_tokens",
    "max_new_tokens",
    "decision_prefix",
    "escalation",
    "calibration",
}


def _model(name: str, table: dict[str, Any], bases: dict[str, BaseSpec], root: Path) -> ModelSpec:
    _known(table, _MODEL_KEYS, f"[models.{name}]")
    base = table.get("base", DEFAULT_BASE if DEFAULT_BASE in bases else next(iter(bases)))
    if base not in bases:
        raise ConfigError(f"[models.{name}] names base {base!r}; defined: {', '.join(bases)}")
    max_new = int(table.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS[name]))
    max_in = int(table.get("max_input_tokens", 1024))
    if max_new < 1 or max_in < 1:
        raise ConfigError(f"[models.{name}] max_new_tokens and max_input_tokens must be positive")
    adapter = table.get("adapter")
    followup = table.get("followup_template", DEFAULT_FOLLOWUP_TEMPLATE if name != LAYA else None)
    return ModelSpec(
        name=name,
        base=base,
        adapter=(root / adapter).resolve() if adapter else None,
        template=table.get("template", DEFAULT_TEMPLATE),
        followup_template=followup,
        system=table.get("system", DEFAULT_SYSTEM[name]),
        max_input_tokens=max_in,
        max_new_tokens=max_new,
        decision_prefix=table.get("decision_prefix", "Decision:"),
        escalation=_escalation(name, table.get("escalation")),
        calibration=_calibration(name, table.get("calibration")),
    )


def _escalation(name: str, table: dict[str, Any] | None) -> EscalationRule | None:
    if name != LAYA:
        if table:
            raise ConfigError(f"[models.{name}.escalation]: only Laya escalates")
        return None
    table = table or {}
    _known(table, {"enabled", "threshold", "phrases", "max_chars"}, f"[models.{name}.escalation]")
    threshold = float(table.get("threshold", 0.7))
    if not 0.0 <= threshold <= 1.0:
        raise ConfigError(f"[models.{name}.escalation] threshold must be in [0, 1], got {threshold}")
    return EscalationRule(
        enabled=bool(table.get("enabled", True)),
        threshold=threshold,
        phrases=tuple(table.get("phrases", DEFAULT_UNSURE_PHRASES)),
        max_chars=int(table.get("max_chars", 400)),
    )


def _calibration(name: str, table: Any) -> Calibration | None:
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError(f"[models.{name}] calibration must be a table ([models.{name}.calibration])")
    return Calibration.from_table(table, f"[models.{name}.calibration]")


def _known(table: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def check_files(config: ModelsConfig) -> None:
    """Refuse to start on a missing base or adapter path, naming it."""
    for base in config.bases.values():
        if not (base.path / "config.json").is_file():
            raise ConfigError(f"base {base.name!r}: no checkpoint at {base.path} (config.json missing)")
    for model in config.models.values():
        if model.adapter is not None and not (model.adapter / "adapter_config.json").is_file():
            raise ConfigError(f"model {model.name!r}: no PEFT adapter at {model.adapter} (adapter_config.json missing)")
