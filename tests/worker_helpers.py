"""Running the real worker in tests: in-process (burst) or as a subprocess that can be killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from redis import Redis

from producer.client import Client
from shared.keys import Keys
from worker.loop import BatchWorker
from worker.settings import WorkerSettings
from worker.stats import WorkerStats

CLI = [sys.executable, "-c", "from producer.cli import main; main()"]


def drain(redis: Redis, engine, **settings) -> WorkerStats:
    """Run an in-process worker in burst mode until the queues are empty."""
    return BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, **settings)).work()


def spawn_worker(
    redis_url: str, config: Path, *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> subprocess.Popen[bytes]:
    """`kevlaya worker` as a subprocess (so it can be killed); `env` adds variables (fault injection)."""
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        [*CLI, "--redis-url", redis_url, "worker", "--config", str(config), *args],
        stdout=out,
        stderr=out,
        env={**os.environ, **(env or {})},
    )


def wait_until(predicate, timeout_s: float, poll_s: float = 0.05) -> float:
    """Poll until predicate() is true; returns the seconds it took, fails the test on timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - start


def final_counts(client: Client, batch: str) -> dict[str, int]:
    return client.status(batch).counts.to_dict()


def assert_each_item_answered_once(client: Client, redis: Redis, batch: str, n: int) -> list[dict]:
    rows = list(client.iter_results(batch))
    assert len(rows) == n
    assert not [r for r in rows if r.get("pending")], "some items have no final result"
    assert len({r["custom_id"] for r in rows}) == n
    # exactly one final result per item, ever: the results hash has one field per item
    assert redis.hlen(Keys().batch_results(batch)) == n
    return rows
