"""Submit throughput: 10,000 items through the `kevlaya submit` CLI, end to end (parse, validate, enqueue).

    python bench/submit.py [--n 10000] [--redis-url redis://127.0.0.1:6379/14]

Uses its own Redis database (default 14) and flushes it before and after.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
from redis import Redis


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    redis = Redis.from_url(args.redis_url)
    redis.flushdb()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "items.jsonl"
        with path.open("wb") as fh:
            for i in range(args.n):
                model = "kev" if i % 4 == 0 else "laya"
                prompt = f"Applicant {i} asks for a loan of {1000 + i} with income {30000 + 7 * i}. Approve?"
                fh.write(orjson.dumps({"custom_id": f"item-{i}", "model": model, "prompt": prompt}) + b"\n")
        cmd = [sys.executable, "-c", "from producer.cli import main; main()", "--redis-url", args.redis_url]
        start = time.perf_counter()
        batch = subprocess.run([*cmd, "submit", str(path)], check=True, capture_output=True, text=True).stdout.strip()
        elapsed = time.perf_counter() - start
    queued = sum(Redis.from_url(args.redis_url).llen(f"rq:queue:kevlaya:{m}") for m in ("kev", "laya"))
    assert queued == args.n, f"expected {args.n} queued jobs, found {queued}"
    print(f"submit {args.n} items via CLI (process start included): {elapsed:.2f} s = {args.n / elapsed:,.0f} jobs/s")
    print(f"batch {batch}")
    redis.flushdb()


if __name__ == "__main__":
    main()
