"""Soak: jobs submitted in waves while workers are killed and Redis is killed and restarted at random.

    python -m bench soak                         # 10,000 jobs, >= 10 minutes, faults every 5-30 s
    python -m bench soak --jobs 300 --duration-s 25 --faults-every 3,8   # the CI-sized version

Two supervised worker processes (restarted when they die, as systemd or compose would, with the same
--name) drain the queues on tiny models in takes of up to --batch-rows; Redis runs with AOF (appendfsync
always). The faults, at random: a worker `kill -9` at any instant, a `kill -9` in the middle of a large
take (once the started registry holds half a take), Redis killed and restarted; and, all along, hostile
writes into every key a producer can write (garbage ids, wrong-typed job keys, garbage registry members
and fields), and every wave submitted by three concurrent producers into the same batch id. At the end
every item must have exactly one final result: reports lost items, duplicate final results (second
answers refused), exact counts per batch, crash loops (a worker that exited without being killed), and the
worst recovery time (a fault until the next finished item).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis as redis_lib
from redis import Redis

from producer.client import Client
from shared.keys import Keys
from worker.tools.embedded_redis import EmbeddedRedis

CACHE = Path(__file__).resolve().parent.parent / ".kevlaya" / "soak-models"
CLI = [sys.executable, "-c", "from producer.cli import main; main()"]


class Supervisor:
    """Keeps `n` worker processes running; restarts any that exit, under the same --name."""

    def __init__(self, url: str, config: Path, n: int, log: Path, batch_rows: int) -> None:
        self.url, self.config, self.log, self.batch_rows = url, config, log, batch_rows
        self.procs: list[subprocess.Popen[bytes]] = [self._spawn(i) for i in range(n)]
        self.restarts = 0
        self.unexpected_exits = 0  # exits we did not cause: a crash loop would show here
        self._killed: set[int] = set()

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        args = ["--redis-url", self.url, "worker", "--config", str(self.config), "--job-heartbeat-ttl-s", "2"]
        args += ["--max-batch-rows", str(self.batch_rows), "--log-level", "warning", "--name", f"soak-{i}"]
        with self.log.open("ab") as out:
            return subprocess.Popen([*CLI, *args], stdout=out, stderr=out)

    def tick(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                if proc.pid not in self._killed:
                    self.unexpected_exits += 1
                self.procs[i] = self._spawn(i)
                self.restarts += 1

    def kill_one(self, rng: random.Random) -> None:
        proc = rng.choice(self.procs)
        self._killed.add(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def in_flight(redis: Redis) -> int:
    return sum(redis.zcard(f"rq:wip:kevlaya:{q}") for q in ("kev", "laya", "kev:interactive", "laya:interactive"))


def kill_mid_batch(redis: Redis, sup: Supervisor, rng: random.Random, rows: int) -> bool:
    """Wait (up to 10 s) until half a large take is running, then kill a worker. False if none came."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if in_flight(redis) >= rows // 2:
                time.sleep(rng.uniform(0.0, 0.5))
                sup.kill_one(rng)
                return True
        except redis_lib.exceptions.RedisError:
            return False
        time.sleep(0.05)
    return False


def hostile_writes(redis: Redis, rng: random.Random) -> int:
    """A few writes a producer's ACL allows, of garbage: the workers must quarantine them and go on."""
    made = 0
    for _ in range(rng.randrange(1, 5)):
        fake = f"hz{rng.randrange(10**9)}"
        queue = f"rq:queue:kevlaya:{rng.choice(['kev', 'laya'])}"
        kind = rng.randrange(5)
        if kind == 0:
            redis.rpush(queue, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16))))
        elif kind == 1:
            redis.rpush(f"rq:job:{fake}", "x")
            redis.rpush(queue, fake)
        elif kind == 2:
            redis.hset(f"rq:job:{fake}", mapping={"data": os.urandom(12), "kevlaya_attempts": os.urandom(3)})
            redis.rpush(queue, fake)
        elif kind == 3:
            queued = redis.lrange(queue, 0, 20)
            if queued:
                redis.hset(b"rq:job:" + rng.choice(queued), "kevlaya_attempts", os.urandom(4))
        else:
            redis.rpush(queue, fake)  # an id with no job behind it
        made += 1
    return made


def submit_concurrently(client: Client, items: list[dict], batch: str, producers: int = 3) -> None:
    """The same wave from several producers at once, into one batch id: each item must count once."""
    errors: list[BaseException] = []

    def one() -> None:
        try:
            Client(redis=Redis(connection_pool=client.redis.connection_pool)).submit_batch(items, batch_id=batch)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(errors) == producers:
        raise errors[0]


