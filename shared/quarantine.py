"""Where workers (and producers) put what they cannot use: every byte in Redis is untrusted.

An entry the worker cannot use (an id that is not UTF-8 or not an id, a job key of the wrong Redis type, a
garbage registry member, a key of the wrong type where a list or set belongs) is moved aside once, with the
reason, into a capped list that `kevlaya status` shows; it is logged once and never read again. Nothing
that is quarantined costs another job a retry or stops the worker.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
import redis.exceptions
from redis import Redis

from shared.keys import Keys

log = logging.getLogger("kevlaya.quarantine")

QUARANTINE_CAP = 1000  # records kept; the counter keeps the total


@dataclass(frozen=True, kw_only=True)
class QuarantineRecord:
    at: float
    where: str
    reason: str
    entry: str  # a printable rendering of what was found (bytes shown escaped, capped)

    def to_json(self) -> bytes:
        return orjson.dumps({"at": self.at, "where": self.where, "reason": self.reason, "entry": self.entry})


def printable(value: Any, limit: int = 200) -> str:
    """A safe, short rendering of untrusted bytes for logs and the quarantine list."""
    text = repr(value) if isinstance(value, (bytes, bytearray)) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


class Quarantine:
    """Writes quarantine records and moves wrong-typed keys aside."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.count = 0  # in this process, for the worker's stats

    def put(self, where: str, reason: str, entry: Any) -> None:
        record = QuarantineRecord(at=time.time(), where=where, reason=reason, entry=printable(entry))
        self.count += 1
        log.warning("quarantined %s in %s: %s", record.entry, where, reason)
        try:
            with self.redis.pipeline(transaction=False) as pipe:
                pipe.lpush(self.keys.quarantine(), record.to_json())
                pipe.ltrim(self.keys.quarantine(), 0, QUARANTINE_CAP - 1)
                pipe.incr(self.keys.counter("quarantined"))
                pipe.execute(raise_on_error=False)
        except redis.exceptions.ResponseError:
            pass  # the quarantine list itself was overwritten with a wrong type; the log line stands

    def move_key(self, name: str, reason: str) -> None:
        """Rename a key of the wrong Redis type aside, so the next enqueue or write recreates it cleanly."""
        target = self.keys.quarantined_key(name, time.time())
        try:
            self.redis.rename(name, target)
        except redis.exceptions.ResponseError:
            return  # gone meanwhile
        self.put(name, f"{reason}; renamed to {target}", name)


def clear_the_way(redis: Redis, quarantine: Quarantine, expected: dict[str, str]) -> None:
    """Redis runs every command of a transaction even when one fails, so a key of the wrong type (a hostile
    or broken writer) would leave a transaction half applied. Keys that are not of their expected type
    (`name -> "list" | "set" | "hash" | "zset"`) are moved aside, and recorded, before it."""
    names = list(expected)
    with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.type(name)
        kinds = pipe.execute()
    for name, kind in zip(names, kinds, strict=True):
        found = kind.decode() if isinstance(kind, bytes) else str(kind)
        if found not in ("none", expected[name]):
            quarantine.move_key(name, f"a {found} where a {expected[name]} belongs")
