"""`kevlaya worker --gpus`: parsing, one child per GPU with the right environment and arguments, signals
forwarded, a crashing child restarted (bounded) or reported; and how workers share a queue's tail. The children
here are cheap fake processes (worker.supervisor.WORKER_CMD swapped): no model, no GPU."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from redis import Redis

from producer.cli import cli
from producer.client import Client
from shared.errors import ConfigError
from shared.keys import Keys, QueueRef
from tests.fakes import FakeEngine
from tests.worker_helpers import wait_until
from worker import supervisor
from worker.cli import worker_command
from worker.loop import BatchWorker
from worker.rqcompat import RQBridge
from worker.settings import WorkerSettings
from worker.supervisor import ChildSpec, Supervisor, SupervisorSettings, parse_gpus
from worker.tail import tail_take

# A fake child: records its arguments and GPU, then behaves as FAKE_MODE says (exit 0 at once; sleep until
# SIGTERM; crash with 3; crash once, then finish).
FAKE_CHILD = r"""
import json, os, signal, sys, time
out = os.environ["FAKE_OUT"]
name = sys.argv[sys.argv.index("--name") + 1] if "--name" in sys.argv else os.environ.get("FAKE_NAME", "child")
starts = os.path.join(out, name + ".starts")
with open(starts, "a") as fh:
    fh.write(f"{os.getpid()}\n")
with open(os.path.join(out, name + ".json"), "w") as fh:
    json.dump({"argv": sys.argv[1:], "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
               "redis_url": os.environ.get("REDIS_URL")}, fh)
mode = os.environ.get("FAKE_MODE", "exit0")
if mode == "crash" or (mode == "crash-once" and len(open(starts).read().split()) == 1):
    sys.exit(3)
if mode == "sleep":
    def stop(signum, frame):
        open(os.path.join(out, name + ".stopped"), "w").write(signal.Signals(signum).name)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        time.sleep(0.05)
"""


@pytest.fixture
def fake_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "fake_child.py"
    script.write_text(FAKE_CHILD)
    monkeypatch.setattr(supervisor, "WORKER_CMD", [sys.executable, str(script)])
    monkeypatch.setattr(supervisor, "cuda_count", lambda: 0)  # GPUs unknown, as on a CPU machine: none refused
    monkeypatch.setenv("FAKE_OUT", str(tmp_path))
    return script


# ---- parsing --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "visible", "count", "gpus"),
    [
        ("all", None, 2, ["0", "1"]),
        ("all", "2,3", 8, ["2", "3"]),  # the parent's CUDA_VISIBLE_DEVICES is what `all` sees
        ("0,1", None, 0, ["0", "1"]),
        (" 1 , 0 ", None, 0, ["1", "0"]),
        ("1", "4,6", 8, ["6"]),  # indices count within CUDA_VISIBLE_DEVICES, as CUDA counts them
        ("GPU-5f2a,GPU-77", None, 0, ["GPU-5f2a", "GPU-77"]),
    ],
)
def test_parse_gpus(text: str, visible: str | None, count: int, gpus: list[str]) -> None:
    assert parse_gpus(text, visible=visible, count=lambda: count) == gpus


@pytest.mark.parametrize(("text", "visible"), [("all", None), ("0,0", None), ("0;1", None), ("", None), ("2", "0,1")])
def test_parse_gpus_refuses(text: str, visible: str | None) -> None:
    with pytest.raises(ConfigError):
        parse_gpus(text, visible=visible, count=lambda: 0)


# ---- the command: one child per GPU ------------------------------------------------------------------------------
def test_gpus_spawns_one_named_worker_per_gpu_with_the_same_options(
    tmp_path: Path, fake_child: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(cli.commands, "worker", worker_command)  # not left on the shared group for later tests
    result = CliRunner().invoke(
        cli,
        [
            "--redis-url", "redis://:p%40ss@localhost:1/0", "--prefix", "kv:",
            "worker", "--config", "models.toml", "--gpus", "0,1", "--name", "box", "--burst",
            "--max-batch-rows", "64", "--notify-allow", "http://a/", "--notify-allow", "http://b/",
            "--metrics-port", "9100", "--no-compile",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    seen = {n: json.loads((tmp_path / f"box-gpu{n}.json").read_text()) for n in ("0", "1")}
    for i, (gpu, child) in enumerate(sorted(seen.items())):
        argv = child["argv"]
        assert child["gpu"] == gpu
        assert child["redis_url"] == "redis://:p%40ss@localhost:1/0"  # by environment, not in argv
        assert not any("p%40ss" in a for a in argv)
        assert argv[:3] == ["--prefix", "kv:", "worker"]
        assert "--gpus" not in argv
        for pair in (["--name", f"box-gpu{gpu}"], ["--device", "cuda"], ["--metrics-port", str(9100 + i)]):
            assert argv[argv.index(pair[0]) : argv.index(pair[0]) + 2] == pair
        assert argv[argv.index("--max-batch-rows") :][:2] == ["--max-batch-rows", "64"]
        assert "--burst" in argv and "--no-compile" in argv and "--no-mixed-tails" not in argv
        assert [argv[i + 1] for i, a in enumerate(argv) if a == "--notify-allow"] == ["http://a/", "http://b/"]
        assert argv[argv.index("--config") + 1] == "models.toml"
        assert argv[argv.index("--max-wait-ms") + 1] == "10000"  # defaults travel too


def test_gpus_refuses_a_device(fake_child: Path) -> None:
    result = CliRunner().invoke(worker_command, ["--config", "m.toml", "--gpus", "0", "--device", "cuda:1"])
    assert result.exit_code != 0 and "--gpus picks the devices" in result.output


# ---- the supervisor ----------------------------------------------------------------------------------------------
def _children(tmp_path: Path, modes: dict[str, str], script: Path) -> list[ChildSpec]:
    return [
        ChildSpec(
            gpu=str(i),
            name=name,
            argv=[sys.executable, str(script), "--name", name],
            env={"FAKE_MODE": mode, "FAKE_OUT": str(tmp_path)},
        )
        for i, (name, mode) in enumerate(modes.items())
    ]


def _starts(tmp_path: Path, name: str) -> int:
    path = tmp_path / f"{name}.starts"
    return len(path.read_text().split()) if path.exists() else 0


FAST = SupervisorSettings(max_restarts=2, restart_window_s=60, restart_delay_s=0.05, poll_s=0.02)


def test_a_crashing_child_is_restarted_then_reported_and_the_others_stopped(
    tmp_path: Path, fake_child: Path, caplog: pytest.LogCaptureFixture
) -> None:
    children = _children(tmp_path, {"bad": "crash", "good": "sleep"}, fake_child)
    rc = Supervisor(children, FAST).run()
    assert rc == 3  # the failed child's exit status
    assert _starts(tmp_path, "bad") == 3  # the first start and two restarts
    assert (tmp_path / "good.stopped").read_text() == "SIGTERM"  # asked to finish its batch, not killed
    assert "worker bad (GPU 0) failed permanently (exit 3)" in caplog.text
    assert "restart 2/2" in caplog.text


def test_a_child_that_crashed_once_is_restarted_and_finishes(tmp_path: Path, fake_child: Path) -> None:
    children = _children(tmp_path, {"flaky": "crash-once", "ok": "exit0"}, fake_child)
    assert Supervisor(children, FAST).run() == 0
    assert (_starts(tmp_path, "flaky"), _starts(tmp_path, "ok")) == (2, 1)  # exit 0 is not restarted


PARENT = r"""
import sys
from worker.supervisor import ChildSpec, Supervisor, SupervisorSettings
out, script = sys.argv[1], sys.argv[2]
children = [ChildSpec(gpu=str(i), name=f"w{i}", argv=[sys.executable, script, "--name", f"w{i}"],
                      env={"FAKE_MODE": "sleep", "FAKE_OUT": out}) for i in range(3)]
