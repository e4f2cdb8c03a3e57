"""Opening the Redis connection both sides use (URL from the caller or REDIS_URL), plain or through Sentinel.

A Sentinel URL names the sentinels and the service they watch; redis-py's own `redis.sentinel.Sentinel`
finds the primary (`master_for`) and finds it again after a failover, and RQ runs over the client it returns:

    redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db]

The user and password are the data nodes' (primary and replicas); the sentinels themselves are asked
without a password. Redis Cluster is not supported (RQ does not support it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from redis import Redis
from redis import exceptions as redis_exceptions
from redis.asyncio import Redis as AsyncRedis
from redis.asyncio import connection as async_connection
from redis.connection import Connection as PlainConnection
from redis.connection import ConnectionPool, SSLConnection, UnixDomainSocketConnection

from shared.errors import ConfigError, RedisCommandError, RedisUnavailableError, StoreError
from shared.wrongtype import is_wrong_type, key_named

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SENTINEL_SCHEME = "redis+sentinel"
SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)
SHAPE = "expected redis://[user:pass@]host:port/db or redis+sentinel://[user:pass@]host:port[,host:port]/service[/db]"
CONNECT_TIMEOUT_S = 5.0


def redis_url(url: str | None = None) -> str:
    """The URL to use: explicit, else $REDIS_URL, else localhost. Supports redis://, rediss://, unix://, auth,
    db, and redis+sentinel://."""
    return url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


@dataclass(frozen=True)
class SentinelTarget:
    """What a redis+sentinel:// URL names."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def check_url(url: str) -> str:
    """The URL if it is one redis-py reads as meant; else ConfigError naming what is wrong (redis-py itself
    would take `redis://host/notadb` as database 0)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ConfigError(
            f"bad Redis URL {redacted(url)!r}: no redis://, rediss://, unix:// or {SENTINEL_SCHEME}:// scheme; {SHAPE}"
        )
    if parts.scheme == SENTINEL_SCHEME:
        sentinel_target(url)
        return url
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise ConfigError(f"bad Redis URL {redacted(url)!r}: database {db!r} is not a number; {SHAPE}")
    try:
        parts.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL {redacted(url)!r}: {exc}; {SHAPE}") from exc
    return url


