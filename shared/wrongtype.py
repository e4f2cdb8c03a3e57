"""Keys of the wrong Redis type: a WRONGTYPE reply names no key, so the operator could not tell which key some
other writer (redis-cli, an older version, a buggy producer) left there. The reads that fail on one say which."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from redis import exceptions as redis_exceptions

from shared.errors import WrongTypeError

# redis-py prefixes an error inside a pipeline with the command it answered: `Command # 3 (HGETALL key) of ...`.
_PIPELINE_COMMAND = re.compile(r"Command # \d+ \(\S+ (\S+)")


def is_wrong_type(exc: BaseException) -> bool:
    return isinstance(exc, redis_exceptions.ResponseError) and "WRONGTYPE" in str(exc)


def key_named(exc: BaseException) -> str | None:
    """The key of a WRONGTYPE error raised by a pipeline (redis-py names the command), else None."""
    found = _PIPELINE_COMMAND.search(str(exc))
    return found.group(1) if found else None


@contextlib.contextmanager
def expecting(redis: Any, kinds: Mapping[str, str]) -> Iterator[None]:
    """Turn a WRONGTYPE reply to the commands inside into WrongTypeError naming the key. `kinds`: each key those
    commands touch -> the Redis type kevlaya keeps there (`hash`, `list`, `set`, `zset`, `string`); the one
    whose TYPE differs is named. Another error, or none found to differ (it changed meanwhile), goes on as is."""
    try:
        yield
    except redis_exceptions.ResponseError as exc:
        if not is_wrong_type(exc):
            raise
        found = wrong_typed(redis, kinds)
        if found is None:
            raise
        raise found from exc


def wrong_typed(redis: Any, kinds: Mapping[str, str]) -> WrongTypeError | None:
    """The first key of `kinds` that holds another type than the one named (a missing key is none)."""
    for key, kind in kinds.items():
        try:
            held = redis.type(key)
        except redis_exceptions.RedisError:
            continue
        held = held.decode() if isinstance(held, bytes) else str(held)
        if held not in (kind, "none"):
            return WrongTypeError(key, kind, held)
    return None
