"""A batch's status word, OpenAI Batch style, derived from its record (a pure function).

validating -> in_progress -> finalizing -> completed | failed;  cancelling -> cancelled;  expired.
- validating: a submit is still writing it;
- in_progress: items are queued or running;
- finalizing: every item has an answer but escalated ones still wait for their follow-up;
- completed: every item has its final answer or error; failed: every item ended with an error;
- cancelling / cancelled: a cancel was asked; items still running finish;
- expired: its completion window ended with items unanswered (queued ones end as `expired`, never run; running
  ones finish, and the batch stays expired).
"""

from __future__ import annotations

from typing import Any

STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled", "expired")


def batch_status(record: Any, now: float) -> str:
    c = record.counts
    complete = c.done >= c.total and not record.submitting
    if record.cancel_requested:
        return "cancelled" if complete else "cancelling"
    ended = record.window_ends_at is not None
    if complete:
        # Once shown `expired` (the window ended with items unanswered), a batch stays expired: its last items
        # finishing after the window must not turn a terminal word into `completed`.
        last = record.last_done_at
        if c.expired or (ended and last is not None and last > record.window_ends_at):
            return "expired"
        return "failed" if c.total and c.finished == 0 else "completed"
    if ended and now > record.window_ends_at:
        return "expired"
    if record.submitting:
        return "validating"
    if c.done + c.awaiting_followups >= c.total:
        return "finalizing"
    return "in_progress"
