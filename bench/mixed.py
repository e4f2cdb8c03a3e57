"""Every job kind the contract allows, through the real CLI path, against one worker with the user's defaults.

    python -m bench mixed --device cuda --memory-budget 6GiB      # Qwen2.5-1.5B shape, NF4, random weights
    python -m bench mixed --device cpu --shape tiny --scale 0.05  # a smoke run on CPU

A separate `kevlaya worker` process (its default settings; only `--config`, `--device`, `--memory-budget`,
`--redis-url` given), then per workload: `kevlaya submit FILE`, `kevlaya status BATCH --wait`,
`kevlaya results BATCH -o FILE`, each a subprocess as a user would run it. Workloads:

- greedy: 600 Laya jobs, prompts of 60-300 words, `truncate: true` (the reference);
- choices: the same prompts with 3 labels to score;
- sampled: 570 greedy + 30 sampled (`temperature` 0.8, a `seed` each);
- kev-long: 200 Kev jobs cut to the 1,024-token input limit (`truncate`), 128 new tokens;
- stream: 4,000 Laya jobs of 100-220 words, 25% escalating to Kev, submitted in 8 waves 0.5 s apart;
- openai: 300 OpenAI Batch lines (chat bodies);
- mixed: 3,000 jobs of all the kinds above, shuffled.

`--set edges` runs shapes beyond those under the seed's limits (Kev answers up to 512 tokens, Laya 64, prompts up
to 1,024 tokens; `EDGE_LIMITS`): 96 Kev jobs asking for 512 new tokens, 400 choice jobs of 2-12 labels (one to
five words) over prompts of 1-1,000 words, 400 Laya jobs half of them sampled (temperature, top_p, top_k mixed),
1,200 Laya jobs of every prompt length and 1-64 new tokens (some with logprobs, escalating by the model's rule or
below 0.5), 3,000 one-word prompts, and 2,000 of all those shuffled. They hold the issue's bar (0 OOM, the peak
within the budget) on shapes no earlier tuning saw.

Per workload: decisions/s (items / wall time from the first submit to `status --wait` returning; beside it the
seconds the worker's batches spent in the engine, the rest being the CLI, Redis and the worker's own work), prompt and
generated tokens/s (from the results' usage), the out-of-memory errors and graph captures the worker logged
meanwhile, the peak GPU memory NVML reported meanwhile (this bench never opens a CUDA context itself: the
models are built in a subprocess; without per-process NVML figures the device's used memory is reported,
labelled so), and, with `--nightly-tokens-per-s`, the ratio to nightly-2000's (prompt + generated) tokens/s.
One row per workload in bench/RESULTS.md, its first cell `mixed/<workload>`; with `--repeat N` the workloads run N
times in turn on the same worker, the later runs' rows `mixed/<workload>#2` and on (a figure asked for "on every
run" is seen across runs, not once).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import append_results, save_json, write_config
from worker.supervisor import WORKER_CMD  # the CLI with the worker command added (the GPU machine runs from source)
from worker.tools.embedded_redis import EmbeddedRedis

# Prompts tokenize like English through a real tokenizer: Qwen2.5's spends about 1.3 tokens a word. The bench
# model's tokenizer has 512 entries, so an ordinary word list split into ~3.9 tokens a word (600 prompts of
# 60-300 words were 417k tokens, not ~140k): these words are one or two of its tokens, 1.28 a word on average
# (tests/test_bench_prompts.py holds that).
WORDS = tuple(
    "loan income debt ratio history clean stable approve reject review applicant earns check decision case year "
    "need information car years debts loans incomes approved lower".split()
)
CHOICES = ["approve", "reject", "review"]
# Labels of one to five words for the edge set's choice jobs (a choice's tokens all run after the prompt).
WIDE_CHOICES = (
    "approve",
    "reject",
    "review",
    "approve with conditions",
    "reject for missing income records",
    "refer the case to a senior review",
    "need more information",
    "approve lower loan",
    "decision",
    "check history and debts",
    "stable",
    "clean",
)
# The seed's limits (Kev answers up to 512 tokens, Laya 64, prompts up to 1,024): the edge set's models.toml.
EDGE_LIMITS = {"kev_new": 512, "laya_new": 64, "max_input_tokens": 1024}
KEVLAYA = [sys.executable, "-c", "import sys; sys.argv[0] = 'kevlaya'; from producer.cli import main; main()"]
MIB = 1024**2


def _prompt(rng: random.Random, i: int, low: int, high: int) -> str:
    return f"Case {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _shuffled(rng: random.Random, pool: list[dict[str, Any]], count: int, prefix: str) -> list[dict[str, Any]]:
    """`count` jobs drawn from `pool` without repeats (all where it holds fewer), each under a new custom id."""
    return [{**job, "custom_id": f"{prefix}{i}"} for i, job in enumerate(rng.sample(pool, min(len(pool), count)))]


def workloads(scale: float, seed: int = 7) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(seed)

    def n(count: int) -> int:
        return max(4, int(count * scale))

    greedy = [
        {"custom_id": f"g{i}", "model": "laya", "prompt": _prompt(rng, i, 60, 300), "truncate": True, "escalate": False}
        for i in range(n(600))
    ]
    choices = [{**job, "custom_id": f"c{i}", "choices": CHOICES} for i, job in enumerate(greedy)]
    sampled = [
        {**job, "custom_id": f"s{i}", **({"temperature": 0.8, "seed": i} if i % 20 == 7 else {})}
        for i, job in enumerate(greedy)
    ]
    kev_long = [
        {"custom_id": f"k{i}", "model": "kev", "prompt": _prompt(rng, i, 900, 1100), "truncate": True}
        for i in range(n(200))
    ]
    stream = [
        {
            "custom_id": f"t{i}",
            "model": "laya",
            "prompt": _prompt(rng, i, 100, 220),
            "truncate": True,
            "escalate": 1.0 if rng.random() < 0.25 else False,  # 1.0: always escalates (a confidence is < 1)
        }
        for i in range(n(4000))
    ]
    openai = [
        {
            "custom_id": f"o{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "laya",
                "messages": [{"role": "user", "content": _prompt(rng, i, 60, 200)}],
                "max_tokens": 16,
            },
        }
        for i in range(n(300))
    ]
    pool = [*greedy, *choices, *sampled, *kev_long, *stream]
    mixed = _shuffled(rng, pool, n(3000), "m")
    return {
        "greedy": greedy,
        "choices": choices,
        "sampled": sampled,
        "kev-long": kev_long,
        "stream": stream,
        "openai": openai,
        "mixed": mixed,
    }


def edge_workloads(scale: float, seed: int = 11) -> dict[str, list[dict[str, Any]]]:
    """Shapes the standard set does not hold, under the seed's limits (`EDGE_LIMITS`): every length the config
    allows, many labels, heavy sampling, one-word prompts, all of them mixed. Each must run with 0 OOM and
    within the budget like the standard ones."""
    rng = random.Random(seed)

    def n(count: int) -> int:
        return max(4, int(count * scale))

    def laya(i: int, prefix: str, low: int, high: int) -> dict[str, Any]:
        return {"custom_id": f"{prefix}{i}", "model": "laya", "prompt": _prompt(rng, i, low, high), "truncate": True}

    kev_max = [
        {**laya(i, "K", 300, 1100), "model": "kev", "max_new_tokens": EDGE_LIMITS["kev_new"], "escalate": False}
        for i in range(n(96))
    ]
    choices_wide = [
        {**laya(i, "W", 1, 1000), "choices": rng.sample(WIDE_CHOICES, rng.randint(2, len(WIDE_CHOICES)))}
        for i in range(n(400))
    ]
    sampled_half = [
        {
            **laya(i, "S", 20, 400),
            **(
                {
                    "temperature": rng.choice((0.3, 0.7, 1.0, 1.5)),
                    "top_p": rng.choice((1.0, 0.9, 0.5)),
                    "top_k": rng.choice((0, 1, 20, 200)),
                    "seed": i,
                }
                if i % 2
                else {}
            ),
            "escalate": False,
        }
        for i in range(n(400))
    ]
    lengths = [
        {
            **laya(i, "L", 1, 1000),
            "max_new_tokens": rng.randint(1, EDGE_LIMITS["laya_new"]),
            "escalate": rng.choice((False, 0.5, None)),
            **({"logprobs": True, "top_logprobs": rng.randint(0, 5)} if i % 7 == 0 else {}),
        }
        for i in range(n(1200))
    ]
    tiny = [{**laya(i, "T", 0, 5), "max_new_tokens": 8, "escalate": False} for i in range(n(3000))]
    pool = [*kev_max, *choices_wide, *sampled_half, *lengths, *tiny]
    mixed = _shuffled(rng, pool, n(2000), "A")
    return {
        "edge-kev-max": kev_max,
        "edge-choices-wide": choices_wide,
        "edge-sampled-half": sampled_half,
        "edge-lengths": lengths,
        "edge-tiny": tiny,
        "edge-mixed": mixed,
    }


class NvmlPeak:
    """The peak GPU memory NVML reports while running: the worker process's (by PID) when NVML names it, else
    the device's used memory (labelled so). Polled every 50 ms from a thread; no CUDA context here."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.per_process = False
        self.available = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self.available = False

    def read(self) -> int:
        nv = self._nvml
        for proc in nv.nvmlDeviceGetComputeRunningProcesses(self._handle):
            if proc.pid == self.pid and proc.usedGpuMemory:
                self.per_process = True
                return int(proc.usedGpuMemory)
        return int(nv.nvmlDeviceGetMemoryInfo(self._handle).used)

    def __enter__(self) -> NvmlPeak:
        self.peak = 0
        if self.available:
            self._stop.clear()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def kevlaya(*args: str, redis_url: str, stdin: bytes | None = None) -> str:
    out = subprocess.run(
        [*KEVLAYA, "--redis-url", redis_url, *args], input=stdin, capture_output=True, check=False, timeout=3600
    )
    if out.returncode != 0:
        raise RuntimeError(f"kevlaya {' '.join(args)} failed: {out.stderr.decode()[-2000:]}")
    return out.stdout.decode()


