"""Completion notices: one pub/sub message per finished batch, an HTTP POST (allowlisted, retried), and
waits that wake on the message."""

from __future__ import annotations

import contextlib
import http.server
import socket
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
from worker import notices
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


# ---- receivers that misbehave -----------------------------------------------------------------------------------
class Receiver:
    """A bare TCP server: each connection's request is read, then `answer` writes whatever it likes; `closed`
    records when the sender hung up on an answer still being written."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}/hook"
        self.requests = 0
        self.closed: list[float] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.server.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            self.requests += 1
            try:
                self.answer(self, conn)
            except OSError:
                self.closed.append(time.monotonic())

    def close(self) -> None:
        self.server.close()


def trickle(data: bytes, every_s: float = 0.2):
    def answer(receiver: Receiver, conn: socket.socket) -> None:
        for byte in data:
            conn.sendall(bytes([byte]))
            time.sleep(every_s)

    return answer


# A byte every 0.2 s: each read of the sender's socket succeeds well within any per-read timeout.
SLOW_STATUS = trickle(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
ENDLESS_HEADERS = trickle(b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 200)


@pytest.mark.parametrize("answer", [SLOW_STATUS, ENDLESS_HEADERS], ids=["slow-status", "endless-headers"])
def test_a_trickling_receiver_cannot_hold_a_try_past_its_deadline(answer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket timeout bounds each read, not the answer: a receiver sending a byte every 0.2 s held a try with
    a 1 s timeout for as long as it kept trickling (and the notices thread, and every notice behind it)."""
    monkeypatch.setattr(notices, "POST_TIMEOUT_S", 1.0)
    receiver = Receiver(answer)
    try:
        started = time.monotonic()
        assert notices._post(receiver.url, b"{}") is False
        took = time.monotonic() - started
        assert took < 2.0, f"one try took {took:.1f} s"
        # The abandoned connection is shut, not left trickling on a thread of its own.
        wait_until(lambda: receiver.closed, 5)
        assert receiver.closed[0] - started < 3.0
        wait_until(lambda: not [t for t in threading.enumerate() if t.name == "notice-post"], 5)
    finally:
        receiver.close()


def test_a_notice_to_a_trickling_receiver_is_retried_then_given_up(
    client: Client, redis: Redis, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(notices, "POST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(notices, "RETRY_DELAYS_S", (0.1,))
    receiver = Receiver(SLOW_STATUS)
    handle = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p"}])
    notifier = notices.Notifier(redis, Keys(), "w1", allow=[receiver.url], stop=threading.Event())
    try:
        started = time.monotonic()
        notifier._deliver(orjson.dumps({"batch": handle.id, "url": receiver.url}))
        assert time.monotonic() - started < 3.0
    finally:
        receiver.close()
    assert receiver.requests == 2 and notifier.delivered == 0
    assert f"batch {handle.id}: POST to {receiver.url} failed 2 times; giving up" in caplog.text
    assert "no whole answer within 0.5 s" in caplog.text


def endless_body(status: bytes):
    def answer(receiver: Receiver, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: 1000000000000\r\n\r\n")
        while True:
            conn.sendall(b"x" * 65536)

    return answer


@pytest.mark.parametrize(("status", "ok"), [(b"200 OK", True), (b"500 Oops", False)])
def test_an_endless_answer_body_is_not_read(status: bytes, ok: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the status counts: a terabyte body is never read (nor waited for)."""
    monkeypatch.setattr(notices, "POST_TIMEOUT_S", 5.0)
    receiver = Receiver(endless_body(status))
    try:
        started = time.monotonic()
        assert notices._post(receiver.url, b"{}") is ok
        assert time.monotonic() - started < 2.0
        wait_until(lambda: receiver.closed, 5)
    finally:
        receiver.close()


def test_a_redirect_loop_costs_one_request() -> None:
    def to_itself(receiver: Receiver, conn: socket.socket) -> None:
        conn.sendall(f"HTTP/1.1 307 Again\r\nLocation: {receiver.url}\r\nContent-Length: 0\r\n\r\n".encode())

    receiver = Receiver(to_itself)
    try:
        assert notices._post(receiver.url, b"{}") is False
        assert receiver.requests == 1
    finally:
        receiver.close()
