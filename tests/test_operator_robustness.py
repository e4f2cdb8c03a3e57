"""The operator's commands against what they cannot fix themselves: keys of the wrong Redis type, a Redis that
is down, an empty key prefix, a stray metrics path, a GPU launch that cannot work. Each ends in one line and a
documented exit code (README, "Exit codes"), never a traceback or a loop."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.cli import main
from producer.client import Client
from producer.schedule import ScheduleSpec, ScheduleState, SlotRun
from shared.errors import EXIT_OK, EXIT_REDIS, EXIT_USAGE
from shared.keys import Keys
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.test_operator_edges import FailsFirst, items
from tests.worker_helpers import wait_until
from worker import presence, supervisor
from worker.loop import BatchWorker
from worker.metrics import HealthServer
from worker.settings import WorkerSettings
from worker.tools.embedded_redis import EmbeddedRedis, free_port


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`kevlaya ARGS` in this process: its exit code and stderr. Any exception but SystemExit (a traceback for the
    operator) fails the test."""
    code, _, err = run_main_out(monkeypatch, capsys, *args)
    return code, err


def run_main_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """`run_main`, with stdout too: exit code, stdout, stderr."""
    monkeypatch.setattr(sys, "argv", ["kevlaya", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    return int(exited.value.code or 0), captured.out, captured.err


# ---- keys of the wrong type ----------------------------------------------------------------------------------
@pytest.fixture
def every_key(redis: Redis, client: Client) -> dict[bytes, tuple[bytes, bytes]]:
    """A Redis holding one of each key the read commands touch: batch b1 answered with one failure (something to
    retry), b2 still queued (something to cancel), a schedule with a run, a worker seen. Key -> (DUMP, type)."""
    client.submit_batch(items(4), batch_id="b1")
    BatchWorker(redis, FailsFirst({"i1"}), FAKE_CONFIG, WorkerSettings(burst=True)).work()
    client.submit_batch(items(2), batch_id="b2")
    state = ScheduleState(client, "nightly")
    state.save_spec(ScheduleSpec(name="nightly", every_s=10, inputs=("in/*.jsonl",), output="out/{slot}.jsonl"))
    state.record(SlotRun(slot="20260101T000000Z", status="missed"))
    return {key: (redis.dump(key), redis.type(key)) for key in redis.keys("*")}


READ_COMMANDS = [
    ("status",),
    ("status", "b1"),
    ("results", "b1", "-o", "{tmp}/out.jsonl"),
    ("batches",),
    ("cancel", "b2"),
    ("retry-failed", "b1"),
    ("schedule", "--list"),
]


@pytest.mark.parametrize("command", READ_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_wrong_typed_key_is_named_in_one_line_with_the_data_error_code(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    redis: Redis,
    redis_url: str,
    every_key: dict[bytes, tuple[bytes, bytes]],
    command: tuple[str, ...],
) -> None:
    """Each key in turn given another type (some other writer's). A WRONGTYPE reply names no key: it ended in
    'Redis answered with an error' and exit 3 (Redis unreachable), or 'an unreadable record', and the operator could
    not tell which key to look at. A command that can go on without the key may; one that stops names the key."""
    args = [arg.format(tmp=tmp_path) for arg in command]
    failed = []
    for key, (_, kind) in sorted(every_key.items()):
        redis.flushdb()
        for k, (dump, _) in every_key.items():
            redis.restore(k, 0, dump)
        redis.delete(key)
        redis.rpush(key, "x") if kind == b"string" else redis.set(key, "x")
        code, err = run_main(monkeypatch, capsys, "--redis-url", redis_url, *args)
        if code == EXIT_OK:
            continue
        lines = err.strip().splitlines()
        if code != EXIT_USAGE or len(lines) != 1 or key.decode() not in lines[0]:
            failed.append((key, code, err))
    assert not failed


def test_the_wrong_typed_key_message_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], redis: Redis, redis_url: str
) -> None:
    redis.set("kevlaya:batches", "x")
    code, err = run_main(monkeypatch, capsys, "--redis-url", redis_url, "batches")
    assert code == EXIT_USAGE
    assert err.strip() == (
        "error: Redis key 'kevlaya:batches' holds a string, not the zset kevlaya keeps there (some other program "
        "wrote it): move it aside (redis-cli RENAME 'kevlaya:batches' 'kevlaya:batches.bad') or delete it, then run "
        "the command again"
    )


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_batches_lists_the_readable_and_names_each_broken_batch(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    redis: Redis,
    redis_url: str,
    client: Client,
    as_json: bool,
) -> None:
    """A batch whose record or results key some other writer gave another type was left out of the listing without
    a word (exit 0), while `status` of that batch names the key and exits 1. The listing goes on past it (the other
    batches are worth seeing), then names each such key in one line and exits 1, as every other command does."""
    for batch in ("b1", "b2", "b3"):
        client.submit_batch(items(1), batch_id=batch)
    keys = Keys()
    redis.delete(keys.batch("b2"), keys.batch_results("b3"))
    redis.set(keys.batch("b2"), "x")
    redis.rpush(keys.batch_results("b3"), "x")
    args = ["--redis-url", redis_url, "batches", *(["--json"] if as_json else [])]
    code, out, err = run_main_out(monkeypatch, capsys, *args)
    assert code == EXIT_USAGE
    listed = [orjson.loads(row)["batch"] if as_json else row.split()[0] for row in out.splitlines()]
    assert listed == ["b1"]
    # Each broken batch in one line, the line `status` prints for it.
    named = [run_main(monkeypatch, capsys, "--redis-url", redis_url, "status", b) for b in ("b2", "b3")]
    assert [c for c, _ in named] == [EXIT_USAGE, EXIT_USAGE]
    assert sorted(err.splitlines()) == sorted(e.strip() for _, e in named)
    assert keys.batch("b2") in named[0][1] and keys.batch_results("b3") in named[1][1]


def test_batches_shows_a_record_of_hostile_values_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], redis: Redis, redis_url: str, client: Client
) -> None:
    """Fields that are not UTF-8, numbers that are garbage, NaN or huge, fields missing altogether, an index entry
    that is no batch id or whose record expired: each batch still gets its line (or none, when there is no
    record), and the command ends cleanly."""
    for batch in ("mangled", "bare", "fine"):
        client.submit_batch(items(2), batch_id=batch)
    keys = Keys()
    redis.hset(keys.batch("mangled"), mapping={
        "created_at": b"\xff\xfe", "expires_at": "nan", "finished": "-3", "failed": "1e400",
        "followups_done": "\u00e9", "first_done_at": "inf", b"\xff": b"\xff", "cancel_requested": b"\x80",
    })  # fmt: skip
    redis.delete(keys.batch("bare"))
    redis.hset(keys.batch("bare"), "junk", "1")  # every field kevlaya writes missing
    redis.zadd(keys.batches(), {b"\xff\xfe": time.time() + 5, "gone": time.time() + 6, "x" * 500: time.time() + 7})
    for extra in ([], ["--json"]):
        code, out, err = run_main_out(monkeypatch, capsys, "--redis-url", redis_url, "batches", *extra)
        assert (code, err) == (EXIT_OK, "")
        ids = [orjson.loads(row)["batch"] if extra else row.split()[0] for row in out.splitlines()]
        assert sorted(ids) == ["bare", "fine", "mangled"]


