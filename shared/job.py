"""The versioned job payload: a frozen dataclass that validates, encodes and decodes itself."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import orjson

from shared import SCHEMA_VERSION
from shared import models as known_models
from shared.errors import ValidationError, shown
from shared.keys import BULK, LANES, QueueRef
from shared.records import field_items

KIB = 1024


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Size limits enforced at validation time (producer) and again at decode time (worker)."""

    max_prompt_bytes: int = 64 * KIB
    max_new_tokens: int = 4096
    max_choices: int = 32
    max_choice_bytes: int = 1 * KIB
    max_custom_id_chars: int = 256
    max_meta_bytes: int = 16 * KIB
    # The payload wraps meta in a few more levels, and JSON encoders stop at ~255.
    max_meta_depth: int = 64


DEFAULT_LIMITS = Limits()

# Fields a user may write. `parent` and `batch` are set by kevlaya itself.
USER_FIELDS = frozenset(
    {
        "v",
        "custom_id",
        "model",
        "prompt",
        "input",
        "choices",
        "max_new_tokens",
        "escalate",
        "truncate",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "logprobs",
        "top_logprobs",
        "meta",
        "lane",
    }
)
MAX_TOP_LOGPROBS = 5
SYSTEM_FIELDS = frozenset({"parent", "batch"})


@dataclass(frozen=True, kw_only=True)
class Parent:
    """The Laya answer a Kev follow-up escalates from (data in the message, not code)."""

    job_id: str
    model: str
    text: str
    decision: str | None
    confidence: float | None