def sentinel_target(url: str) -> SentinelTarget:
    """The sentinels, service, db and credentials of a redis+sentinel:// URL (ConfigError if malformed)."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")

    def bad(why: str) -> ConfigError:
        return ConfigError(f"bad Redis URL {redacted(url)!r}: {why}; {SHAPE}")

    sentinels = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise bad(f"sentinel {item!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise bad("name the service the sentinels watch: /service_name[/db]")
    if len(path) == 2 and not path[1].isdigit():
        raise bad(f"database {path[1]!r} is not a number")
    return SentinelTarget(
        sentinels=tuple(sentinels),
        service=unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(user) or None,
        password=unquote(password) if userinfo and ":" in userinfo else None,
    )


def connect(url: str | None = None, *, socket_timeout_s: float | None = 30.0) -> Redis:
    url = check_url(redis_url(url))
    options = _sync_options(socket_timeout_s)
    if urlsplit(url).scheme == SENTINEL_SCHEME:
        from redis.sentinel import Sentinel

        target = sentinel_target(url)
        sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_options(), **_node_options(target))
        return sentinel.master_for(target.service, redis_class=Redis, db=target.db, **options)
    return Redis.from_url(url, **options)


def connect_async(url: str | None = None) -> AsyncRedis:
    """The asyncio client of the same URL (producer.aio)."""
    url = check_url(redis_url(url))
    if urlsplit(url).scheme == SENTINEL_SCHEME:
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel

        target = sentinel_target(url)
        sentinel = AsyncSentinel(list(target.sentinels), sentinel_kwargs=_sentinel_options(), **_node_options(target))
        return sentinel.master_for(
            target.service, redis_class=AsyncRedis, db=target.db, socket_connect_timeout=CONNECT_TIMEOUT_S
        )
    return AsyncRedis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S)


def _sync_options(socket_timeout_s: float | None) -> dict[str, Any]:
    return {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "health_check_interval": 15,
    }


# What names the server, the database and who connects: all a synchronous twin copies of an asyncio client (its
# timeouts, retries and parser are asyncio objects or the caller's tuning of them; the twin takes `connect`'s).
_SAME_SERVER = ("host", "port", "path", "db", "username", "password", "credential_provider", "client_name")
_SYNC_CLASS = {
    async_connection.Connection: PlainConnection,
    async_connection.SSLConnection: SSLConnection,
    async_connection.UnixDomainSocketConnection: UnixDomainSocketConnection,
}


def connect_like(aredis: AsyncRedis, *, socket_timeout_s: float | None = 30.0) -> Redis:
    """A synchronous client of the server, database, credentials and TLS settings an asyncio client connects
    to (AsyncClient(redis=...)'s other half: the two must never reach different servers). ConfigError, one
    line, for anything else, and for an asyncio client whose connections this cannot copy (Sentinel's, a
    connection class of its own): give its URL instead, from which both halves are opened."""
    if not isinstance(aredis, AsyncRedis):
        raise ConfigError(
            f"redis= takes a redis.asyncio.Redis, not a {type(aredis).__module__}.{type(aredis).__qualname__}; "
            "a synchronous redis.Redis goes to Client(redis=...), or give AsyncClient(redis_url=...)"
        )
    pool = aredis.connection_pool
    twin = _SYNC_CLASS.get(pool.connection_class)
    if twin is None:
        raise ConfigError(
            f"AsyncClient(redis=...) cannot open a synchronous connection like its {pool.connection_class.__name__} "
            "(Sentinel, or a connection class of its own); give redis_url= instead (redis+sentinel:// works)"
        )
    kw = pool.connection_kwargs
    same = {k: kw[k] for k in _SAME_SERVER if k in kw}
    if twin is SSLConnection:  # the sync class takes the same ssl_* names (certificates, verification)
        same.update({k: v for k, v in kw.items() if k.startswith("ssl_")})
    return Redis(connection_pool=ConnectionPool(connection_class=twin, **same, **_sync_options(socket_timeout_s)))


def check_bytes_replies(conn: Any, who: str) -> None:
    """ConfigError, one line, for a caller's connection made with decode_responses=True: every reader takes the
    bytes Redis holds (an id or a result that is not UTF-8 is data too, never decoded blindly), and str replies
    broke them with a raw AttributeError."""
    kw = getattr(getattr(conn, "connection_pool", None), "connection_kwargs", None) or {}
    if kw.get("decode_responses"):
        raise ConfigError(
            f"{who}(redis=...) was given a connection made with decode_responses=True (it answers str; kevlaya reads "
            "bytes): create it without decode_responses, or give redis_url="
        )


def _sentinel_options() -> dict[str, Any]:
    return {"socket_timeout": CONNECT_TIMEOUT_S, "socket_connect_timeout": CONNECT_TIMEOUT_S}


def _node_options(target: SentinelTarget) -> dict[str, Any]:
    """Credentials of the primary and replicas (given to every connection `master_for` opens)."""
    out: dict[str, Any] = {}
    if target.username:
        out["username"] = target.username
    if target.password is not None:
        out["password"] = target.password
    return out


def redacted(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


def redis_problem(exc: redis_exceptions.RedisError, url: str | None = None) -> str:
    """One line naming what went wrong with Redis and what to do about it."""
    where = redacted(redis_url(url))
    if isinstance(exc, redis_exceptions.AuthenticationError):
        return f"Redis at {where} refused the credentials ({exc}); check the user and password in the URL"
    if isinstance(exc, redis_exceptions.NoPermissionError):
        return f"Redis at {where} refused a command for this user ({exc}); check its ACL (README, Security)"
    if isinstance(exc, (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError)):
        return f"cannot reach Redis at {where} ({exc}); is it running? set --redis-url or REDIS_URL"
    if is_wrong_type(exc):
        key = key_named(exc)
        which = f"key {key!r}" if key else "a key kevlaya reads"
        return (
            f"Redis at {where}: {which} holds another type of value than kevlaya keeps there ({exc}); some other "
            "program wrote it: move it aside (redis-cli RENAME) or delete it, then run the command again"
        )
    return f"Redis at {where} answered with an error: {exc}"


def store_error(exc: redis_exceptions.RedisError, url: str) -> StoreError:
    """The project's error for a Redis call that failed, its message `redis_problem`'s one line. Raise it
    `from exc`: the redis-py error stays the `__cause__`."""
    unavailable = (redis_exceptions.ConnectionError, redis_exceptions.TimeoutError, redis_exceptions.NoPermissionError)
    kind = RedisUnavailableError if isinstance(exc, unavailable) else RedisCommandError
    return kind(redis_problem(exc, url))


def url_of(redis: Redis) -> str:
    """A URL naming where a client connects, for messages (never its password): a client built from a
    connection rather than a URL (`Client(redis=...)`) still names its Redis when that Redis fails."""
    pool = redis.connection_pool
    kw = pool.connection_kwargs
    user, db = (f"{kw['username']}@" if kw.get("username") else ""), kw.get("db", 0)
    service = getattr(pool, "service_name", None)
    if service is not None:  # redis.sentinel's pool: the primary is whichever the sentinels name
        sentinels = getattr(getattr(pool, "sentinel_manager", None), "sentinels", [])
        return f"{SENTINEL_SCHEME}://{user}{','.join(map(_address, sentinels))}/{service}/{db}"
    if kw.get("path"):
        return f"unix://{user}{kw['path']}?db={db}"
    scheme = "rediss" if issubclass(pool.connection_class, SSLConnection) else "redis"
    return f"{scheme}://{user}{_address(redis)}/{db}"


def _address(redis: Redis) -> str:
    kw = redis.connection_pool.connection_kwargs
    return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}"
