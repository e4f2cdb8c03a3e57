"""The result of one job: an answer or a clear error. Frozen, self-encoding, versioned like the job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from shared import SCHEMA_VERSION
from shared.records import field_items


@dataclass(frozen=True, kw_only=True)
class ErrorInfo:
    """`type` is one of shared.errors.ERROR_TYPES; `message` is for humans."""

    type: str
    message: str


@dataclass(frozen=True, kw_only=True)
class TopLogprob:
    """One of the most likely tokens at a position (OpenAI's `top_logprobs` entry)."""

    token: str  # its text; bytes that are not whole UTF-8 characters appear as \xNN escapes
    logprob: float
    bytes: list[int] | None = None  # its UTF-8 bytes


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """One generated token (OpenAI's `choices[].logprobs.content` entry): its log-probability under the model's
    own distribution (before temperature, top-p and top-k) and, when asked, the most likely tokens there."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> TokenLogprob:
        top = [TopLogprob(**t) for t in obj.get("top_logprobs") or ()]
        return cls(**{**obj, "top_logprobs": top})


@dataclass(frozen=True, kw_only=True)
class Result:
    """What the worker writes back for one job.

    confidence: for generation, the probability the model gave the decision span it emitted
    (product of those tokens' probabilities); for choices, the normalised probability of the argmax;
    calibrated when the models config calibrates the model (`kevlaya calibrate`), the model's own then
    under raw_confidence.
    final: True when this is the item's final answer (False for a Laya answer that escalated).
    not_escalated: set when an escalated answer became final because its follow-up was cancelled ("cancelled") or
    its batch's completion window ended before the follow-up ran ("expired").
    """

    custom_id: str
    model: str
    job_id: str
    batch: str | None = None
    text: str | None = None
    decision: str | None = None
    confidence: float | None = None
    raw_confidence: float | None = None
    choices: dict[str, float] | None = None
    logprobs: list[TokenLogprob] | None = None  # per generated token, when the job asked (`logprobs: true`)
    usage: dict[str, int] = field(default_factory=dict)
    max_new_tokens: int | None = None  # the generation limit that applied (a follow-up: its own model's)
    truncated: bool | None = None  # True: the answer ended at that limit, not at a stop token (finish "length")
    escalated_to: str | None = None
    escalated_from: str | None = None
    final: bool = True
    not_escalated: str | None = None  # why an answer that escalated ended final after all ("cancelled", "expired")
    timing: dict[str, float] = field(default_factory=dict)
    model_version: dict[str, str] = field(default_factory=dict)
    meta: Any = None
    error: ErrorInfo | None = None
    v: int = SCHEMA_VERSION

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in field_items(self) if v is not None}

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Result:
        data = dict(obj)
        if isinstance(data.get("error"), dict):
            data["error"] = ErrorInfo(**data["error"])
        if isinstance(data.get("logprobs"), list):
            data["logprobs"] = [TokenLogprob.from_dict(t) for t in data["logprobs"]]
        return cls(**data)

    @classmethod
    def from_json(cls, data: bytes | str) -> Result:
        return cls.from_dict(orjson.loads(data))

    @classmethod
    def failure(
        cls,
        *,
        custom_id: str,
        model: str,
        job_id: str,
        batch: str | None,
        error_type: str,
        message: str,
        meta: Any = None,
    ) -> Result:
        return cls(
            custom_id=custom_id,
            model=model,
            job_id=job_id,
            batch=batch,
            meta=meta,
            error=ErrorInfo(type=error_type, message=message),
        )
