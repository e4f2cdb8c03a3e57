"""The models config's file format as typed records (pydantic): every table and key known, every value of
its type, every refusal one line naming the file, the table, the key and -- for a typo -- a suggestion."""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic import ValidationError as PydanticError

from shared.errors import ConfigError
from shared.job import DEFAULT_LIMITS

# A string that must say something: an empty phrase is in every text, an empty path is the config's folder.
NonEmpty = Annotated[str, Field(min_length=1)]


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class BaseTable(_Table):
    path: str
    quantization: Literal["nf4", "fp4", "none"] = "nf4"
    compute_dtype: Literal["float16", "bfloat16", "float32"] = "bfloat16"
    double_quant: bool = True


class EscalationTable(_Table):
    enabled: bool = True
    threshold: float = Field(0.7, ge=0.0, le=1.0)
    phrases: list[NonEmpty] | None = None
    max_chars: int = Field(400, ge=1)


class ModelTable(_Table):
    base: str | None = None
    adapter: NonEmpty | None = None
    template: str | None = None
    followup_template: str | None = None
    system: str | None = None
    max_input_tokens: int = Field(1024, ge=1)
    max_new_tokens: int | None = Field(None, ge=1, le=DEFAULT_LIMITS.max_new_tokens)  # no job may ask for more
    decision_prefix: str | None = "Decision:"
    escalates_to: str | None = None
    escalation: EscalationTable | None = None
    job_may_set_system: bool = False
    calibration: dict[str, Any] | None = None  # checked by worker.calibration.Calibration.from_table


class ConfigFile(_Table):
    base: BaseTable | None = None
    bases: dict[str, BaseTable] = Field(default_factory=dict)
    models: dict[str, ModelTable] = Field(default_factory=dict)
    stop_strings: list[NonEmpty] | None = None


def parse_file(raw: dict[str, Any], *, where: str) -> ConfigFile:
    """The validated file, or ConfigError with one line per problem."""
    try:
        return ConfigFile.model_validate(raw)
    except PydanticError as exc:
        problems = [_describe(err, raw) for err in exc.errors()]
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None


def _describe(err: Any, raw: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    table = _table_name(loc[:-1])
    key = loc[-1] if loc else ""
    if err["type"] == "extra_forbidden":
        allowed = list(_fields_at(loc[:-1]))
        hint = difflib.get_close_matches(key, allowed, n=1)
        suggestion = f" (did you mean {hint[0]!r}?)" if hint else f"; allowed: {', '.join(allowed)}"
        return f"{table} unknown key {key!r}{suggestion}"
    if err["type"] == "missing":
        return f"{table} missing key {key!r}"
    value = _value_at(raw, err["loc"])
    return f"{table} {key} = {value!r}: {err['msg'].lower()}"


def _table_name(loc: list[str]) -> str:
    return "[" + ".".join(loc) + "]" if loc else "top level:"


def _fields_at(loc: list[str]) -> list[str]:
    """The keys a table at this location may hold."""
    model: type[BaseModel] = ConfigFile
    for part in loc:
        if model is ConfigFile and part in ("models", "bases"):
            continue
        field = model.model_fields.get(part)
        if field is not None:
            inner = [a for a in getattr(field.annotation, "__args__", (field.annotation,)) if isinstance(a, type)]
            model = next((a for a in inner if issubclass(a, BaseModel)), model)
        elif model is ConfigFile:
            model = ModelTable if "models" in loc else BaseTable
    return list(model.model_fields)


def _value_at(raw: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        if (isinstance(raw, dict) and part in raw) or (
            isinstance(raw, list) and isinstance(part, int) and part < len(raw)
        ):
            raw = raw[part]
        else:
            return None
    return raw
