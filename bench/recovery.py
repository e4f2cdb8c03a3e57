"""What a crash costs: `kill -9` in the middle of a 256-row take, and a poison job inside one, on the demo
models (2 CPU cores), through real `kevlaya worker` processes restarted under the same --name (as a
supervisor does).

    python -m bench recovery [--rows 256]

Rows: the same 256 Laya jobs drained without a crash (the reference), then with a `kill -9` half-way
through their batch: the restarted worker's time from ready to done against the reference (the issue's
bound is 2x); then 256 jobs with one that kills the worker every time it runs: crashes until it is
dead-lettered (bound: log2(256) + 1 = 9) and whether every other item was answered. The workers run with
the user's defaults except `--max-batch-rows` (named in the row).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from redis import Redis

from producer.client import Client
from worker.recovery import max_crashes
from worker.tools.demo import prepare_models
from worker.tools.demo_data import demo_jobs
from worker.tools.embedded_redis import EmbeddedRedis

CLI = [sys.executable, "-c", "from producer.cli import main; main()"]
DEMO = Path(__file__).resolve().parent.parent / ".kevlaya" / "demo"


def jobs(n: int, poison: int | None = None) -> list[dict[str, Any]]:
    out = []
    for i, job in enumerate(j for j in demo_jobs(4 * n) if j["model"] == "laya" and "choices" not in j):
        if i == n:
            break
        if i == poison:
            job = {**job, "prompt": job["prompt"] + " POISON-PILL"}
        out.append({**job, "escalate": False})
    return out


class Worker:
    def __init__(self, url: str, config: Path, log: Path, rows: int, *extra: str, env: dict | None = None) -> None:
        self.log = log
        self.mark = log.stat().st_size if log.exists() else 0
        args = [*CLI, "--redis-url", url, "worker", "--config", str(config), "--name", "bench-recovery"]
        args += ["--max-batch-rows", str(rows), *extra]
        with log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=out, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout_s: float = 300) -> float:
        """Seconds until the worker logged that it started (its models loaded and warmed up)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if b"started (burst=" in self.log.read_bytes()[self.mark :]:
                return time.monotonic() - start
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; see {self.log}")
            time.sleep(0.05)
        raise TimeoutError("worker did not start")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def wait_complete(client: Client, batch: str, timeout_s: float = 900) -> None:
    start = time.monotonic()
    while not client.status(batch).complete:
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"batch {batch} not complete after {timeout_s} s")
        time.sleep(0.05)


def in_flight(redis: Redis) -> int:
    return sum(redis.zcard(f"rq:wip:kevlaya:{q}") for q in ("kev", "laya", "kev:interactive", "laya:interactive"))


def reference(client: Client, url: str, config: Path, log: Path, rows: int) -> dict[str, float]:
    worker = Worker(url, config, log, rows)
    load_s = worker.wait_ready()
    start = time.monotonic()
    batch = client.submit_batch(jobs(rows)).id
    wait_complete(client, batch)
    work_s = time.monotonic() - start
    worker.stop()
    return {"load_s": load_s, "work_s": work_s}


def killed_mid_batch(client: Client, url: str, config: Path, log: Path, rows: int, work_s: float) -> dict[str, Any]:
    worker = Worker(url, config, log, rows)
    worker.wait_ready()
    batch = client.submit_batch(jobs(rows)).id
    while in_flight(client.redis) < rows:
        time.sleep(0.01)
    time.sleep(work_s / 2)
    worker.kill()
    killed = time.monotonic()
    done_at_kill = client.status(batch).counts.done
    restarted = Worker(url, config, log, rows)
    restarted.wait_ready()
    ready = time.monotonic()
    wait_complete(client, batch)
    finished = time.monotonic()
    restarted.stop()
    rows_out = list(client.iter_results(batch))
    return {
        "answered_before_kill": done_at_kill,
        "recovery_work_s": finished - ready,
        "kill_to_done_s": finished - killed,
        "ratio": (finished - ready) / work_s,
        "all_answered": all(not r.get("pending") and r.get("error") is None for r in rows_out),
    }


def poison(client: Client, url: str, config: Path, log: Path, rows: int) -> dict[str, Any]:
    batch = client.submit_batch(jobs(rows, poison=rows // 3)).id
    env = {"KEVLAYA_FAULT": "crash_on_prompt:POISON-PILL"}
    crashes, start = 0, time.monotonic()
    for _ in range(4 * max_crashes(rows)):
        code = Worker(url, config, log, rows, "--burst", env=env).proc.wait(timeout=900)
        if code == 0:
            break
        crashes += 1
    rows_out = list(client.iter_results(batch))
    errors = [r for r in rows_out if r.get("error")]
    return {
        "crashes": crashes,
        "bound": max_crashes(rows),
        "seconds": time.monotonic() - start,
        "dead_lettered": [r["error"]["type"] for r in errors] == ["worker_died"],
        "others_answered": sum(1 for r in rows_out if not r.get("pending") and not r.get("error")),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench recovery", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--no-results-row", action="store_true")
    args = parser.parse_args(argv)
    config = prepare_models(DEMO)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kevlaya-recovery-") as tmp, EmbeddedRedis() as server:
        log = Path(tmp) / "workers.log"
        redis = Redis.from_url(server.url)
        client = Client(redis=redis)
        ref = reference(client, server.url, config, log, args.rows)
        redis.flushdb()
        kill = killed_mid_batch(client, server.url, config, log, args.rows, ref["work_s"])
        redis.flushdb()
        pill = poison(client, server.url, config, log, args.rows)
    report = {"rows": args.rows, "reference": ref, "kill_mid_batch": kill, "poison": pill}
    print(json.dumps(report, indent=2))
    (out_dir / "recovery.json").write_text(json.dumps(report, indent=2))
    if not args.no_results_row:
        from bench.common import append_results

        append_results(
            f"| recovery | CPU x2 | demo models, {args.rows} Laya jobs, `--max-batch-rows {args.rows}` | "
            f"no crash: {ref['work_s']:.1f} s; `kill -9` half-way through the take: restarted worker done in "
            f"{kill['recovery_work_s']:.1f} s after it was ready ({kill['ratio']:.2f}x; {kill['kill_to_done_s']:.1f} s "
            f"from the kill incl. {ref['load_s']:.1f} s model load), all answered: {kill['all_answered']}; "
            f"poison job: dead-lettered after {pill['crashes']} crashes (bound {pill['bound']}), "
            f"{pill['others_answered']}/{args.rows - 1} others answered | `python -m bench recovery` |",
            out_dir,
        )
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