# ---- a worker against a Redis that is down -------------------------------------------------------------------
@pytest.fixture
def short_burst_wait(monkeypatch: pytest.MonkeyPatch) -> float:
    """A burst worker gives up on a down Redis after 1 s here (15.5 s in use)."""
    monkeypatch.setattr(presence, "BURST_REDIS_WAIT_S", 1.0, raising=False)  # absent before the bound
    return 1.0


@pytest.fixture
def fake_worker_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kevlaya worker` runs the fake engine over the fake config (no model to load)."""
    import worker.config
    import worker.engine

    monkeypatch.setattr(worker.config, "load_config", lambda path: FAKE_CONFIG)
    monkeypatch.setattr(worker.engine, "Engine", lambda *args, **kwargs: FakeEngine())


def test_a_burst_worker_gives_up_on_a_redis_that_is_down(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], short_burst_wait: float, fake_worker_engine
) -> None:
    """It retried for good (0.5 s doubling to 10 s, forever): a cron job's burst run never ended, and said only
    'retrying'. Now: a bounded wait, one line naming the Redis, exit 3."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    code, err = run_main(
        monkeypatch, capsys, "--redis-url", url, "worker", "--config", "m.toml", "--burst", "--take-ahead", "off"
    )
    assert time.monotonic() - started < 10
    assert code == EXIT_REDIS
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: cannot reach Redis at ") and url in last
    assert "Traceback" not in err


def test_a_burst_worker_gives_up_when_redis_goes_down_mid_run(
    short_burst_wait: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis gone while a take runs: the loop retried every second for good, burst or not. It warned at each retry,
    the heartbeat at each beat, and the stop that it could not register its death: now one warning says it all."""
    caplog.set_level(logging.INFO, logger="kevlaya.worker")
    with EmbeddedRedis() as server:
        conn = Redis.from_url(server.url)
        Client(redis=conn).submit_batch(items(2))

        class Stops(FakeEngine):
            def run(self, jobs, **kw):
                server.stop()
                return super().run(jobs, **kw)

        ended: list[BaseException] = []

        def work() -> None:
            try:
                BatchWorker(conn, Stops(), FAKE_CONFIG, WorkerSettings(burst=True, take_ahead=False)).work()
            except BaseException as exc:  # what the thread ended with is the finding
                ended.append(exc)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        thread.join(timeout=20)
        assert not thread.is_alive()
        assert ended and isinstance(ended[0], (RedisConnectionError, RedisTimeoutError))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "unavailable" in warned[0] and "giving up after 1 s" in warned[0], warned


# `kevlaya worker` with the fake engine, a burst worker giving up on Redis after 1 s: in a process of its own, so its
# stderr is what an operator's terminal or cron mail gets (logging's own handler, not pytest's capture).
FAKE_WORKER_CLI = """
import worker.config, worker.engine
from tests.fakes import FAKE_CONFIG, FakeEngine
from worker import presence
presence.BURST_REDIS_WAIT_S = 1.0
worker.config.load_config = lambda path: FAKE_CONFIG
worker.engine.Engine = lambda *args, **kwargs: FakeEngine()
from producer.cli import main
main()
"""


def burst_worker_stderr(*args: str) -> tuple[int, list[str]]:
    url = f"redis://127.0.0.1:{free_port()}/0"
    command = [sys.executable, "-c", FAKE_WORKER_CLI, "--redis-url", url, "worker", "--config", "m.toml", "--burst"]
    done = subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[1]
    )
    return done.returncode, done.stderr.splitlines()


def test_a_burst_worker_on_a_dead_redis_says_one_line_then_its_error() -> None:
    """Each retry was a WARNING line (five in the 15.5 s of a real run) above the one-line error: a wall of
    noise in a cron mail. Now one line says what is down and when the run gives up, then the error; each retry is
    still there at --log-level debug."""
    code, lines = burst_worker_stderr("--take-ahead", "off")
    assert code == EXIT_REDIS
    assert len(lines) == 2, lines
    assert "WARNING" in lines[0] and "unavailable" in lines[0] and "giving up after 1 s" in lines[0]
    assert lines[1].startswith("error: cannot reach Redis at ")
    code, lines = burst_worker_stderr("--take-ahead", "off", "--log-level", "debug")
    assert code == EXIT_REDIS and lines[-1].startswith("error: cannot reach Redis at ")
    assert [line for line in lines if "still unavailable" in line]


def test_a_long_lived_worker_says_when_an_outage_starts_and_ends(caplog: pytest.LogCaptureFixture) -> None:
    """It warned once a second from the loop and once a beat from the heartbeat for as long as Redis was down (a
    night's outage: tens of thousands of lines), and never said when Redis was back."""
    caplog.set_level(logging.DEBUG, logger="kevlaya.worker")
    with EmbeddedRedis() as server:
        conn = Redis.from_url(server.url)
        worker = BatchWorker(conn, FakeEngine(), FAKE_CONFIG, WorkerSettings(take_ahead=False))
        thread = threading.Thread(target=worker.work, daemon=True)
        thread.start()
        wait_until(worker.ready.is_set, timeout_s=10)
        server.stop()
        time.sleep(4.0)  # four of the loop's retries, one of the heartbeat's at least
        server.start()
        # "is back after": the outage's own warning ("retrying until it is back") must not end the wait.
        wait_until(lambda: any("is back after" in r.getMessage() for r in caplog.records), timeout_s=10)
        worker.request_stop()
        thread.join(timeout=10)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    warned = [m for level, m in said if level >= logging.WARNING]
    assert len(warned) == 1 and server.url in warned[0] and "until it is back" in warned[0], warned
    assert len([m for level, m in said if level == logging.INFO and "is back after" in m]) == 1
    assert len([m for level, m in said if level == logging.DEBUG and "still unavailable" in m]) >= 3


@pytest.mark.parametrize("burst", [True, False])
def test_only_a_burst_worker_stops_waiting_for_redis(short_burst_wait: float, burst: bool) -> None:
    stop = threading.Event()
    settings = WorkerSettings(burst=burst)
    waiting = presence.Presence(None, None, None, settings, stop=stop, in_flight=list)  # type: ignore[arg-type]

    def down() -> None:
        raise RedisConnectionError("Connection refused.")

    timer = threading.Timer(short_burst_wait + 2.5, stop.set)  # a stop ends a long-lived worker's wait
    timer.start()
    started = time.monotonic()
    with pytest.raises(RedisConnectionError):
        waiting.wait_for_redis(down)
    waited = time.monotonic() - started
    timer.cancel()
    assert waited < short_burst_wait + 2.0 if burst else waited >= short_burst_wait + 2.5


# ---- the key prefix ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["", " ", "\t\n"])
@pytest.mark.parametrize("command", [("status",), ("batches",), ("worker", "--config", "m.toml", "--burst")])
def test_an_empty_prefix_is_refused_in_one_line_before_redis_is_read(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    redis: Redis,
    redis_url: str,
    fake_worker_engine: None,
    prefix: str,
    command: tuple[str, ...],
) -> None:
    """It was taken: kevlaya's keys (`batches`, `notices`, `schedules`, queues named after the bare model) then sat
    among every other program's in the database."""
    redis.set("batches", "someone else's")
    code, err = run_main(monkeypatch, capsys, "--redis-url", redis_url, "--prefix", prefix, *command)
    assert code == EXIT_USAGE
    assert len(err.strip().splitlines()) == 1 and "--prefix" in err
    assert redis.keys("*") == [b"batches"]


# ---- the metrics endpoint ------------------------------------------------------------------------------------
def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_are_served_on_metrics_only(redis: Redis) -> None:
    """Every path but /healthz and /readyz answered 200 with the metrics (/, /metricz, /favicon.ico): a scraper or
    probe pointed at a mistyped path looked healthy."""
    worker = BatchWorker(redis, FakeEngine(), FAKE_CONFIG, WorkerSettings(name="m1"))
    server = HealthServer(worker, 0, host="127.0.0.1").start()
    try:
        status, text = _get(server.port, "/metrics")
        assert status == 200 and "kevlaya_jobs" in text
        assert _get(server.port, "/healthz") == (200, "ok\n")
        for path in ("/", "/metricz", "/metrics/x", "/favicon.ico", "/healthz/x"):
            status, text = _get(server.port, path)
            assert status == 404 and "kevlaya_jobs" not in text, path
    finally:
        server.stop()


# ---- worker --gpus -------------------------------------------------------------------------------------------
@pytest.fixture
def started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """--gpus children are a fake that notes its GPU in a file of this folder and exits 0 (no model, no GPU)."""
    note = "import os, pathlib, sys; pathlib.Path(sys.argv[1], os.environ['CUDA_VISIBLE_DEVICES']).touch()"
    monkeypatch.setattr(supervisor, "WORKER_CMD", [sys.executable, "-c", note, str(tmp_path)])
    return tmp_path


def gpus_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], gpus_on_machine: int, *args: str
) -> tuple[int, str]:
    monkeypatch.setattr(supervisor, "cuda_count", lambda: gpus_on_machine)
    return run_main(monkeypatch, capsys, "worker", "--config", "m.toml", *args)


@pytest.mark.parametrize(("port", "gpus"), [("65535", "0,1"), ("65534", "0,1,2")])
def test_gpus_refuses_metrics_ports_past_65535_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], started: Path, port: str, gpus: str
) -> None:
    """The last child got --metrics-port 65536, refused it, and was restarted into the same refusal three times."""
    code, err = gpus_run(monkeypatch, capsys, 0, "--gpus", gpus, "--metrics-port", port)
    assert code == EXIT_USAGE
    assert len(err.strip().splitlines()) == 1 and "--metrics-port" in err and "65535" in err
    assert not list(started.iterdir())  # no child started


def test_gpus_refuses_a_gpu_the_machine_does_not_have(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], started: Path
) -> None:
    """A child on GPU 2 of a 2-GPU machine sees no device: it crashed through its restarts, then took the others
    down with it."""
    code, err = gpus_run(monkeypatch, capsys, 2, "--gpus", "0,1,2")
    assert code == EXIT_USAGE
    assert len(err.strip().splitlines()) == 1 and "GPU 2 is not on this machine" in err
    assert not list(started.iterdir())


@pytest.mark.parametrize(("on_machine", "gpus"), [(2, "0,1"), (0, "0,5")])
def test_gpus_still_starts_what_fits_or_cannot_be_checked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], started: Path, on_machine: int, gpus: str
) -> None:
    """The last port 65535 is a port; a machine whose GPUs cannot be counted without CUDA (0) refuses no index."""
    code, err = gpus_run(monkeypatch, capsys, on_machine, "--gpus", gpus, "--metrics-port", "65534")
    assert code == EXIT_OK, err
    assert sorted(p.name for p in started.iterdir()) == gpus.split(",")
