"""`kevlaya schedule`: slots from a cadence, one run per slot with two schedulers, restarts, missed slots reported,
results exported. The slot logic in-process (fixed slot times); then the real command over RQ's cron scheduler,
two of them as subprocesses on a 1 s interval, with a fake-engine worker in a thread."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson
import pytest
from redis import Redis

from producer.client import Client
from producer.schedule import Cadence, ScheduleSpec, ScheduleState, SlotRunner, overview, parse_every, stamp
from shared.errors import ValidationError
from shared.keys import Keys
from tests.fakes import FakeEngine
from tests.worker_helpers import CLI, drain, wait_until
from worker.loop import BatchWorker
from worker.settings import WorkerSettings

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=timezone.utc)


def utc(**kw: int) -> datetime:
    return T0 + timedelta(**kw)


def test_cadence_every_is_counted_from_the_epoch() -> None:
    c = Cadence(every_s=10)
    assert c.next_after(utc(seconds=3)) == utc(seconds=10)
    assert c.next_after(utc(seconds=10)) == utc(seconds=20)  # strictly after
    assert c.at_or_before(utc(seconds=19)) == utc(seconds=10)
    assert c.at_or_before(utc(seconds=20)) == utc(seconds=20)
    assert list(c.between(utc(), utc(seconds=30))) == [utc(seconds=10), utc(seconds=20)]


def test_cadence_cron_in_utc() -> None:
    c = Cadence(cron="0 2 * * *")
    assert c.next_after(utc(minutes=1)) == utc(days=1)
    assert c.at_or_before(utc(hours=5)) == T0
    assert c.at_or_before(T0) == T0
    assert list(c.between(T0 - timedelta(days=3), T0)) == [T0 - timedelta(days=2), T0 - timedelta(days=1)]


@pytest.mark.parametrize(
    ("text", "seconds"), [("2s", 2), ("2", 2), ("15m", 900), ("1h", 3600), ("1d", 86400), (" 3S ", 3)]
)
def test_parse_every(text: str, seconds: int) -> None:
    assert parse_every(text) == seconds


@pytest.mark.parametrize("text", ["0s", "x", "1w", "-2s", ""])
def test_parse_every_refuses(text: str) -> None:
    with pytest.raises(ValidationError):
        parse_every(text)


@pytest.mark.parametrize(
    "kw",
    [
        {"cron": "0 2 * * *", "every_s": 5},  # both
        {},  # neither
        {"cron": "not cron"},
        {"every_s": 5, "output": "out/{day}.jsonl"},  # unknown template field
        {"every_s": 5, "name": "has space"},
        {"every_s": 5, "name": "café"},  # a batch id is ASCII
        {"every_s": 5, "inputs": ()},
    ],
)
def test_spec_refuses(kw: dict) -> None:
    args = {"name": "n", "inputs": ("in/*.jsonl",), "output": "out/{date}.jsonl", **kw}
    with pytest.raises(ValidationError):
        ScheduleSpec(**args)


def _inputs(tmp_path: Path, n: int = 6) -> str:
    (tmp_path / "in").mkdir(exist_ok=True)
    for part in range(2):
        lines = [{"custom_id": f"p{part}-{i}", "model": "laya", "prompt": f"case {part} {i}"} for i in range(n // 2)]
        (tmp_path / "in" / f"part{part}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(tmp_path / "in" / "*.jsonl")


def _spec(tmp_path: Path, **kw) -> ScheduleSpec:
    return ScheduleSpec(
        name="nightly",
        every_s=10,
        inputs=(_inputs(tmp_path),),
        output=str(tmp_path / "out" / "{date}-{time}.jsonl"),
        **kw,
    )


def _join(runner: SlotRunner) -> None:
    for t in runner.threads:
        t.join(timeout=30)
        assert not t.is_alive()


def test_two_schedulers_one_run_per_slot_and_the_export(tmp_path: Path, redis: Redis, client: Client) -> None:
    spec = _spec(tmp_path)
    a = SlotRunner(client, spec, owner="a")
    b = SlotRunner(Client(redis=redis), spec, owner="b")
    for slot in (utc(seconds=10), utc(seconds=20)):
        ran = [b.run(slot), a.run(slot)]
        assert ran == [True, False]  # the first to claim runs it; the other only logs
    assert sorted(m.decode() for m in redis.zrange(Keys().batches(), 0, -1)) == [
        "nightly-20261130T020010Z",
        "nightly-20261130T020020Z",
    ]
    drain(redis, FakeEngine())
    _join(b)
    out = tmp_path / "out" / "2026-11-30-020010.jsonl"
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [r["custom_id"] for r in rows] == [f"p{p}-{i}" for p in range(2) for i in range(3)]  # files sorted
    assert all(r["text"] for r in rows)
    runs = ScheduleState(client, "nightly").runs()
    assert [(r.slot, r.status, r.owner) for r in runs] == [
        ("20261130T020010Z", "exported", "b"),
        ("20261130T020020Z", "exported", "b"),
    ]
    assert runs[0].counts["finished"] == 6
    assert not list(tmp_path.glob("out/.*.tmp"))


def test_missed_slots_are_reported_not_run(tmp_path: Path, redis: Redis, client: Client) -> None:
    spec = _spec(tmp_path)
    a = SlotRunner(client, spec, owner="a")
    assert a.run(utc(seconds=10))
    # The scheduler is down across the slots at :20 and :30; a new one starts at :43.
    b = SlotRunner(client, spec, owner="b")
    b.start(now=utc(seconds=43))
    runs = {r.slot: r for r in ScheduleState(client, "nightly").runs()}
    assert runs["20261130T020020Z"].status == runs["20261130T020030Z"].status == "missed"
    assert "20261130T020040Z" not in runs  # within the start's grace: a live scheduler may be claiming it
    assert redis.zcard(Keys().batches()) == 1  # nothing run late
    b.start(now=utc(seconds=43))  # a second start reports nothing twice
    assert b.run(utc(seconds=50))  # and the schedule goes on; the unclaimed :40 is reported now
    (row,) = overview(client, now=utc(seconds=51))
    assert (row["missed"], row["last_slot"], row["next_slot"]) == (3, "20261130T020050Z", "20261130T020100Z")
    drain(redis, FakeEngine())
    _join(a)
    _join(b)


def test_a_dead_schedulers_unfinished_run_is_taken_over(tmp_path: Path, redis: Redis, client: Client) -> None:
    spec = _spec(tmp_path)
    dead = SlotRunner(client, spec, owner="dead")
    dead.finish = lambda *a: None  # dies before it exports  # type: ignore[method-assign]
    dead._finish_later = lambda *a: None  # type: ignore[method-assign]
    assert dead.run(utc(seconds=10))
    live = SlotRunner(client, spec, owner="live", alive=lambda name: name != "dead")
    other = SlotRunner(client, spec, owner="other", alive=lambda name: name != "dead")
    live.start(now=utc(seconds=12))
    other.start(now=utc(seconds=12))  # the claim moved to `live` already: `other` leaves it
    assert len(live.threads) == 1 and not other.threads
    drain(redis, FakeEngine())
    _join(live)
    (run,) = ScheduleState(client, "nightly").runs()
    assert (run.status, run.owner) == ("exported", "live")
    assert Path(run.output).is_file()


def test_bad_input_fails_the_slot_with_the_file_named(tmp_path: Path, redis: Redis, client: Client) -> None:
    spec = _spec(tmp_path)
    (tmp_path / "in" / "part1.jsonl").write_text('{"custom_id": "p0-0", "model": "laya", "prompt": "dup"}\n')
    runner = SlotRunner(client, spec, owner="a")
    assert runner.run(utc(seconds=10))
    (run,) = ScheduleState(client, "nightly").runs()
    assert run.status == "failed" and "p0-0" in run.error and "part1.jsonl" in run.error
    assert redis.zcard(Keys().batches()) == 0  # nothing submitted
    empty = ScheduleSpec(name="empty", every_s=10, inputs=(str(tmp_path / "none*.jsonl"),), output="o.jsonl")
    SlotRunner(client, empty, owner="a").run(utc(seconds=10))
    (run,) = ScheduleState(client, "empty").runs()
    assert run.status == "no-input"
    (tmp_path / "blank.jsonl").write_text("\n")  # files that match but hold no job: no batch either
    blank = ScheduleSpec(name="blank", every_s=10, inputs=(str(tmp_path / "blank*.jsonl"),), output="o.jsonl")
    SlotRunner(client, blank, owner="a").run(utc(seconds=10))
    (run,) = ScheduleState(client, "blank").runs()
    assert (run.status, run.batch) == ("no-input", None)
    assert redis.zcard(Keys().batches()) == 0


# ---- the real command: RQ's cron scheduler, two of them ------------------------------------------------------
def _scheduler(redis_url: str, tmp_path: Path, log: Path) -> subprocess.Popen[bytes]:
    args = [
        "--every",
        "1s",
        "--input",
        str(tmp_path / "in" / "*.jsonl"),
        "--output",
        str(tmp_path / "out/{slot}.jsonl"),
    ]
    out = log.open("ab")
    return subprocess.Popen(
        [*CLI, "--redis-url", redis_url, "schedule", "--name", "tick", *args], stdout=out, stderr=out
    )


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        assert p.wait(timeout=20) == 0


def test_schedule_command_two_schedulers_restart_and_missed(
    tmp_path: Path, redis: Redis, redis_url: str, client: Client
) -> None:
    _inputs(tmp_path)
    worker = BatchWorker(redis, FakeEngine(), FakeEngine().config, WorkerSettings(idle_poll_s=0.05))
    thread = threading.Thread(target=worker.work, daemon=True)
    thread.start()
    log = tmp_path / "schedulers.log"
    state = ScheduleState(client, "tick")
    try:
        procs = [_scheduler(redis_url, tmp_path, log) for _ in range(2)]
        wait_until(lambda: sum(r.status == "exported" for r in state.runs()) >= 3, timeout_s=60)
        _stop(*procs)
        last = state.last_slot()
        time.sleep(3.5)  # nobody runs the schedule across at least two slots
        (proc,) = [_scheduler(redis_url, tmp_path, log)]
        wait_until(lambda: state.last_slot() > last + timedelta(seconds=3), timeout_s=60)
        wait_until(lambda: state.runs()[-1].status == "exported", timeout_s=30)
        _stop(proc)
    finally:
        worker.request_stop()
        thread.join(timeout=10)
    text = log.read_text()
    runs = state.runs()
    ran = [r for r in runs if r.status != "missed"]
    assert all(r.status == "exported" for r in ran), text
    batches = [m.decode() for m in redis.zrange(Keys().batches(), 0, -1)]
    assert sorted(batches) == sorted(r.batch for r in ran)  # one batch per slot run, whoever ran it
    assert "is run by another scheduler" in text  # both schedulers were up at a slot; one ran it
    missed = [r.slot for r in runs if r.status == "missed"]
    assert len(missed) >= 2, text
    assert all(stamp(last) < s for s in missed)
    for r in ran:
        assert len(Path(r.output).read_bytes().splitlines()) == 6
    listing = subprocess.run([*CLI, "--redis-url", redis_url, "schedule", "--list"], capture_output=True, check=True)
    assert f"tick: every 1 s, last slot {stamp(state.last_slot())}" in listing.stdout.decode()
    assert f"{len(missed)} missed" in listing.stdout.decode()
    # RQ's tools saw the schedulers (registered and gone again) and the cron job they ran
    assert redis.zscore("rq:cron_jobs", "kevlaya-schedule-tick") is not None
    assert redis.zcard("rq:cron_schedulers") == 0


def test_a_redis_outage_does_not_end_the_scheduler(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import socket

    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from producer.cron import scheduler_for

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = Client(redis=Redis(port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)))
    scheduler, _ = scheduler_for(down, _spec(tmp_path))
    (job,) = scheduler.get_jobs()
    job.next_enqueue_time = utc()  # due
    assert scheduler.enqueue_jobs() == [job]  # the slot is logged as not run, and the next one is due next
    assert job.next_enqueue_time > datetime.now(timezone.utc)
    scheduler.heartbeat()
    scheduler.save()
    assert "not run, redis unavailable" in caplog.text and "heartbeat failed" in caplog.text
