"""The fault matrix: workers killed at random points, Redis killed and restarted (AOF) or unreachable,
connections dropped, a poison job, a hung generation, duplicates, hostile input and hostile writers.
Every submitted item must end with exactly one final result or one clear error."""

from __future__ import annotations

import pickle
import random
import signal
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import redis as redis_lib
from click.testing import CliRunner
from redis import Redis

from producer.cli import cli
from producer.client import Client
from shared.acl import producer_acl_rules
from shared.errors import RedisUnavailableError
from shared.keys import Keys, job_id
from tests.conftest import tiny_config
from tests.tcp_proxy import DropProxy
from tests.worker_helpers import assert_each_item_answered_once, spawn_worker, wait_until
from worker.engine import Engine
from worker.faults import CRASH_EXIT_CODE
from worker.loop import BatchWorker
from worker.recovery import max_crashes
from worker.settings import WorkerSettings
from worker.tools.embedded_redis import EmbeddedRedis

FAST = ["--job-heartbeat-ttl-s", "2", "--max-batch-rows", "25"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(aof=True, folder=tmp_path / "redis") as srv:
        yield srv


def worker(url: str, config: Path, *args: str, env: dict[str, str] | None = None, log: Path | None = None):
    return spawn_worker(url, config, *FAST, *args, env=env, log=log)


def items(n: int, prefix: str = "j") -> list[dict]:
    return [
        {"custom_id": f"{prefix}{i}", "model": "kev" if i % 3 == 0 else "laya", "prompt": f"case {i}"} for i in range(n)
    ]


def complete(client: Client, batch: str) -> bool:
    try:
        return client.status(batch).complete
    except RedisUnavailableError:  # Redis restarting
        return False


def no_duplicates(r: Redis) -> None:
    assert int(r.get(Keys().counter("duplicate_final_results")) or 0) == 0


def test_worker_killed_20_times_at_random_points(server: EmbeddedRedis, nf4_config: Path, tmp_path: Path) -> None:
    r = Redis.from_url(server.url)
    client = Client(redis=r)
    handle = client.submit_batch(items(400), escalate=False)
    rng = random.Random(7)
    kills = 0
    for _ in range(20):
        proc = worker(server.url, nf4_config, log=tmp_path / "w.log")
        time.sleep(rng.uniform(0.5, 4.0))  # during model load, mid-batch, or while finalising
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    killed_at = time.monotonic()
    assert worker(server.url, nf4_config, "--burst", log=tmp_path / "w.log").wait(timeout=300) == 0
    print(f"20 kills; all items final {time.monotonic() - killed_at:.1f} s after the last one")
    assert kills == 20
    assert_each_item_answered_once(client, r, handle.id, 400)
    assert client.status(handle.id).counts.finished == 400
    no_duplicates(r)


def test_redis_killed_and_restarted_mid_batch(server: EmbeddedRedis, nf4_config: Path, tmp_path: Path) -> None:
    r = Redis.from_url(server.url)
    client = Client(redis=r)
    handle = client.submit_batch(items(300), escalate=False)
    proc = worker(server.url, nf4_config, log=tmp_path / "w.log")
    wait_until(lambda: client.status(handle.id).counts.done >= 25, 120)
    server.kill()  # SIGKILL: what is on disk is what AOF (appendfsync always) wrote
    time.sleep(1.5)
    server.start()
    wait_until(lambda: complete(client, handle.id), 180, poll_s=0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert_each_item_answered_once(client, r, handle.id, 300)
    no_duplicates(r)


def test_redis_down_when_the_worker_starts(tmp_path: Path, nf4_config: Path) -> None:
    srv = EmbeddedRedis(aof=True, folder=tmp_path / "redis")
    proc = worker(srv.url, nf4_config, log=tmp_path / "w.log")
    time.sleep(4)  # the worker loads its model, then waits for Redis with backoff
    assert proc.poll() is None
    srv.start()
    try:
        client = Client(redis_url=srv.url)
        handle = client.submit_batch(items(30), escalate=False)
        wait_until(lambda: complete(client, handle.id), 120, poll_s=0.3)
        assert_each_item_answered_once(client, client.redis, handle.id, 30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        srv.stop()


def test_dropped_connections_recover_by_themselves(server: EmbeddedRedis, nf4_config: Path, tmp_path: Path) -> None:
    proxy = DropProxy(server.port)
    url = f"redis://127.0.0.1:{proxy.port}/0"
    r = Redis.from_url(server.url)
    client = Client(redis=r)
    handle = client.submit_batch(items(300), escalate=False)
    proc = worker(url, nf4_config, log=tmp_path / "w.log")
    try:
        wait_until(lambda: client.status(handle.id).counts.done >= 25, 120)
        for _ in range(5):
            proxy.drop_all()
            time.sleep(0.7)
        wait_until(lambda: complete(client, handle.id), 180, poll_s=0.3)
        drops = proxy.drops
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        proxy.close()
    assert drops == 5
    assert_each_item_answered_once(client, r, handle.id, 300)
    no_duplicates(r)


def test_poison_job_is_dead_lettered_and_its_batch_mates_finish(
    server: EmbeddedRedis, nf4_config: Path, tmp_path: Path
) -> None:
    r = Redis.from_url(server.url)
    client = Client(redis=r)
    jobs = items(20)
    jobs[7] = {"custom_id": "poison", "model": "laya", "prompt": "case POISON-PILL"}
    handle = client.submit_batch(jobs, escalate=False)
    env = {"KEVLAYA_FAULT": "crash_on_prompt:POISON-PILL"}
    crashes = 0
    for _ in range(12):  # a supervisor restarting the worker, as systemd or compose would
        proc = worker(server.url, nf4_config, "--burst", "--max-batch-rows", "4", env=env, log=tmp_path / "w.log")
        code = proc.wait(timeout=120)
        if code == 0:
            break
        assert code == CRASH_EXIT_CODE
        crashes += 1
    # Its take of 4 rows is halved on every crash; alone, it kills the worker once more: no crash loop.
    assert crashes == max_crashes(4) == 3
    rows = {row["custom_id"]: row for row in assert_each_item_answered_once(client, r, handle.id, 20)}
    assert rows["poison"]["error"]["type"] == "worker_died"
    assert f"({crashes} crashes)" in rows["poison"]["error"]["message"]
    assert all(row.get("error") is None for cid, row in rows.items() if cid != "poison")
    assert job_id(handle.id, "poison") in client.queue("laya").failed_job_registry.get_job_ids()
    no_duplicates(r)


def test_hung_generation_times_out_and_the_worker_stays_healthy(tiny_models: Path, redis: Redis) -> None:
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu")
    lm_head = engine.base_for("kev").model.get_output_embeddings()
    handle = lm_head.register_forward_pre_hook(lambda *_: time.sleep(0.05))  # every decode step crawls
    client = Client(redis=redis)
    slow = client.submit_batch(
        [{"custom_id": f"s{i}", "model": "kev", "prompt": "p"} for i in range(3)], escalate=False
    )
    settings = WorkerSettings(burst=True, batch_time_limit_s=0.5)
    BatchWorker(redis, engine, engine.config, settings).work()
    handle.remove()
    rows = list(client.iter_results(slow.id))
    assert [row["error"]["type"] for row in rows] == ["timeout"] * 3
    healthy = client.submit_batch([{"custom_id": "ok", "model": "kev", "prompt": "p"}], escalate=False)
    BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, batch_time_limit_s=60)).work()
    (row,) = client.iter_results(healthy.id)
    assert row.get("error") is None and row["text"] is not None


def test_duplicates_give_one_final_result_per_item(tiny_models: Path, redis: Redis) -> None:
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu")
    client = Client(redis=redis)
    jobs = [{"custom_id": f"d{i}", "model": "laya", "prompt": f"p{i}", "escalate": 1.0} for i in range(5)]
    first = client.submit_batch(jobs)
    again = client.submit_batch(jobs, batch_id=first.id)  # the same submission twice
    assert again.enqueued == 0
    BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True)).work()
    # A retried Laya job (as after a crash) must not enqueue a second follow-up or a second answer.
    laya = client.queue("laya")
    redis.lpush(laya.key, job_id(first.id, "d0"))
    BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True)).work()
    assert client.queue("kev").count == 0
    rows = assert_each_item_answered_once(client, redis, first.id, 5)
    assert all(row["model"] == "kev" and len(row["chain"]) == 1 for row in rows)
    no_duplicates(redis)


