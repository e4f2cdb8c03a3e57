"""Opening the Redis connection both sides use (URL from the caller or REDIS_URL)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

from redis import Redis
from redis import exceptions as redis_exceptions

from shared.errors import ConfigError

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_url(url: str | None = None) -> str:
    """The URL to use: explicit, else $REDIS_URL, else localhost. Supports redis://, rediss://, auth, db."""
    return url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


SCHEMES = ("redis", "rediss", "unix")


def check_url(url: str) -> str:
    """The URL if it is one redis-py reads as meant; else ConfigError naming what is wrong (redis-py itself
    would take `redis://host/notadb` as database 0)."""
    parts = urlsplit(url)
    shape = "expected redis://[user:pass@]host:port/db"
    if parts.scheme not in SCHEMES:
        raise ConfigError(f"bad Redis URL {redacted(url)!r}: no redis://, rediss:// or unix:// scheme; {shape}")
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise ConfigError(f"bad Redis URL {redacted(url)!r}: database {db!r} is not a number; {shape}")
    try:
        parts.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL {redacted(url)!r}: {exc}; {shape}") from exc
    return url


def connect(url: str | None = None, *, socket_timeout_s: float | None = 30.0) -> Redis:
    return Redis.from_url(
        check_url(redis_url(url)),
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=5.0,
        health_check_interval=15,
    )


def redacted(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redis_problem(exc: redis_exceptions.RedisError, url: str | None = None) -> str:
    """One line naming what went wrong with Redis and what to do about it."""
    where = redacted(redis_url(url))
    if isinstance(exc, redis_exceptions.AuthenticationError):
        return f"Redis at {where} refused the credentials ({exc}); check the user and password in the URL"
    if isinstance(exc, redis_exceptions.NoPermissionError):
        return f"Redis at {where} refused a command for this user ({exc}); check its ACL (README, Security)"
    if isinstance(exc, (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError)):
        return f"cannot reach Redis at {where} ({exc}); is it running? set --redis-url or REDIS_URL"
    return f"Redis at {where} answered with an error: {exc}"
