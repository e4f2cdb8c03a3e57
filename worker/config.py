"""The models config: one TOML file naming the base(s), and per model its adapter, template and limits."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from shared import models as known_models
from shared.errors import ConfigError
from shared.models import defaults_for
from worker.calibration import Calibration
from worker.config_schema import ConfigFile, EscalationTable, ModelTable, parse_file

QUANTIZATIONS = ("nf4", "fp4", "none")
DTYPES = ("float16", "bfloat16", "float32")
DEFAULT_BASE = "default"

# Qwen-style chat framing; `{prompt}` (or any `input` field) is filled with user text, tokenised as text.
DEFAULT_TEMPLATE = (
    "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
)
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
    escalates_to: str | None = None  # the model that answers this one's unsure answers
    # Whether a job's `input.system` may replace the system prompt (as user text, never control tokens).
    job_may_set_system: bool = False
    # `[models.NAME.calibration]`, written by `kevlaya calibrate`: maps the raw token-probability confidence
    # to a calibrated one before escalation and in results (worker/calibration.py). None: raw confidences.
    calibration: Calibration | None = None


@dataclass(frozen=True, kw_only=True)
class ModelsConfig:
    path: Path
    bases: dict[str, BaseSpec]
    models: dict[str, ModelSpec]
    stop_strings: tuple[str, ...] = field(default=("<|im_end|>", "<|endoftext|>"))
    # Whether the file set `stop_strings`: those must each be one token of every base (checked at load);
    # the defaults stop where the tokenizer knows them (Qwen's two), else at its EOS.
    stop_strings_set: bool = False

    def base_of(self, model: str) -> BaseSpec:
        return self.bases[self.models[model].base]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.models)

    def shares_base(self, a: str, b: str) -> bool:
        """Whether two models can share one (mixed) batch: the same resident base."""
        return self.models[a].base == self.models[b].base


def load_config(path: str | Path, *, check_paths: bool = True) -> ModelsConfig:
    """Parse and validate the TOML file; relative paths resolve against the file's folder."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"models config not found: {path}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): TOML files are UTF-8") from exc
    except OSError as exc:  # a directory, no permission, an I/O error
        raise ConfigError(f"{path}: cannot read the models config: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    config = _parse(raw, path)
    if check_paths:
        check_files(config)
    return config


def config_from_toml(text: str, *, path: Path = Path("models.toml")) -> ModelsConfig:
    """A config from TOML text, paths unchecked (for engines that load nothing: tests, queue benchmarks)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}") from exc
    return _parse(raw, path)


def _parse(raw: dict[str, Any], path: Path) -> ModelsConfig:
    """The typed file (worker.config_schema), then the relations between tables: bases named, model names
    known, escalation targets real."""
    where = str(path)
    file = parse_file(raw, where=where)
    root = path.parent.resolve()
    bases = _bases(file, root, where)
    names = known_models.MODEL_NAMES
    for name in file.models:
        if name not in names:
            hint = difflib.get_close_matches(name, names, n=1)
            suggestion = f"did you mean [models.{hint[0]}]?" if hint else f"known: {', '.join(names)}"
            raise ConfigError(f"{where}: [models.{name}] is not a known model ({suggestion}; shared/models.py)")
    tables = {name: file.models.get(name, ModelTable()) for name in names}
    targets = {t for n, table in tables.items() if (t := _escalates_to(n, table))}
    models = {n: _model(n, t, bases, root, where, is_target=n in targets) for n, t in tables.items()}
    _check_escalation_targets(models, where)
    if file.stop_strings is None:
        return ModelsConfig(path=path, bases=bases, models=models)
    stops = tuple(file.stop_strings)
    return ModelsConfig(path=path, bases=bases, models=models, stop_strings=stops, stop_strings_set=True)


def _bases(file: ConfigFile, root: Path, where: str) -> dict[str, BaseSpec]:
    tables = dict(file.bases)
    if file.base is not None:
        if DEFAULT_BASE in tables:
            raise ConfigError(f"{where}: [base] and [bases.{DEFAULT_BASE}] are the same base: keep one")
        tables[DEFAULT_BASE] = file.base
    if not tables:
        raise ConfigError(f"{where}: the config needs a [base] table (or [bases.NAME] tables)")
    return {
        name: BaseSpec(
            name=name,
            path=(root / t.path).resolve(),
            quantization=t.quantization,
            compute_dtype=t.compute_dtype,
            double_quant=t.double_quant,
        )
        for name, t in tables.items()
    }


def _escalates_to(name: str, table: ModelTable) -> str | None:
    return table.escalates_to if "escalates_to" in table.model_fields_set else defaults_for(name).escalates_to


def _model(
    name: str, table: ModelTable, bases: dict[str, BaseSpec], root: Path, where: str, *, is_target: bool
) -> ModelSpec:
    defaults = defaults_for(name)
    base = table.base or (DEFAULT_BASE if DEFAULT_BASE in bases else next(iter(bases)))
    if table.base is None and DEFAULT_BASE not in bases and len(bases) > 1:
        raise ConfigError(f"{where}: [models.{name}] base: several bases ({', '.join(bases)}), so name one")
    if base not in bases:
        raise ConfigError(f"{where}: [models.{name}] names base {base!r}; defined: {', '.join(bases)}")
    escalates_to = _escalates_to(name, table)
    if table.escalation is not None and not escalates_to:
        raise ConfigError(f"{where}: [models.{name}.escalation]: this model has no escalates_to")
    # A model that others escalate to sees their answer in its follow-up prompt.
    followup = table.followup_template or (DEFAULT_FOLLOWUP_TEMPLATE if is_target else None)
    return ModelSpec(
        name=name,
        base=base,
        adapter=(root / table.adapter).resolve() if table.adapter else None,
        template=table.template or DEFAULT_TEMPLATE,
        followup_template=followup,
        system=table.system if table.system is not None else defaults.system,
        max_input_tokens=table.max_input_tokens,
        max_new_tokens=table.max_new_tokens or defaults.max_new_tokens,
        decision_prefix=table.decision_prefix,
        escalation=_escalation(table.escalation) if escalates_to else None,
        escalates_to=escalates_to or None,
        job_may_set_system=table.job_may_set_system,
        calibration=Calibration.from_table(table.calibration, f"{where}: [models.{name}.calibration]")
        if table.calibration is not None
        else None,
    )


def _check_escalation_targets(models: dict[str, ModelSpec], where: str) -> None:
    for spec in models.values():
        target = spec.escalates_to
        if target is None:
            continue
        if target not in models or target == spec.name:
            raise ConfigError(f"{where}: [models.{spec.name}] escalates_to = {target!r}: not another configured model")
        if models[target].escalates_to is not None:
            raise ConfigError(
                f"{where}: [models.{spec.name}] escalates_to = {target!r}, which escalates itself: one step only"
            )


def _escalation(table: EscalationTable | None) -> EscalationRule:
    table = table or EscalationTable()
    return EscalationRule(
        enabled=table.enabled,
        threshold=table.threshold,
        phrases=tuple(table.phrases) if table.phrases is not None else DEFAULT_UNSURE_PHRASES,
        max_chars=table.max_chars,
    )


def check_files(config: ModelsConfig) -> None:
    """Refuse to start on a missing base or adapter path, naming it."""
    for base in config.bases.values():
        if not (base.path / "config.json").is_file():
            raise ConfigError(f"base {base.name!r}: no checkpoint at {base.path} (config.json missing)")
    for model in config.models.values():
        if model.adapter is not None and not (model.adapter / "adapter_config.json").is_file():
            raise ConfigError(f"model {model.name!r}: no PEFT adapter at {model.adapter} (adapter_config.json missing)")