@dataclass(frozen=True)
class LogCounts:
    """What the worker has logged so far: out-of-memory errors, graph captures, and the seconds its batches
    spent in the engine (the rest of a workload's wall time is the CLI, Redis and the worker's own work)."""

    oom: int
    captures: int
    engine_s: float
    headrooms_mib: tuple[int, ...]  # each take's allocator cap less its peak (CUDA), in order
    retries: int = 0  # the allocator's retries under the cap (CUDA), all takes together

    @classmethod
    def of(cls, text: str) -> LogCounts:
        engine = sum(float(s) for s in re.findall(r" batch model=\S+ .* engine=([0-9.]+)s", text))
        oom = len(re.findall(r"OUT OF MEMORY at", text))
        return cls(
            oom=oom,
            captures=len(re.findall(r"decode: captured a graph", text)),
            engine_s=engine,
            headrooms_mib=tuple(int(h) for h in re.findall(r"take: .* headroom (-?[0-9]+) MiB", text)),
            retries=sum(int(r) for r in re.findall(r"take: .* headroom -?[0-9]+ MiB, ([0-9]+) retries", text)),
        )


def log_counts(path: Path) -> LogCounts:
    return LogCounts.of(path.read_text(errors="replace"))


def run_workload(
    name: str, jobs: list[dict[str, Any]], *, redis_url: str, out_dir: Path, log_path: Path, peak: NvmlPeak
) -> dict[str, Any]:
    before = log_counts(log_path)
    waves = 8 if name == "stream" else 1
    size = -(-len(jobs) // waves)
    with peak:
        started = time.perf_counter()
        batch = kevlaya("submit", "-", redis_url=redis_url, stdin=_jsonl(jobs[:size])).strip()
        for w in range(1, waves):
            time.sleep(0.5)
            part = _jsonl(jobs[w * size : (w + 1) * size])
            kevlaya("submit", "-", "--batch-id", batch, redis_url=redis_url, stdin=part)
        kevlaya("status", batch, "--wait", redis_url=redis_url)
        wall = time.perf_counter() - started
    results_path = out_dir / f"mixed-{name}-results.jsonl"
    kevlaya("results", batch, "-o", str(results_path), redis_url=redis_url)
    rows = [json.loads(line) for line in results_path.read_text().splitlines() if line.strip()]
    results_path.unlink()  # only the figures come back from the GPU machine
    prompt = generated = errors = 0
    for row in rows:
        for step in [row, *(row.get("chain") or [])]:
            usage = step.get("usage") or {}
            prompt += usage.get("prompt_tokens", 0)
            generated += usage.get("completion_tokens", 0)
        errors += "error" in row
    after = log_counts(log_path)
    report = {
        "items": len(jobs),
        "wall_s": round(wall, 2),
        "decisions_per_s": round(len(jobs) / wall, 1),
        "prompt_tokens_per_s": round(prompt / wall),
        "generated_tokens_per_s": round(generated / wall),
        "tokens_per_s": round((prompt + generated) / wall),
        "errors": errors,
        "oom": after.oom - before.oom,
        "captures": after.captures - before.captures,
        "engine_s": round(after.engine_s - before.engine_s, 2),
        "min_headroom_mib": min(after.headrooms_mib[len(before.headrooms_mib) :], default=None),
        "alloc_retries": after.retries - before.retries,
        "peak_mib": round(peak.peak / MIB) if peak.available else None,
        "peak_is_per_process": peak.per_process,
    }
    print(f"mixed/{name}:", report, flush=True)
    return report


def _jsonl(jobs: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(j) + "\n" for j in jobs).encode()


def build_models(shape: str, device: str) -> Path:
    """The model set, built in a subprocess so this process never holds a CUDA context (NVML would count it)."""
    code = "import sys; from bench.common import model_dir; print(model_dir(sys.argv[1], device=sys.argv[2]))"
    out = subprocess.run([sys.executable, "-c", code, shape, device], capture_output=True, check=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench mixed", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--memory-budget", default=None, help="passed to the worker (default: the worker's own)")
    parser.add_argument("--shape", default=None, help="model shape (default: qwen2.5-1.5b on cuda, tiny on cpu)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload's size")
    parser.add_argument(
        "--set",
        dest="workload_set",
        choices=("standard", "edges"),
        default="standard",
        help="the issue's workloads, or shapes beyond them under the seed's limits (Kev 512 new tokens)",
    )
    parser.add_argument("--only", default="", help="comma-separated workloads (default: all of the set)")
    parser.add_argument(
        "--repeat", type=int, default=1, help="run the workloads this many times in turn on one worker (rows name#N)"
    )
    parser.add_argument("--nightly-tokens-per-s", type=float, default=None, help="for the ratio column")
    parser.add_argument(
        "--pointwise-kernels", action="store_true", help="the worker runs with --pointwise-kernels (named in each row)"
    )
    parser.add_argument(
        "--take-ahead",
        choices=("auto", "on", "off"),
        default="auto",
        help="passed to the worker (named in each row unless auto, the worker's default)",
    )
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = args.shape or ("qwen2.5-1.5b" if args.device.startswith("cuda") else "tiny")
    root = build_models(shape, args.device)
    if args.workload_set == "edges":
        config = write_config(root, device=args.device, name="mixed-edges.toml", **EDGE_LIMITS)
        chosen = edge_workloads(args.scale)
    else:
        config = write_config(root, device=args.device, name="mixed.toml")
        chosen = workloads(args.scale)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in set(args.only.split(","))}
    report: dict[str, Any] = {"shape": shape, "device": args.device, "budget": args.memory_budget, "workloads": {}}
    log_path = out_dir / "mixed-worker.log"
    with EmbeddedRedis() as server:
        cmd = [*WORKER_CMD, "--redis-url", server.url, "worker", "--config", str(config), "--device", args.device]
        if args.memory_budget:
            cmd += ["--memory-budget", args.memory_budget]
        if args.pointwise_kernels:
            cmd += ["--pointwise-kernels"]
        if args.take_ahead != "auto":
            cmd += ["--take-ahead", args.take_ahead]
        with log_path.open("wb") as log_file:
            worker = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
            try:
                _wait_started(log_path, worker)
                peak = NvmlPeak(worker.pid)
                for turn in range(max(1, args.repeat)):
                    for name, jobs in chosen.items():
                        key = name if turn == 0 else f"{name}#{turn + 1}"
                        report["workloads"][key] = run_workload(
                            name, jobs, redis_url=server.url, out_dir=out_dir, log_path=log_path, peak=peak
                        )
                        save_json(out_dir, "mixed.json", report)
            finally:
                worker.terminate()
                worker.wait(timeout=120)
    for name, r in report["workloads"].items():
        append_results(_row(name, r, args, sys.argv[1:] if argv is None else argv), out_dir)
    return report


