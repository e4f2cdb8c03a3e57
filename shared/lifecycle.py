"""A batch's status word, OpenAI Batch style, derived from its record (a pure function).

validating -> in_progress -> finalizing -> completed | failed;  cancelling -> cancelled;  expired.
- validating: a submit is still writing it;
- in_progress: items are queued or running;
- finalizing: every item has an answer but escalated ones still wait for their follow-up;
- completed: every item has its final answer or error; failed: every item ended with an error;
- cancelling / cancelled: a cancel was asked; items still running finish;
- expired: its completion window ended with items unanswered (they end as `expired`, never run).
"""

from __future__ import annotations

from typing import Any

STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired")


def batch_status(record: Any, now: float) -> str:
    c = record.counts
    complete = c.done >= c.total and not record.submitting
    if record.cancel_requested:
        return "cancelled" if complete else "cancelling"
    if complete:
        if c.expired:
            return "expired"
        return "failed" if c.total and c.finished == 0 else "completed"
    if record.window_ends_at is not None and now > record.window_ends_at:
        return "expired"
    if record.submitting:
        return "validating"
    if c.done + c.awaiting_followups >= c.total:
        return "finalizing"
    return "in_progress"
