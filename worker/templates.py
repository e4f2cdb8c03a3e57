"""Rendering a model's prompt template into literal and user segments.

Literal segments are ours and may contain control tokens (`<|im_start|>`); user segments are tokenised
with special-token parsing off, so a user who writes `<|im_end|>` gets those characters, not the token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shared.errors import INVALID_JOB, JobFailure
from shared.job import Job

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Segment:
    text: str
    user: bool


def render(template: str, job: Job, *, system: str) -> list[Segment]:
    """Fill `{prompt}`, `{system}`, `input` fields and `{laya_*}` (follow-ups); `{{`/`}}` escape braces."""
    values = _values(job, system)
    segments: list[Segment] = []
    pos = 0
    for match in _PLACEHOLDER.finditer(template):
        _append(segments, template[pos : match.start()], user=False)
        token = match.group(0)
        if token in ("{{", "}}"):
            _append(segments, token[0], user=False)
        else:
            name = match.group(1)
            if name not in values:
                raise JobFailure(INVALID_JOB, f"the template needs field {name!r}, which this job does not give")
            # Our own system text is trusted; everything that came with the job is user text.
            _append(segments, values[name], user=name != "system")
        pos = match.end()
    _append(segments, template[pos:], user=False)
    return segments


def _values(job: Job, system: str) -> dict[str, str]:
    values = {"system": system}
    if job.prompt is not None:
        values["prompt"] = job.prompt
    if job.input:
        values.update(job.input)
        values.setdefault("prompt", "\n".join(f"{k}: {v}" for k, v in job.input.items()))
    if job.parent is not None:
        values["laya_answer"] = job.parent.text
        values["laya_decision"] = job.parent.decision or ""
        conf = job.parent.confidence
        values["laya_confidence"] = "unknown" if conf is None else f"{conf:.2f}"
    return values


def _append(segments: list[Segment], text: str, *, user: bool) -> None:
    if not text:
        return
    if segments and segments[-1].user == user:
        segments[-1] = Segment(segments[-1].text + text, user)
    else:
        segments.append(Segment(text, user))


def prompt_pieces(tokenizer: Any, spec: Any, job: Job) -> list[tuple[list[int], bool]]:
    """The model's prompt for a job as (token ids, is_user_text) pieces -- the one path used for both
    inference and training, so an adapter is trained on exactly the prompts it will serve."""
    template = spec.followup_template if (job.parent is not None and spec.followup_template) else spec.template
    return [
        (tokenizer(seg.text, add_special_tokens=False, split_special_tokens=seg.user).input_ids, seg.user)
        for seg in render(template, job, system=spec.system)
    ]
