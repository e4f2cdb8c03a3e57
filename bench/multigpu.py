"""One worker vs `kevlaya worker --gpus all` on the same Redis, draining the same 4,000-job stream.

    python -m bench multigpu --device cuda               # a host with several GPUs (2x H200: the row)
    python -m bench multigpu --device cpu --scale 0.02   # a smoke run of the plumbing on CPU (--gpus needs CUDA)

The workload is `bench mixed`'s stream: 4,000 Laya jobs of 100-220 words, 25% escalating to Kev, submitted
through the CLI in 8 waves 0.5 s apart; the wall time runs from the first submit to `kevlaya status --wait`
returning. First one `kevlaya worker` (GPU 0), then `kevlaya worker --gpus all` (one child per visible GPU), each
with the worker's defaults (only `--config`, `--redis-url` and, if given, `--memory-budget`), each started and
warmed up before its clock starts; the Redis is flushed between the two. One row in bench/RESULTS.md,
`multigpu/stream`, with both times and the speedup. The workers' logs land in `$OUT/multigpu-<mode>.log`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from redis import Redis

from bench.common import append_results, save_json, write_config
from bench.mixed import NvmlPeak, build_models, run_workload, workloads
from worker.supervisor import WORKER_CMD
from worker.tools.embedded_redis import EmbeddedRedis


def gpu_names() -> list[str]:
    """The GPUs NVML sees (no CUDA context in this process), or [] without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else name)
        return names
    except Exception:
        return []


def start_workers(cmd: list[str], log_path: Path, *, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """Start the worker command; wait until every worker it runs has warmed up and logged `started`."""
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    supervised = "--gpus" in cmd
    while True:
        text = log_path.read_text(errors="replace")
        expected = len(re.findall(r"kevlaya.supervisor: worker \S+ on GPU", text)) if supervised else 1
        if expected and len(re.findall(r"started \(burst=", text)) >= expected:
            return proc, expected
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited: {text[-3000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()  # the supervisor forwards it: every worker finishes its batch and exits
    try:
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench multigpu", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda: the real comparison; cpu: the plumbing only")
    parser.add_argument("--memory-budget", default=None, help="passed to every worker (default: the worker's own)")
    parser.add_argument("--shape", default=None, help="model shape (default: qwen2.5-1.5b on cuda, tiny on cpu)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the stream's 4,000 jobs")
    parser.add_argument("--gpus", default="all", help="what the multi-GPU run passes to --gpus")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = args.shape or ("qwen2.5-1.5b" if args.device.startswith("cuda") else "tiny")
    config = write_config(build_models(shape, args.device), device=args.device, name="multigpu.toml")
    jobs = workloads(args.scale)["stream"]
    names = gpu_names()
    report: dict[str, Any] = {"shape": shape, "budget": args.memory_budget, "gpus": names, "runs": {}}
    modes = {"one": ["--device", args.device]}
    if args.device.startswith("cuda"):
        modes["gpus"] = ["--gpus", args.gpus]
    with EmbeddedRedis() as server:
        for mode, extra in modes.items():
            Redis.from_url(server.url).flushdb()
            cmd = [*WORKER_CMD, "--redis-url", server.url, "worker", "--config", str(config), *extra]
            if args.memory_budget:
                cmd += ["--memory-budget", args.memory_budget]
            env = {**os.environ}
            if mode == "one" and args.device.startswith("cuda") and "CUDA_VISIBLE_DEVICES" not in env:
                env["CUDA_VISIBLE_DEVICES"] = "0"  # one GPU, as a one-GPU host would run it
            log_path = out_dir / f"multigpu-{mode}.log"
            proc, workers = start_workers(cmd, log_path, env=env)
            try:
                peak = NvmlPeak(proc.pid)
                run = run_workload("stream", jobs, redis_url=server.url, out_dir=out_dir, log_path=log_path, peak=peak)
            finally:
                stop(proc)
            report["runs"][mode] = {**run, "workers": workers}
            save_json(out_dir, "multigpu.json", report)
    runs = report["runs"]
    if "gpus" in runs:
        report["speedup"] = round(runs["one"]["wall_s"] / runs["gpus"]["wall_s"], 2)
        append_results(_row(report, args, sys.argv[1:] if argv is None else argv), out_dir)
    save_json(out_dir, "multigpu.json", report)
    print("multigpu:", {k: v["wall_s"] for k, v in runs.items()}, "speedup", report.get("speedup"), flush=True)
    return report


def _row(report: dict[str, Any], args: argparse.Namespace, argv: list[str]) -> str:
    one, many = report["runs"]["one"], report["runs"]["gpus"]
    gpus = report["gpus"]
    hardware = f"{len(gpus)}x {gpus[0].replace('NVIDIA ', '')}" if gpus else args.device
    hardware += f", budget {args.memory_budget or 'GPU total - 512 MiB (worker default)'} per worker"
    model = f"{report['shape']} shape NF4, `kevlaya worker` defaults (+ `--memory-budget` if given)"
    figures = (
        f"{one['items']} stream jobs (25% escalate): 1 worker {one['wall_s']:.1f} s ({one['decisions_per_s']:.0f}/s), "
        f"`--gpus {args.gpus}` ({many['workers']} workers) {many['wall_s']:.1f} s ({many['decisions_per_s']:.0f}/s): "
        f"**{report['speedup']:.2f}x**; {one['oom'] + many['oom']} OOM, {one['errors'] + many['errors']} errors"
    )
    return f"| multigpu/stream | {hardware} | {model} | {figures} | `python -m bench multigpu {' '.join(argv)}` |"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