@dataclass(frozen=True, kw_only=True)
class Job:
    """One decision request. `prompt` or `input` (fields rendered by the model's template) is required.

    escalate: None = the model's rule, False = never, a float in (0, 1] = escalate below that confidence.
    lane: `interactive` or `bulk`; None until a submit call gives it its default (a queued job always has one;
    one queued by a kevlaya before lanes reads as bulk). Follow-ups inherit it.
    """

    custom_id: str
    model: str
    prompt: str | None = None
    input: dict[str, str] | None = None
    choices: tuple[str, ...] | None = None
    max_new_tokens: int | None = None
    escalate: bool | float | None = None
    truncate: bool = False
    temperature: float = 0.0
    top_p: float = 1.0  # with temperature > 0: sample from the smallest set of tokens reaching this probability
    top_k: int = 0  # with temperature > 0: sample from the k most likely tokens (0: no cut)
    seed: int | None = None
    logprobs: bool = False  # each generated token's log-probability in the result (OpenAI-shaped)
    top_logprobs: int = 0  # with logprobs: also the this-many most likely tokens at each position (0-5)
    meta: Any = None
    batch: str | None = None
    parent: Parent | None = None
    lane: str | None = None
    v: int = SCHEMA_VERSION

    @property
    def queue(self) -> QueueRef:
        """The RQ queue this job goes to: its model's lane."""
        return QueueRef(self.model, self.lane or BULK)

    @property
    def scores_choices(self) -> bool:
        """Whether the model answers by scoring `choices`. A choice job's own model does; its escalated
        follow-up generates instead -- the model escalated to digs deeper by writing its answer out -- and
        that answer's decision is then read as one of the labels."""
        return bool(self.choices) and self.parent is None

    # ---- encoding -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready payload, without fields left at their empty defaults."""
        out: dict[str, Any] = {}
        for key, value in field_items(self):
            if value is None or (key in ("truncate", "logprobs") and value is False):
                continue
            if (key, value) in (("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("top_logprobs", 0)):
                continue
            out[key] = list(value) if key == "choices" else value
        return out

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes | str, *, limits: Limits = DEFAULT_LIMITS) -> Job:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise ValidationError(f"invalid JSON: {exc}") from exc
        return cls.from_dict(obj, limits=limits, allow_system=True)

    @classmethod
    def from_dict(
        cls,
        obj: Any,
        *,
        limits: Limits = DEFAULT_LIMITS,
        default_model: str | None = None,
        allow_system: bool = False,
    ) -> Job:
        """Validate a decoded JSON object; every refusal names the field it is about."""
        if not isinstance(obj, dict):
            raise ValidationError(f"a job must be a JSON object, got {type(obj).__name__}")
        allowed = USER_FIELDS | SYSTEM_FIELDS if allow_system else USER_FIELDS
        unknown = sorted(set(obj) - allowed)
        if unknown:
            raise ValidationError(
                f"unknown field(s) {', '.join(map(shown, unknown))}; allowed: {', '.join(sorted(allowed))}",
                field=unknown[0],
            )
        version = obj.get("v", SCHEMA_VERSION)
        if not _int(version) or version != SCHEMA_VERSION:  # `true` and `1.0` equal 1 in Python
            raise ValidationError(
                f"unsupported schema version v={shown(version)} (this kevlaya speaks v={SCHEMA_VERSION})", field="v"
            )
        prompt, input_fields = _prompt_and_input(obj, limits)
        logprobs, top_logprobs = _logprobs(obj)
        job = cls(
            custom_id=_custom_id(obj.get("custom_id"), limits),
            model=_model(obj.get("model", default_model)),
            prompt=prompt,
            input=input_fields,
            choices=_choices(obj.get("choices"), limits),
            max_new_tokens=_max_new_tokens(obj.get("max_new_tokens"), limits),
            escalate=_escalate(obj.get("escalate")),
            truncate=_bool(obj.get("truncate", False), "truncate"),
            temperature=_temperature(obj.get("temperature", 0.0)),
            top_p=_top_p(obj.get("top_p", 1.0)),
            top_k=_top_k(obj.get("top_k", 0)),
            seed=_seed(obj.get("seed")),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            meta=_meta(obj.get("meta"), limits),
            batch=_optional_str(obj.get("batch"), "batch"),
            parent=_parent(obj.get("parent")),
            lane=_lane(obj.get("lane")),
        )
        _VALIDATED[id(job), limits] = job
        return job

    def validated_under(self, limits: Limits) -> bool:
        """Whether `from_dict` made this very Job under `limits`: frozen, it is still valid there. A Job built by
        hand or by `dataclasses.replace` is not known, and a submit checks it like a dict."""
        return _VALIDATED.get((id(self), limits)) is self


# The Jobs `from_dict` made, by identity and the limits they met; an entry goes with its Job.
_VALIDATED: weakref.WeakValueDictionary[tuple[int, Limits], Job] = weakref.WeakValueDictionary()


# ---- field validators (each raises ValidationError naming its field) ---------------------------
def _custom_id(value: Any, limits: Limits) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationError("'custom_id' must be a non-empty string", field="custom_id")
    _utf8(value, "custom_id")
    if len(value) > limits.max_custom_id_chars:
        raise ValidationError(
            f"'custom_id' is {len(value)} characters; the limit is {limits.max_custom_id_chars}", field="custom_id"
        )
    return value


def _model(value: Any) -> str:
    if value is None:
        raise ValidationError(
            f"missing 'model' (one of: {', '.join(known_models.MODEL_NAMES)}; or pass a default model)",
            field="model",
        )
    names = known_models.MODEL_NAMES
    if value not in names:
        raise ValidationError(f"unknown model {shown(value)}; allowed: {', '.join(names)}", field="model")
    return value


def _prompt_and_input(obj: dict[str, Any], limits: Limits) -> tuple[str | None, dict[str, str] | None]:
    prompt, fields = obj.get("prompt"), obj.get("input")
    if prompt is None and fields is None:
        raise ValidationError("missing 'prompt' (or 'input' fields for the model's template)", field="prompt")
    if prompt is not None and fields is not None:
        raise ValidationError("give 'prompt' or 'input', not both", field="input")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValidationError(f"'prompt' must be a string, got {type(prompt).__name__}", field="prompt")
        _check_size(prompt, limits.max_prompt_bytes, "prompt")
        return prompt, None
    if not isinstance(fields, dict) or not fields:
        raise ValidationError("'input' must be a non-empty object of string fields", field="input")
    for name, value in fields.items():
        if not isinstance(name, str):  # possible from Python, never from JSON
            raise ValidationError(f"'input' field names must be strings, got {shown(name)}", field="input")
        if not isinstance(value, str):
            raise ValidationError(f"'input.{name}' must be a string, got {type(value).__name__}", field="input")
    # The names count too: they are rendered into the prompt ("name: value" lines) and stored in every payload, and a
    # 100 KB name, or 20,000 empty fields, passed a limit that counted the values alone.
    _check_size("".join(name + value for name, value in fields.items()), limits.max_prompt_bytes, "input")
    return None, dict(fields)


def _utf8(text: str, name: str) -> bytes:
    """The text as UTF-8; a string that has none (a lone surrogate, possible from Python, never from JSON) is
    refused here, naming its field, rather than by the encoder after the batch's first write."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(
            f"'{name}' is not valid UTF-8 text (lone surrogate {text[exc.start]!r} at {exc.start})", field=name
        ) from None


def _check_size(text: str, limit: int, name: str) -> None:
    size = len(_utf8(text, name))
    if size > limit:
        raise ValidationError(f"'{name}' is {size} bytes; the limit is {limit} bytes", field=name)


def _choices(value: Any, limits: Limits) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ValidationError("'choices' must be a non-empty list of strings", field="choices")
    if len(value) > limits.max_choices:
        raise ValidationError(f"'choices' has {len(value)} entries; the limit is {limits.max_choices}", field="choices")
    seen: set[str] = set()
    for choice in value:
        if not isinstance(choice, str) or not choice:
            raise ValidationError("every entry of 'choices' must be a non-empty string", field="choices")
        _check_size(choice, limits.max_choice_bytes, "choices")
        if choice in seen:
            raise ValidationError(f"duplicate choice {shown(choice)} in 'choices'", field="choices")
        seen.add(choice)
    return tuple(value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _max_new_tokens(value: Any, limits: Limits) -> int | None:
    if value is None:
        return None
    if not _int(value) or not 1 <= value <= limits.max_new_tokens:
        raise ValidationError(
            f"'max_new_tokens' must be an integer from 1 to {limits.max_new_tokens}, got {shown(value)}",
            field="max_new_tokens",
        )
    return value


def _escalate(value: Any) -> bool | float | None:
    if value is None or isinstance(value, bool):
        return value
    # Compared before float(): an integer too large for a float (from Python) raised OverflowError there.
    if isinstance(value, (int, float)) and 0 < value <= 1:
        return float(value)
    raise ValidationError(
        f"'escalate' must be true, false or a confidence threshold in (0, 1], got {shown(value)}", field="escalate"
    )


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(f"'{name}' must be true or false, got {shown(value)}", field=name)
    return value


def _temperature(value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0.0 <= value <= 5.0):
        raise ValidationError(f"'temperature' must be a number from 0 to 5, got {shown(value)}", field="temperature")
    if not math.isfinite(value):
        raise ValidationError("'temperature' must be finite", field="temperature")
    return float(value)


def _top_p(value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (0.0 < value <= 1.0):
        raise ValidationError(f"'top_p' must be a number in (0, 1], got {shown(value)}", field="top_p")
    return float(value)


def _top_k(value: Any) -> int:
    if not _int(value) or not 0 <= value <= 1_000_000:
        raise ValidationError(
            f"'top_k' must be an integer from 0 (no cut) to 1000000, got {shown(value)}", field="top_k"
        )
    return value


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if not _int(value) or not 0 <= value < 2**63:
        raise ValidationError(f"'seed' must be a non-negative integer, got {shown(value)}", field="seed")
    return value


def _logprobs(obj: dict[str, Any]) -> tuple[bool, int]:
    """(`logprobs`, `top_logprobs`): `top_logprobs` only with `"logprobs": true`, and only for generated answers."""
    logprobs = _bool(obj.get("logprobs", False), "logprobs")
    top = obj.get("top_logprobs")
    if top is not None and (not _int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise ValidationError(
            f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {shown(top)}", field="top_logprobs"
        )
    if top is not None and not logprobs:
        raise ValidationError("'top_logprobs' needs \"logprobs\": true", field="top_logprobs")
    if logprobs and obj.get("choices") is not None:
        raise ValidationError(
            "'logprobs' is for generated answers; a 'choices' job already returns each choice's probability",
            field="logprobs",
        )
    return logprobs, top or 0


def _meta(value: Any, limits: Limits) -> Any:
    if value is None:
        return None
    depth = _depth(value)
    if depth > limits.max_meta_depth:
        raise ValidationError(f"'meta' nests {depth} levels deep; the limit is {limits.max_meta_depth}", field="meta")
    try:
        size = len(orjson.dumps(value))
    except orjson.JSONEncodeError as exc:
        raise ValidationError(f"'meta' is not JSON: {exc}", field="meta") from exc
    if size > limits.max_meta_bytes:
        raise ValidationError(f"'meta' is {size} bytes of JSON; the limit is {limits.max_meta_bytes}", field="meta")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of lists and objects, without recursion (a hostile value can nest thousands deep); refuses
    NaN and infinities, which are not JSON."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            if isinstance(node, float) and not math.isfinite(node):  # orjson would write it as null
                raise ValidationError(f"'meta' holds {shown(node)}, which is not JSON", field="meta")
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _lane(value: Any) -> str | None:
    if value is not None and value not in LANES:
        raise ValidationError(f"unknown lane {shown(value)}; allowed: {', '.join(LANES)}", field="lane")
    return value


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValidationError(f"'{name}' must be a string", field=name)
    return value


def _parent(value: Any) -> Parent | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"job_id", "model", "text", "decision", "confidence"}:
        raise ValidationError("'parent' is malformed", field="parent")
    strings = all(isinstance(value[k], str) for k in ("job_id", "model", "text"))
    decision_ok = value["decision"] is None or isinstance(value["decision"], str)
    conf = value["confidence"]
    conf_ok = conf is None or (isinstance(conf, (int, float)) and not isinstance(conf, bool) and math.isfinite(conf))
    if not (strings and decision_ok and conf_ok):
        raise ValidationError("'parent' has fields of the wrong type", field="parent")
    return Parent(**value)