def test_hostile_writers_and_inputs_are_refused(tiny_models: Path, redis: Redis, tmp_path: Path) -> None:
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu")
    client = Client(redis=redis)
    handle = client.submit_batch(items(4), escalate=False)
    laya = client.queue("laya")
    sentinel = tmp_path / "pwned"
    pickled = pickle.dumps(("os.system", None, (f"touch {sentinel}",), {}))
    redis.hset("rq:job:pickled", mapping={"data": zlib.compress(pickled), "status": "queued"})
    huge = {"custom_id": "huge", "model": "laya", "prompt": "x" * (1 << 20), "batch": handle.id}
    data = zlib.compress(orjson.dumps(["worker.jobs.run_decision", None, [huge], {}]))
    redis.hset("rq:job:huge", mapping={"data": data, "status": "queued"})
    redis.rpush(laya.key, "pickled", "huge")
    BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True)).work()
    assert not sentinel.exists()
    failed = set(laya.failed_job_registry.get_job_ids())
    assert {"pickled", "huge"} <= failed
    assert b"pickled" in zlib.decompress(redis.hget("rq:job:pickled", "exc_info"))
    assert b"65536" in zlib.decompress(redis.hget("rq:job:huge", "exc_info"))
    rows = assert_each_item_answered_once(client, redis, handle.id, 4)
    assert all(row.get("error") is None for row in rows)