sys.exit(Supervisor(children, SupervisorSettings(poll_s=0.02)).run())
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_parent_ends_every_child(tmp_path: Path, fake_child: Path, sig: signal.Signals) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), str(fake_child)])
    try:
        wait_until(lambda: all(_starts(tmp_path, f"w{i}") for i in range(3)), timeout_s=30)
        time.sleep(0.3)  # the children's handlers are installed
        pids = [int((tmp_path / f"w{i}.starts").read_text().split()[0]) for i in range(3)]
        parent.send_signal(sig)
        assert parent.wait(timeout=30) == 0
    finally:
        parent.kill()
    for i, pid in enumerate(pids):
        assert (tmp_path / f"w{i}.stopped").read_text() == sig.name  # forwarded once
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_children_die_with_a_killed_parent(tmp_path: Path, fake_child: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path), str(fake_child)])
    wait_until(lambda: all(_starts(tmp_path, f"w{i}") for i in range(3)), timeout_s=30)
    time.sleep(0.3)
    parent.kill()
    parent.wait()
    wait_until(lambda: all((tmp_path / f"w{i}.stopped").exists() for i in range(3)), timeout_s=10)


# ---- sharing the tail --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("capacity", "depth", "idle_peers", "take"),
    [
        (256, 4000, 1, 256),  # plenty for everyone: full takes
        (256, 512, 1, 256),
        (256, 300, 1, 150),  # two about to take: half each
        (256, 300, 0, 256),  # the peer is busy: take what fits, the peer takes the rest when free
        (256, 301, 2, 101),
        (256, 1, 3, 1),
        (256, 0, 1, 1),
        (0, 50, 1, 0),  # capacity unknown: unchanged
    ],
)
def test_tail_take(capacity: int, depth: int, idle_peers: int, take: int) -> None:
    assert tail_take(capacity, depth, idle_peers=idle_peers) == take


LAYA = QueueRef("laya")


def _presence(redis: Redis, *, idle: list[str], live: list[str], stale: tuple[str, ...] = ()) -> None:
    """The live set (heartbeats) and the idle set as workers leave them; `stale` ones are idle with an old beat."""
    keys, now = Keys(), time.time()
    redis.delete(keys.workers(), keys.idle_workers())
    redis.zadd(keys.workers(), {name: now for name in live} | {name: now - 3600 for name in stale})
    if idle or stale:
        redis.zadd(keys.idle_workers(), {name: now for name in [*idle, *stale]})


