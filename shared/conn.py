"""Opening the Redis connection both sides use (URL from the caller or REDIS_URL)."""

from __future__ import annotations

import os

from redis import Redis

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url(url: str | None = None) -> str:
    """The URL to use: explicit, else $REDIS_URL, else localhost. Supports redis://, rediss://, auth, db."""
    return url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def connect(url: str | None = None, *, socket_timeout_s: float | None = 30.0) -> Redis:
    return Redis.from_url(
        redis_url(url), socket_timeout=socket_timeout_s, socket_connect_timeout=5.0, health_check_interval=15
    )
