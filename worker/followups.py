"""Escalation as data: whether an answer escalates, and the follow-up job it becomes (pure functions)."""

from __future__ import annotations

from dataclasses import replace

from shared.enqueue import Entry
from shared.job import Job, Parent
from shared.keys import followup_id
from shared.result import Result
from worker.config import ModelSpec
from worker.escalation import escalation_reason


def escalates(spec: ModelSpec, job: Job, result: Result, *, batch_off: bool) -> str | None:
    """The model this answer escalates to, or None (no target, an error, the rule says no)."""
    if spec.escalates_to is None or result.error is not None:
        return None
    reason = escalation_reason(
        spec.escalation,
        text=result.text or "",
        confidence=result.confidence,
        job_setting=job.escalate,
        batch_off=batch_off,
    )
    return None if reason is None else spec.escalates_to


def follow_up(job: Job, result: Result, target: str) -> Entry:
    """The follow-up for an escalated answer: the same input, the parent's answer attached, the target's
    own limits, and a deterministic id so a retried parent never creates a second one."""
    parent = Parent(
        job_id=result.job_id,
        model=job.model,
        text=result.text or "",
        decision=result.decision,
        confidence=result.confidence,
    )
    follow = replace(job, model=target, parent=parent, max_new_tokens=None, escalate=None)
    return Entry(followup_id(result.job_id, target), follow)


def prompt_chars(job: Job) -> int:
    """Characters of what a job's prompt is rendered from: its prompt or input fields, and its parent's answer."""
    fields = sum(len(k) + len(v) for k, v in (job.input or {}).items())
    return len(job.prompt or "") + fields + len(job.parent.text if job.parent else "")
