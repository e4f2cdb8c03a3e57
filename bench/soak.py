"""Soak: jobs submitted in waves while workers are killed and Redis is killed and restarted at random.

    python -m bench soak                         # 10,000 jobs, >= 10 minutes, faults every 5-30 s
    python -m bench soak --jobs 300 --duration-s 25 --faults-every 3,8   # the CI-sized version

Two supervised worker processes (restarted when they die, as systemd or compose would) drain the queues
on tiny models; Redis runs with AOF (appendfsync always). At the end every item must have exactly one
final result: reports lost items, duplicate final results (second answers refused) and the worst recovery
time (a fault until the next finished item).
"""

from __future__ import annotations

import argparse
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
from worker.embedded_redis import EmbeddedRedis

CACHE = Path(__file__).resolve().parent.parent / ".kevlaya" / "soak-models"
CLI = [sys.executable, "-c", "from producer.cli import main; main()"]


class Supervisor:
    """Keeps `n` worker processes running; restarts any that exit."""

    def __init__(self, url: str, config: Path, n: int, log: Path) -> None:
        self.url, self.config, self.log = url, config, log
        self.procs: list[subprocess.Popen[bytes]] = [self._spawn(i) for i in range(n)]
        self.restarts = 0

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        args = ["--redis-url", self.url, "worker", "--config", str(self.config), "--job-heartbeat-ttl-s", "2"]
        args += ["--max-batch-rows", "32", "--log-level", "warning"]
        with self.log.open("ab") as out:
            return subprocess.Popen([*CLI, *args], stdout=out, stderr=out)

    def tick(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                self.procs[i] = self._spawn(i)
                self.restarts += 1

    def kill_one(self, rng: random.Random) -> None:
        proc = rng.choice(self.procs)
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
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--no-results-row", action="store_true")
    args = parser.parse_args(argv)
    from worker.tinymodel import build_tiny_set

    config = build_tiny_set(CACHE, quantization="none")
    lo, hi = (float(x) for x in args.faults_every.split(","))
    rng = random.Random(args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kevlaya-soak-") as tmp:
        server = EmbeddedRedis(aof=True, folder=Path(tmp) / "redis")
        server.start()
        client = Client(redis=Redis.from_url(server.url, socket_timeout=5))
        sup = Supervisor(server.url, config, args.workers, Path(tmp) / "workers.log")
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
            f"| soak | CPU x2 | tiny models | {report['jobs']} jobs over {report['seconds']:.0f} s: "
            f"{report['worker_kills']} worker kills, {report['redis_restarts']} Redis kill+restarts; "
            f"lost {report['lost']}, duplicate final results {report['duplicate_final_results']}, "
            f"worst recovery {report['worst_recovery_s']:.1f} s | `python -m bench soak` |",
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
    kills = restarts = 0
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
            try:
                batches.append(client.submit_batch(items).id)
                submitted += len(items)
                next_wave = now + wave_every
            except redis_lib.exceptions.RedisError:
                pass  # Redis is down: submit this wave when it is back
        if now >= next_fault:
            if rng.random() < 0.5:
                sup.kill_one(rng)
                kills += 1
            else:
                server.kill()
                time.sleep(rng.uniform(0.2, 2.0))
                server.start()
                restarts += 1
            outstanding = done_count(client, batches)
            if outstanding is None or outstanding < submitted:
                pending_fault = pending_fault or now  # recovery is measured only while work is waiting
            next_fault = now + rng.uniform(lo, hi)
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
        "batches": batches,
        "worker_kills": kills,
        "redis_restarts": restarts,
        "worker_restarts": sup.restarts,
        "worst_recovery_s": max(recoveries, default=0.0),
        "seconds": time.monotonic() - start,
    }


def _verify(client: Client, batches: list[str]) -> dict[str, Any]:
    lost = finals = errors = 0
    for batch in batches:
        for row in client.iter_results(batch):
            if row.get("pending"):
                lost += 1
            else:
                finals += 1
                errors += row.get("error") is not None
        results = client.redis.hlen(client.keys.batch_results(batch))
        assert results == client.status(batch).counts.done
    dup = int(client.redis.get(Keys().counter("duplicate_final_results")) or 0)
    return {"lost": lost, "final_results": finals, "error_results": errors, "duplicate_final_results": dup}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    threading.excepthook = lambda a: None
    main()
