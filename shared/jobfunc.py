"""The only job function names the worker will run. Producers enqueue by name; nothing is imported."""

from __future__ import annotations

from shared.errors import NotAllowedError

RUN_DECISION = "worker.jobs.run_decision"
ALLOWED_FUNCS: frozenset[str] = frozenset({RUN_DECISION})


def check_allowed(func_name: str | None) -> str:
    """Return `func_name` if it is allowlisted, else raise NotAllowedError naming it."""
    if func_name not in ALLOWED_FUNCS:
        raise NotAllowedError(f"job function {func_name!r} is not allowlisted (allowed: {sorted(ALLOWED_FUNCS)})")
    return func_name