def test_a_10_mb_line_is_refused_by_submit(redis_url: str, redis: Redis) -> None:
    line = orjson.dumps({"custom_id": "big", "model": "laya", "prompt": "y" * (10 << 20)}) + b"\n"
    result = CliRunner().invoke(cli, ["--redis-url", redis_url, "submit", "-"], input=line)
    assert result.exit_code == 1
    assert "line 1: 'prompt' is 10485760 bytes; the limit is 65536 bytes" in result.stderr
    assert redis.dbsize() == 0


def test_producer_acl_user_can_submit_follow_and_cancel_but_not_touch_worker_state(
    server: EmbeddedRedis, tiny_models: Path
) -> None:
    admin = Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "producer", *producer_acl_rules("producer-secret"))
    url = f"redis://producer:producer-secret@127.0.0.1:{server.port}/0"
    client = Client(redis_url=url)
    handle = client.submit_batch(items(3), escalate=False)
    assert client.status(handle.id).counts.total == 3
    queues = client.overview()["queues"]
    assert (queues["kev"]["bulk"]["queued"], queues["laya"]["bulk"]["queued"]) == (1, 2)
    admin.set("rq:queue:kevlaya:kev:x", "1")
    other = client.submit_batch(items(2, "o"), escalate=False)
    assert client.cancel(handle.id) == 3
    assert len(list(client.iter_results(handle.id))) == 3
    conn = client.redis
    for command in (("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "appendonly", "no"), ("SHUTDOWN",)):
        with pytest.raises(redis_lib.exceptions.NoPermissionError):
            conn.execute_command(*command)
    with pytest.raises(redis_lib.exceptions.NoPermissionError):
        conn.publish("rq:pubsub:some-worker", '{"command": "shutdown"}')  # RQ's worker commands
    with pytest.raises(redis_lib.exceptions.ResponseError, match="can't run this command"):
        conn.eval("return redis.call('FLUSHALL')", 0)  # not through a script either
    for key in ("rq:wip:kevlaya:laya", "rq:finished:kevlaya:laya", "rq:failed:kevlaya:kev", "rq:workers"):
        with pytest.raises(redis_lib.exceptions.NoPermissionError):
            conn.zadd(key, {"forged:w.x.1": 1})
    for key in ("rq:worker:w1", "kevlaya:w:worker:w1:stats"):
        with pytest.raises(redis_lib.exceptions.NoPermissionError):
            conn.hset(key, "death", "x")
    for key in ("kevlaya:w:suspects:laya", "kevlaya:w:counter:duplicate_final_results"):
        with pytest.raises(redis_lib.exceptions.NoPermissionError):
            conn.lpush(key, "x")
    # A worker (admin credentials) answers what is left; the producer reads the answers.
    engine = Engine(tiny_config(tiny_models, "none"), device="cpu")
    BatchWorker(admin, engine, engine.config, WorkerSettings(burst=True)).work()
    assert client.status(other.id).complete
