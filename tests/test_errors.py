"""Expected failures reach a user as one line and a documented exit code, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from redis import Redis

from producer.client import Client
from shared.errors import EXIT_INCOMPLETE, EXIT_REDIS, EXIT_USAGE, WaitTimeoutError
from worker.tools.embedded_redis import free_port

CLI = [sys.executable, "-c", "from producer.cli import main; main()"]


def run(*args: str, stdin: bytes = b"", env: dict | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*CLI, *args], input=stdin, capture_output=True, timeout=60, env=env)


def one_line(proc: subprocess.CompletedProcess[bytes]) -> str:
    err = proc.stderr.decode().strip()
    assert "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    ("url", "code", "fragment"),
    [
        (f"redis://127.0.0.1:{free_port()}/0", EXIT_REDIS, "cannot reach Redis at redis://127.0.0.1:"),
        ("127.0.0.1:6379", EXIT_USAGE, "bad Redis URL"),
        ("redis://127.0.0.1:6379/notadb", EXIT_USAGE, "bad Redis URL"),
    ],
)
def test_redis_problems_are_one_line(url: str, code: int, fragment: str) -> None:
    proc = run("--redis-url", url, "status")
    assert proc.returncode == code
    assert fragment in one_line(proc)


def test_wrong_password_fails_fast_with_exit_3(redis_url: str, redis: Redis) -> None:
    redis.execute_command("ACL", "SETUSER", "someone", "on", ">right", "~*", "+@all")
    try:
        url = redis_url.replace("redis://", "redis://someone:wrong@")
        proc = run("--redis-url", url, "status")
        assert proc.returncode == EXIT_REDIS
        msg = one_line(proc)
        assert "refused the credentials" in msg and "wrong" not in msg  # the password is not echoed
    finally:
        redis.execute_command("ACL", "DELUSER", "someone")


def test_unknown_batch_and_usage_errors_exit_1(redis_url: str, redis: Redis) -> None:
    proc = run("--redis-url", redis_url, "status", "nope")
    assert proc.returncode == EXIT_USAGE and "no batch 'nope'" in one_line(proc)
    proc = run("--redis-url", redis_url, "submit", "-", "--batch-id", "a b", stdin=b'{"model":"laya","prompt":"p"}\n')
    assert proc.returncode == EXIT_USAGE and "batch id" in one_line(proc)
    proc = run("--redis-url", redis_url, "status", "--bogus")
    assert proc.returncode == EXIT_USAGE and "No such option" in proc.stderr.decode()


def test_results_exit_4_while_items_are_pending(redis_url: str, redis: Redis, tmp_path: Path) -> None:
    batch = Client(redis=redis).submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p"}]).id
    proc = run("--redis-url", redis_url, "results", batch)
    assert proc.returncode == EXIT_INCOMPLETE
    assert b'"pending":true' in proc.stdout
    proc = run("--redis-url", redis_url, "status", batch, "--wait", "--timeout", "0.5")
    assert proc.returncode == EXIT_INCOMPLETE and "still running" in proc.stderr.decode().strip().splitlines()[-1]


def test_client_wait_raises_on_timeout(client: Client) -> None:
    handle = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p"}])
    with pytest.raises(WaitTimeoutError, match="0/1 done"):
        client.wait(handle.id, timeout_s=0.2, poll_s=0.05)