def _wait_started(log_path: Path, worker: subprocess.Popen[bytes]) -> None:
    while "started (burst=" not in log_path.read_text(errors="replace"):
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited: {log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def _row(name: str, r: dict[str, Any], args: argparse.Namespace, argv: list[str]) -> str:
    peak = "peak n/a (no NVML)"
    if r["peak_mib"] is not None:
        peak = f"peak {r['peak_mib']} MiB (NVML{'' if r['peak_is_per_process'] else ', device used'})"
    ratio = ""
    if args.nightly_tokens_per_s:
        ratio = f", {r['tokens_per_s'] / args.nightly_tokens_per_s:.2f}x nightly-2000's tok/s"
    figures = (
        f"{r['items']} items in {r['wall_s']:.2f} s ({r['engine_s']:.2f} s in the engine): "
        f"{r['decisions_per_s']:.1f} decisions/s, "
        f"{r['prompt_tokens_per_s']} prompt + {r['generated_tokens_per_s']} generated tok/s{ratio}, "
        f"{r['oom']} OOM, {r['captures']} captures, {r['errors']} errors, {peak}"
    )
    if r.get("min_headroom_mib") is not None:
        figures += f", least allocator headroom {r['min_headroom_mib']} MiB, {r['alloc_retries']} allocator retries"
    hardware = f"{args.device} budget {args.memory_budget or 'GPU total - 512 MiB (worker default)'}"
    changed = " + `--pointwise-kernels`" if args.pointwise_kernels else ""
    if args.workload_set == "edges":
        changed += " (models.toml: Kev 512 / Laya 64 new tokens, prompts up to 1,024 tokens)"
    if args.take_ahead != "auto":
        changed += f" + `--take-ahead {args.take_ahead}`"
    model = f"{args.shape or 'default'} shape NF4, `kevlaya worker` defaults (+ `--memory-budget` if given){changed}"
    return f"| mixed/{name} | {hardware} | {model} | {figures} | `python -m bench mixed {' '.join(argv)}` |"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
