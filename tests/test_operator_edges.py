"""The operator surface and the batch user's flows at their edges, each a bug a review found: `status` on a
producer-written quarantine entry, `retry-failed` racing a running worker, a batch's status after its window
ended, a second cancel, `batches --limit 0`, and notices the allowlist let through (dot segments, redirects).
Real Redis (the suite's own), the fake engine."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from redis import Redis

import producer.client as client_module
from producer.cli import cli
from producer.client import Client
from shared.errors import INTERNAL, BatchClosedError
from shared.keys import Keys
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.helpers import answer
from worker.loop import BatchWorker
from worker.notices import _post, allowed
from worker.outputs import RowOutput
from worker.settings import WorkerSettings


def items(n: int, **extra) -> list[dict]:
    return [{"custom_id": f"i{i}", "model": "laya", "prompt": f"case {i}", **extra} for i in range(n)]


def drain(redis: Redis, engine: FakeEngine | None = None) -> None:
    BatchWorker(redis, engine or FakeEngine(), FAKE_CONFIG, WorkerSettings(burst=True)).work()


class FailsFirst(FakeEngine):
    """Its first batch fails the named items (an `internal` error); later batches answer everything."""

    def __init__(self, failing: set[str], **kw) -> None:
        super().__init__(**kw)
        self.failing = failing

    def run(self, jobs, *, time_limit_s=None):
        if not self.calls:
            self.calls.append([j.custom_id for j in jobs])
            fail = RowOutput.failed(INTERNAL, "boom")
            return [fail if j.custom_id in self.failing else self._answer(j) for j in jobs]
        return super().run(jobs, time_limit_s=time_limit_s)


class Before(FakeEngine):
    """Calls `before(n)` before its n-th batch runs (0-based): something happening while a take runs."""

    def __init__(self, before, **kw) -> None:
        super().__init__(**kw)
        self.before = before

    def run(self, jobs, **kw):
        self.before(len(self.calls))
        return super().run(jobs, **kw)


def messages(events, seconds: float = 1.0) -> list[bytes]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        msg = events.get_message(timeout=0.1)
        if msg is not None:
            out.append(msg["data"])
    return out


# ---- status ----------------------------------------------------------------------------------------------
def test_status_overview_survives_a_quarantine_entry_that_is_not_an_object(redis_url: str, redis: Redis) -> None:
    """The quarantine list is producer-writable (shared/acl.py): `kevlaya status` showed a traceback
    (AttributeError: 'list' object has no attribute 'get') for a JSON entry that is not an object."""
    redis.lpush(Keys().quarantine(), b"[1, 2]", b"7", b'{"where": "w", "reason": "r", "entry": "e"}')
    redis.set(Keys().counter("quarantined"), 3)
    res = CliRunner().invoke(cli, ["--redis-url", redis_url, "status"])
    assert res.exit_code == 0, res.exception
    assert "  w: r -- e" in res.output


def test_a_batch_shown_expired_is_not_completed_later(client: Client, redis: Redis) -> None:
    """The window ends while every item is running: `status` says `expired` (a terminal word); when the take
    finishes it said `completed`. A status shown as terminal must not change."""
    handle = client.submit_batch(items(2))
    seen: list[str] = []

    def window_ends(n: int) -> None:
        if n == 0:
            redis.hset(Keys().batch(handle.id), "window_ends_at", repr(time.time() - 1))
            seen.append(client.status(handle.id).status)

    drain(redis, Before(window_ends))
    assert seen == ["expired"]
    assert client.status(handle.id).to_dict()["status"] == "expired"


def test_a_batch_finished_within_its_window_is_completed(client: Client, redis: Redis) -> None:
    handle = client.submit_batch(items(2))
    drain(redis)
    assert client.status(handle.id).status == "completed"


def test_a_second_cancel_keeps_the_first_cancelled_at(client: Client, redis: Redis) -> None:
    """`cancel` twice while a take runs: the second moved `cancelled_at` (OpenAI's field: when the cancel began)."""
    handle = client.submit_batch(items(4))
    stamps: list[float | None] = []

    def cancel_twice(n: int) -> None:
        if n == 0:
            client.cancel(handle.id)
            stamps.append(client.status(handle.id).cancelled_at)
            time.sleep(0.05)
            client.cancel(handle.id)
            stamps.append(client.status(handle.id).cancelled_at)

    drain(redis, Before(cancel_twice, rows=2))
    assert stamps[0] is not None and stamps[0] == stamps[1]
    assert client.status(handle.id).status == "cancelled"


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_batches_limit_zero_lists_none(redis_url: str, client: Client, limit: str) -> None:
    for _ in range(3):
        client.submit_batch(items(1))
    res = CliRunner().invoke(cli, ["--redis-url", redis_url, "batches", "--limit", limit])
    assert res.exit_code == 0 and res.output == ""


# ---- retry-failed -----------------------------------------------------------------------------------------
def test_retry_failed_while_a_worker_writes_the_batch_still_retries(
    client: Client, redis: Redis, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """retry-failed while the batch is still running: a worker's write to the batch's results during the retry's
    transaction made it skip the failed item silently ('requeued 0 failed item(s)')."""
    handle = client.submit_batch(items(2))
    drain(redis, FailsFirst({"i1"}))
    client.submit_batch([{"custom_id": "late", "model": "laya", "prompt": "p"}], batch_id=handle.id)  # still running
    worker = Redis.from_url(redis_url)
    real, fired = client_module.enqueue_entries, []

    def worker_writes_meanwhile(pipe, *args, **kwargs):
        if not fired:
            fired.append(answer(worker, handle.id, "late"))
        return real(pipe, *args, **kwargs)

    monkeypatch.setattr(client_module, "enqueue_entries", worker_writes_meanwhile)
    assert client.retry_failed(handle.id) == 1
    assert client.status(handle.id).counts.failed == 0
    drain(redis)
    record = client.status(handle.id)
    assert record.status == "completed" and record.counts.finished == 3
    assert all(r.get("error") is None for r in client.iter_results(handle.id))


def test_retry_failed_of_several_items_is_announced_once(client: Client, redis: Redis, redis_url: str) -> None:
    """Two failed items retried while a worker runs: the first item's requeue was committed (and answered) before
    the second's, so the batch read `completed` with a failure left and was announced mid-retry, then again."""
    handle = client.submit_batch(items(3))
    drain(redis, FailsFirst({"i1", "i2"}))
    events = redis.pubsub(ignore_subscribe_messages=True)
    events.subscribe(Keys().events())
    retrier = Client(redis=Redis.from_url(redis_url))
    real_pipeline, mid = retrier.redis.pipeline, []

    def pipeline(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        def execute(*a, **kw):
            was_watching = pipe.watching
            out = real_execute(*a, **kw)
            if was_watching and not mid:  # the first retry transaction committed: a worker answers what it queued
                mid.append("ran")
                drain(redis)
                mid.append(client.status(handle.id).status)
            return out

        pipe.execute = execute
        return pipe

    retrier.redis.pipeline = pipeline
    assert retrier.retry_failed(handle.id) == 2
    assert mid == ["ran", "completed"]
    drain(redis)
    assert client.status(handle.id).counts.finished == 3
    assert messages(events) == [handle.id.encode()]


def test_two_retry_failed_at_once_requeue_each_item_once(client: Client, redis: Redis, redis_url: str) -> None:
    handle = client.submit_batch(items(4))
    drain(redis, FailsFirst({"i1", "i3"}))
    other = Client(redis=Redis.from_url(redis_url))
    counts: list[int] = []
    threads = [threading.Thread(target=lambda c=c: counts.append(c.retry_failed(handle.id))) for c in (client, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(counts) == [0, 2]
    assert redis.llen("rq:queue:kevlaya:laya") == 2
    assert client.status(handle.id).counts.queued == 2


def test_retry_failed_after_the_window_is_refused_and_keeps_the_error(client: Client, redis: Redis) -> None:
    """After the completion window a retried item was taken straight to `expired`: retry-failed said 'requeued 1',
    the item's real error was replaced by `expired`, and the completed batch turned `expired`."""
    handle = client.submit_batch(items(3), completion_window_s=0.5)
    drain(redis, FailsFirst({"i1"}))
    assert client.status(handle.id).status == "completed"
    time.sleep(0.6)
    with pytest.raises(BatchClosedError, match="completion window"):
        client.retry_failed(handle.id)
    drain(redis)
    rows = list(client.iter_results(handle.id))
    assert rows[1]["error"]["type"] == INTERNAL
    assert client.status(handle.id).status == "completed"


# ---- completion notices -----------------------------------------------------------------------------------
ALLOW = ["https://hooks.example.com/kevlaya/"]


@pytest.mark.parametrize(
    "url",
    [
        "https://hooks.example.com/kevlaya/../admin/delete",
        "https://hooks.example.com/kevlaya/%2e%2e/admin",
        "https://hooks.example.com/kevlaya/./../admin",
    ],
)
def test_notice_allowlist_refuses_dot_segments(url: str) -> None:
    """`/kevlaya/../admin` starts with the allowed `/kevlaya/` (urllib sends it as it is) but is `/admin` to any
    server or proxy that resolves dot segments."""
    assert not allowed(url, ALLOW)


def test_notice_allowlist_still_admits_its_paths() -> None:
    assert allowed("https://hooks.example.com/kevlaya/done", ALLOW)
    assert allowed("https://hooks.example.com/kevlaya/a..b/done", ALLOW)


@pytest.fixture
def redirecting() -> Iterator[tuple[str, list[str]]]:
    """An allowed endpoint that answers 302 to another server, which records what reaches it."""
    hits: list[str] = []

    class Target(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(f"GET {self.path}")
            self.send_response(200)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args: object) -> None:
            pass

    target = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Target)

    class Allowed(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{target.server_port}/internal")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Allowed)
    for server in (target, hook):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{hook.server_port}/hook", hits
    for server in (target, hook):
        server.shutdown()


def test_a_notice_does_not_follow_a_redirect_off_the_allowlist(redirecting) -> None:
    """urllib followed a 302 from the allowed URL with a GET to wherever it pointed (an address no allow prefix
    admits), and counted the notice delivered."""
    url, hits = redirecting
    assert _post(url, b"{}") is False
    assert hits == []
