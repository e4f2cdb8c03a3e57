"""Tests run against a real Redis: database 15 of $REDIS_URL's server, flushed around each test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from redis import Redis

from producer.client import Client

TEST_DB = 15


def _test_url() -> str:
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    return base.rsplit("/", 1)[0] + f"/{TEST_DB}" if base.count("/") >= 3 else f"{base}/{TEST_DB}"


@pytest.fixture
def redis_url() -> str:
    return _test_url()


@pytest.fixture
def redis(redis_url: str) -> Iterator[Redis]:
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    yield conn
    conn.flushdb()
    conn.close()


@pytest.fixture
def client(redis: Redis) -> Client:
    return Client(redis=redis)