def _queue(redis: Redis, bridge: RQBridge, depth: int) -> None:
    redis.delete(bridge.queues[LAYA].key, bridge.started[LAYA].key)
    if depth:
        redis.rpush(bridge.queues[LAYA].key, *[f"j{i}" for i in range(depth)])


def test_the_take_script_shares_as_tail_take_does(redis: Redis) -> None:
    """The take script's share (Lua) is worker.tail's rule, over a grid; peers count when idle and live, never this
    worker itself, a busy one or one whose heartbeat is stale; a take that got rows leaves the idle set."""
    bridge = RQBridge(redis, Keys(), ["laya"], "me")
    depths = [*range(34), 99, 100, 101, 255, 256, 257, 511, 512, 513, 767, 768, 769, 1024, 1025]
    for capacity, depth, idle_peers in itertools.product((0, 1, 2, 3, 5, 16, 256), depths, range(5)):
        peers = [f"p{i}" for i in range(idle_peers)]
        _presence(redis, idle=["me", *peers], live=["me", "busy", *peers], stale=("gone",))
        _queue(redis, bridge, depth)
        shared = bridge.take_share(LAYA, capacity, ttl_s=30, live_s=60)
        expected = tail_take(capacity, depth, idle_peers=idle_peers)
        assert shared.limit == expected, (capacity, depth, idle_peers)
        assert len(shared.ids) == max(0, min(expected, depth)), (capacity, depth, idle_peers)
        assert (redis.zscore(Keys().idle_workers(), "me") is None) == bool(shared.ids)


def test_a_take_right_after_a_peers_take_gets_the_other_half(redis: Redis) -> None:
    """Two idle workers, 100 jobs: the first take is 50 and leaves the idle set in the same step, so the second,
    even one that looked at the queue before the first took, finds 50 left and no idle peer, and takes them all
    (deciding before the take, it counted the first worker idle still and took 25)."""
    w0, w1 = RQBridge(redis, Keys(), ["laya"], "w0"), RQBridge(redis, Keys(), ["laya"], "w1")
    _presence(redis, idle=["w0", "w1"], live=["w0", "w1"])
    _queue(redis, w0, 100)
    first = w0.take_share(LAYA, 256, ttl_s=30, live_s=60)
    second = w1.take_share(LAYA, 256, ttl_s=30, live_s=60)
    assert (len(first.ids), len(second.ids)) == (50, 50)
    assert redis.zcard(Keys().idle_workers()) == 0


def test_every_take_with_rows_leaves_the_idle_set(redis: Redis) -> None:
    bridge = RQBridge(redis, Keys(), ["laya"], "me")
    _presence(redis, idle=["me"], live=["me"])
    assert bridge.take(LAYA, 5, ttl_s=30) == []  # nothing to take: still idle
    assert redis.zscore(Keys().idle_workers(), "me") is not None
    redis.rpush(Keys().suspects("laya"), orjson.dumps({"ids": ["s1"]}))
    assert bridge.take_group(LAYA, ttl_s=30) is not None
    assert redis.zscore(Keys().idle_workers(), "me") is None


def test_an_idle_set_of_another_type_only_turns_sharing_off(redis: Redis) -> None:
    bridge = RQBridge(redis, Keys(), ["laya"], "me")
    _presence(redis, idle=[], live=["me", "peer"])
    redis.set(Keys().idle_workers(), "not a sorted set")
    _queue(redis, bridge, 100)
    shared = bridge.take_share(LAYA, 256, ttl_s=30, live_s=60)
    assert (shared.limit, len(shared.ids)) == (256, 100)
    assert redis.get(Keys().idle_workers()) == b"not a sorted set"


class SlowEngine(FakeEngine):
    def run(self, jobs, *, time_limit_s=None):
        time.sleep(0.3)
        return super().run(jobs, time_limit_s=time_limit_s)


def test_two_idle_workers_split_a_small_batch(redis: Redis, client: Client) -> None:
    engines = [SlowEngine(rows=256), SlowEngine(rows=256)]
    workers = [
        BatchWorker(redis, e, e.config, WorkerSettings(name=f"w{i}", idle_poll_s=0.02)) for i, e in enumerate(engines)
    ]
    threads = [threading.Thread(target=w.work, daemon=True) for w in workers]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: all(w.ready.is_set() for w in workers), timeout_s=20)
        jobs = [{"custom_id": f"j{i}", "model": "laya", "prompt": f"case {i}", "escalate": False} for i in range(100)]
        handle = client.submit_batch(jobs)
        wait_until(lambda: client.status(handle.id).complete, timeout_s=30)
    finally:
        for w in workers:
            w.request_stop()
        for t in threads:
            t.join(timeout=10)
    sizes = sorted(len(c) for e in engines for c in e.calls)
    assert sizes == [50, 50], sizes  # one take each, not 100 on one worker while the other waits
