"""Completion notices: one pub/sub message per finished batch, an HTTP POST (allowlisted, retried), and
waits that wake on the message."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import orjson
import pytest
from redis import Redis

from producer.client import Client
from shared.keys import Keys
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.worker_helpers import wait_until
from worker.loop import BatchWorker
from worker.settings import WorkerSettings


@pytest.fixture
def hook() -> Iterator[tuple[str, list[dict]]]:
    """A local HTTP server that fails its first request (to show the retry) and records the rest."""
    received: list[dict] = []
    calls = {"n": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            calls["n"] += 1
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if calls["n"] == 1:
                self.send_response(503)
            else:
                received.append(orjson.loads(body))
                self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/done", received
    server.shutdown()


def drain_messages(events, seconds: float = 1.0) -> list[str]:
    """Every message that arrives within `seconds` (the subscribe confirmation reads as None)."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        msg = events.get_message(timeout=0.1)
        if msg is not None:
            out.append(msg["data"].decode())
    return out


def run_worker(redis: Redis, **settings) -> tuple[BatchWorker, threading.Thread]:
    worker = BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(name="n1", **settings))
    thread = threading.Thread(target=worker.work)
    thread.start()
    return worker, thread


def test_a_finished_batch_is_announced_once_and_posted(client: Client, redis: Redis, hook) -> None:
    url, received = hook
    events = redis.pubsub(ignore_subscribe_messages=True)
    events.subscribe(Keys().events())
    handle = client.submit_batch(
        [{"custom_id": f"i{i}", "model": "laya", "prompt": "p"} for i in range(3)], notify_url=url
    )
    other = client.submit_batch(
        [{"custom_id": "x", "model": "laya", "prompt": "p"}], notify_url="http://evil.example/x"
    )
    worker, thread = run_worker(redis, notify_allow=(url.rsplit("/", 1)[0],))
    try:
        record = client.wait(handle.id, timeout_s=30)
        assert record.status == "completed"
        wait_until(lambda: received, 30)
    finally:
        worker.request_stop()
        thread.join(timeout=30)
    (posted,) = received
    assert posted["batch"] == handle.id and posted["status"] == "completed"
    assert posted["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert sorted(drain_messages(events)) == sorted([handle.id, other.id])  # each batch exactly once
    assert client.status(other.id).complete  # its notice was refused (not allowlisted), not sent


def test_a_cancel_that_finishes_a_batch_announces_it(client: Client, redis: Redis) -> None:
    events = redis.pubsub(ignore_subscribe_messages=True)
    events.subscribe(Keys().events())
    handle = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p"}])
    client.cancel(handle.id)
    assert drain_messages(events) == [handle.id]


def test_wait_wakes_on_the_announcement_not_the_poll(client: Client, redis: Redis) -> None:
    handle = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p"}])
    worker, thread = run_worker(redis)
    try:
        started = time.monotonic()
        record = client.wait(handle.id, poll_s=60, timeout_s=30)  # a poll would take a minute
        assert record.complete and time.monotonic() - started < 30
    finally:
        worker.request_stop()
        thread.join(timeout=30)
