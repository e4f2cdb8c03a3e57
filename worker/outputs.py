"""What the engine answers for one row: a plain value, index-aligned with the jobs it was given."""

from __future__ import annotations

from dataclasses import dataclass

from shared.result import ErrorInfo


@dataclass(frozen=True, kw_only=True)
class RowOutput:
    text: str | None = None
    decision: str | None = None
    confidence: float | None = None
    raw_confidence: float | None = None  # the model's own, when `confidence` was calibrated (worker/calibration.py)
    choices: dict[str, float] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: ErrorInfo | None = None

    @classmethod
    def failed(cls, error_type: str, message: str, prompt_tokens: int = 0) -> RowOutput:
        return cls(error=ErrorInfo(type=error_type, message=message), prompt_tokens=prompt_tokens)
