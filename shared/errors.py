"""One error tree for the whole project; each per-job failure carries a stable `type` string."""

from __future__ import annotations

import sys

# Stable error `type` strings written into results. Clients match on these: never rename one.
INVALID_JOB = "invalid_job"
NOT_ALLOWED = "not_allowed"
BAD_PAYLOAD = "bad_payload"
INPUT_TOO_LONG = "input_too_long"
NON_FINITE_LOGITS = "non_finite_logits"
OUT_OF_MEMORY = "out_of_memory"
TIMEOUT = "timeout"
CANCELLED = "cancelled"
EXPIRED = "expired"
WORKER_DIED = "worker_died"
INTERNAL = "internal"

ERROR_TYPES = (
    INVALID_JOB,
    NOT_ALLOWED,
    BAD_PAYLOAD,
    INPUT_TOO_LONG,
    NON_FINITE_LOGITS,
    OUT_OF_MEMORY,
    TIMEOUT,
    CANCELLED,
    EXPIRED,
    WORKER_DIED,
    INTERNAL,
)


# The most characters of a given value an error message echoes: a megabyte-long field echoed whole filled
# terminals and logs, once per bad line.
SHOWN_CHARS = 80


def shown(value: object) -> str:
    """`repr(value)` for an error message, cut to `SHOWN_CHARS` with the full length named."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's digit limit for str()
        return f"an integer of over {sys.get_int_max_str_digits()} digits"
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


# Exit codes of the `kevlaya` command (README, "Exit codes").
EXIT_OK = 0
EXIT_USAGE = 1  # bad arguments, invalid input, unknown batch, bad config
EXIT_ITEMS_FAILED = 2  # the batch completed, some items ended with an error
EXIT_REDIS = 3  # Redis unreachable, or it refused the credentials
EXIT_INCOMPLETE = 4  # items still pending (a wait timed out, or results exported early)


class KevlayaError(Exception):
    """Base of every error kevlaya raises on purpose."""

    type: str = INTERNAL


class ValidationError(KevlayaError):
    """A job or submission line breaks the contract; names the field (and line, when known)."""

    type = INVALID_JOB

    def __init__(self, message: str, *, field: str | None = None, line: int | None = None) -> None:
        self.field = field
        self.line = line
        super().__init__(message)

    def at_line(self, line: int) -> ValidationError:
        """The same error, tagged with the 1-based input line it came from."""
        return ValidationError(str(self), field=self.field, line=line)

    def __str__(self) -> str:
        text = super().__str__()
        return f"line {self.line}: {text}" if self.line is not None else text


class SubmissionError(KevlayaError):
    """A whole submission was refused; `errors` holds every bad line (nothing was enqueued)."""

    def __init__(self, errors: list[ValidationError]) -> None:
        self.errors = errors
        super().__init__(f"{len(errors)} invalid line(s); nothing enqueued")


class PayloadError(KevlayaError):
    """A job found in Redis cannot be decoded (malformed hash, unknown version, pickled data)."""

    type = BAD_PAYLOAD


class NotAllowedError(PayloadError):
    """A job names a function or callback outside the allowlist."""

    type = NOT_ALLOWED


class ConfigError(KevlayaError):
    """The models config or a setting is invalid; raised before anything is loaded."""


class BatchClosedError(KevlayaError):
    """A submission into a batch that was cancelled or has expired; nothing was written."""


class WorkerNameTakenError(KevlayaError):
    """A live worker is registered under the --name this one was given."""


class WaitTimeoutError(KevlayaError):
    """A wait for a batch ended at its timeout with items still pending."""

    @classmethod
    def for_batch(cls, batch: str, done: int, total: int, timeout_s: float | None) -> WaitTimeoutError:
        return cls(f"batch {batch}: {done}/{total} done after {timeout_s} s; still running")


class StoreError(KevlayaError):
    """Redis failed a call; the message names its URL (no password), the redis-py error is the `__cause__`."""


class RedisUnavailableError(StoreError):
    """Redis cannot be reached, or refused our credentials or permissions."""


class WrongTypeError(KevlayaError):
    """A Redis key kevlaya reads holds another type of value than kevlaya keeps there (some other writer's)."""

    def __init__(self, key: str, expected: str, found: str | None = None) -> None:
        self.key = key
        self.expected = expected
        self.found = found
        held = f"a {found}" if found else "another type of value"
        super().__init__(
            f"Redis key {key!r} holds {held}, not the {expected} kevlaya keeps there (some other program wrote it): "
            f"move it aside (redis-cli RENAME '{key}' '{key}.bad') or delete it, then run the command again"
        )


class RedisCommandError(StoreError):
    """Redis answered a command with an error (out of memory, a read-only replica, a key of another type)."""


class BatchNotFoundError(KevlayaError):
    """No batch with this id exists in Redis (never submitted, or expired)."""


class JobFailure(KevlayaError):
    """One job failed for a known reason; the worker turns it into an error result of this `type`."""

    def __init__(self, error_type: str, message: str) -> None:
        self.type = error_type
        super().__init__(message)