def done_count(client: Client, batches: list[str]) -> int | None:
    try:
        return sum(client.status(b).counts.done for b in batches)
    except redis_lib.exceptions.RedisError:
        return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--waves", type=int, default=10)
    parser.add_argument("--duration-s", type=float, default=600.0, help="minimum length of the chaos phase")
    parser.add_argument("--faults-every", default="5,30", help="seconds between faults: min,max")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-rows", type=int, default=256, help="the workers' --max-batch-rows")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--no-results-row", action="store_true")
    args = parser.parse_args(argv)
    from worker.tools.tinymodel import build_tiny_set

    config = build_tiny_set(CACHE, quantization="none")
    lo, hi = (float(x) for x in args.faults_every.split(","))
    rng = random.Random(args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kevlaya-soak-") as tmp:
        server = EmbeddedRedis(aof=True, folder=Path(tmp) / "redis")
        server.start()
        client = Client(redis=Redis.from_url(server.url, socket_timeout=5))
        sup = Supervisor(server.url, config, args.workers, Path(tmp) / "workers.log", args.batch_rows)
        report = _chaos(args, rng, lo, hi, server, client, sup)
        sup.stop()
        report |= _verify(client, report.pop("batches"))
        server.stop()
    report["seconds"] = round(report["seconds"], 1)
    print(json.dumps(report, indent=2))
    (out_dir / "soak.json").write_text(json.dumps(report, indent=2))
    if not args.no_results_row:
        from bench.common import append_results

        append_results(
            f"| soak | CPU x2 | tiny models, takes <= {args.batch_rows} | {report['jobs']} jobs over "
            f"{report['seconds']:.0f} s: {report['worker_kills']} worker kills ({report['mid_batch_kills']} mid-take), "
            f"{report['redis_restarts']} Redis kill+restarts, {report['hostile_writes']} hostile writes, every wave "
            f"submitted by 3 concurrent producers; lost {report['lost']}, duplicate final results "
            f"{report['duplicate_final_results']}, count mismatches {report['count_mismatches']}, crash loops "
            f"{report['unexpected_exits']}, worst recovery {report['worst_recovery_s']:.1f} s "
            "| `python -m bench soak` |",
            out_dir,
        )
    return report


def _chaos(
    args: argparse.Namespace,
    rng: random.Random,
    lo: float,
    hi: float,
    server: EmbeddedRedis,
    client: Client,
    sup: Supervisor,
) -> dict[str, Any]:
    per_wave = args.jobs // args.waves
    wave_every = args.duration_s / args.waves
    batches: list[str] = []
    sizes: dict[str, int] = {}
    kills = restarts = mid_batch = hostile = 0
    recoveries: list[float] = []
    pending_fault: float | None = None
    last_done = 0
    start = time.monotonic()
    next_fault = start + rng.uniform(lo, hi)
    next_wave = start
    submitted = 0
    while True:
        now = time.monotonic()
        if submitted < args.jobs and now >= next_wave:
            items = [
                {"custom_id": f"w{len(batches)}-{i}", "model": "kev" if i % 4 == 0 else "laya", "prompt": f"case {i}",
                 "max_new_tokens": 8, "escalate": 1.0 if i % 10 == 1 else False}
                for i in range(min(per_wave, args.jobs - submitted))
            ]  # fmt: skip
            batch = f"soak{len(batches)}"
            try:
                submit_concurrently(client, items, batch)
                batches.append(batch)
                sizes[batch] = len(items)
                submitted += len(items)
                next_wave = now + wave_every
            except redis_lib.exceptions.RedisError:
                pass  # Redis is down: submit this wave (again, into the same batch) when it is back
        if now >= next_fault:
            roll = rng.random()
            if roll < 0.25:
                sup.kill_one(rng)
                kills += 1
            elif roll < 0.5:
                hit = kill_mid_batch(client.redis, sup, rng, args.batch_rows)
                kills += hit
                mid_batch += hit
            else:
                server.kill()
                time.sleep(rng.uniform(0.2, 2.0))
                server.start()
                restarts += 1
            outstanding = done_count(client, batches)
            if outstanding is None or outstanding < submitted:
                pending_fault = pending_fault or now  # recovery is measured only while work is waiting
            next_fault = now + rng.uniform(lo, hi)
        with contextlib.suppress(redis_lib.exceptions.RedisError):
            hostile += hostile_writes(client.redis, rng) if rng.random() < 0.3 else 0
        sup.tick()
        done = done_count(client, batches)
        if done is not None and done >= submitted and submitted < args.jobs:
            pending_fault = None  # idle until the next wave: nothing to recover
        if done is not None and done > last_done:
            if pending_fault is not None:
                recoveries.append(time.monotonic() - pending_fault)
                pending_fault = None
            last_done = done
        if submitted >= args.jobs and done == submitted and now - start >= args.duration_s:
            break
        if now - start > args.duration_s * 3 + 300:
            break  # give up: the verification below reports what was lost
        time.sleep(0.2)
    return {
        "jobs": submitted,
        "batches": sizes,
        "worker_kills": kills,
        "mid_batch_kills": mid_batch,
        "hostile_writes": hostile,
        "unexpected_exits": sup.unexpected_exits,
        "redis_restarts": restarts,
        "worker_restarts": sup.restarts,
        "worst_recovery_s": max(recoveries, default=0.0),
        "seconds": time.monotonic() - start,
    }


def _verify(client: Client, batches: dict[str, int]) -> dict[str, Any]:
    lost = finals = errors = mismatches = 0
    for batch, size in batches.items():
        rows = list(client.iter_results(batch))
        for row in rows:
            if row.get("pending"):
                lost += 1
            else:
                finals += 1
                errors += row.get("error") is not None
        counts = client.status(batch).counts
        results = client.redis.hlen(client.keys.batch_results(batch))
        mismatches += (len(rows), counts.total, results, counts.done) != (size, size, size, size)
    dup = int(client.redis.get(Keys().counter("duplicate_final_results")) or 0)
    quarantined = int(client.redis.get(Keys().counter("quarantined")) or 0)
    return {
        "lost": lost,
        "final_results": finals,
        "error_results": errors,
        "duplicate_final_results": dup,
        "count_mismatches": mismatches,
        "quarantined": quarantined,
    }


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    threading.excepthook = lambda a: None
    main()
