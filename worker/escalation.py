"""When a Laya answer is unsure enough to ask Kev: a pure rule over the answer and the job's setting."""

from __future__ import annotations

from worker.config import EscalationRule


def escalation_reason(
    rule: EscalationRule | None,
    *,
    text: str,
    confidence: float | None,
    job_setting: bool | float | None,
    batch_off: bool,
) -> str | None:
    """Why this answer escalates, or None. A job's float setting overrides the rule's threshold."""
    if rule is None or not rule.enabled or batch_off or job_setting is False:
        return None
    threshold = job_setting if isinstance(job_setting, float) else rule.threshold
    if confidence is None and threshold > 0:
        # No decision span at all (a row that stopped at once): the least sure answer there is. `kevlaya eval`
        # counts it as confidence 0 (worker.tools.evaluate), so the worker must escalate it too.
        return f"no confidence (empty answer) < {threshold}"
    if confidence is not None and confidence < threshold:
        return f"confidence {confidence:.3f} < {threshold}"
    lowered = text.lower()
    for phrase in rule.phrases:
        if phrase.lower() in lowered:
            return f"unsure phrase {phrase!r}"
    if len(text) > rule.max_chars:
        return f"answer longer than {rule.max_chars} characters"
    return None
