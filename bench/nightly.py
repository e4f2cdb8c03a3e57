"""The nightly workload end to end, with the seed's approach side by side, on CPU or GPU.

    python -m bench nightly --device cuda --memory-budget 6GiB          # Qwen2.5-1.5B shape, NF4, random weights
    python -m bench nightly --device cpu --shape demo --items 400       # the demo models

Parts (each reported in one JSON file, a row in bench/RESULTS.md, and a PNG):
1. nightly-N: N Laya decisions (prompts ~128-256 tokens, <= 32 new tokens), ~25% escalated to Kev
   (<= 128 new tokens), submitted as one batch through Redis, drained by the worker, exported;
2. interactive: single Kev jobs on the interactive lane arriving at a fixed rate while a bulk Laya batch runs:
   p50/p95 latency, and the bulk batch's throughput drop against draining it alone;
3. the seed's approach on a sample of the same workload (two separately loaded 4-bit bases, one request at
   a time, gc.collect() + empty_cache() on every switch), extrapolated to the whole and labelled so;
4. the queue layer alone: our worker with a no-op engine vs a stock RQ SimpleWorker running no-op jobs;
5. throughput against batch size (engine only), plotted.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import os
import pstats
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from redis import Redis
from rq import Queue
from rq.worker import SimpleWorker

from bench.common import append_results, hardware, model_dir, save_json, sync, write_config
from bench.noop import NoopEngine
from producer.client import Client
from shared.job import Job
from shared.serializer import serializer
from worker.config import load_config
from worker.engine import Engine
from worker.fastpath import OpsOptions
from worker.loop import BatchWorker
from worker.memory import MIB, parse_bytes
from worker.settings import WorkerSettings, take_ahead_on
from worker.tools.demo import prepare_models
from worker.tools.embedded_redis import EmbeddedRedis

DEFAULTS = WorkerSettings()  # what a user gets
WORDS = tuple(
    "loan income debt ratio history clean late payments amount requested category personal car home business "
    "employer years stable savings collateral guarantor approve reject review risk score policy limit".split()
)


def workload(n: int, escalation_rate: float, *, tokenizer: Any, seed: int = 1) -> list[dict[str, Any]]:
    """n Laya jobs with prompts of 128-256 tokens (cut with the model's own tokenizer); a deterministic
    `escalation_rate` share carries escalate=1.0 (always escalates: a confidence is < 1), the rest
    escalate=false, so the rate is controlled whatever the weights."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(300))
        ids = tokenizer(f"Case {i}: {words}", add_special_tokens=False).input_ids[: rng.randint(128, 256)]
        escalate = 1.0 if rng.random() < escalation_rate else False
        jobs.append({"custom_id": f"n{i:05d}", "model": "laya", "prompt": tokenizer.decode(ids), "escalate": escalate})
    return jobs


def tokenizer(engine: Engine) -> Any:
    return engine.base_for("laya").tokenizer


def run_worker(redis: Redis, engine: Any, **settings: Any) -> tuple[BatchWorker, threading.Thread]:
    settings.setdefault("take_ahead", take_ahead_on(engine.device.type))  # `kevlaya worker --take-ahead auto`
    worker = BatchWorker(redis, engine, engine.config, WorkerSettings(**settings))
    thread = threading.Thread(target=worker.work, daemon=True)
    thread.start()
    return worker, thread


def nightly(redis: Redis, engine: Engine, jobs: list[dict[str, Any]], out_dir: Path, profile: bool) -> dict[str, Any]:
    client = Client(redis=redis)
    profiler = cProfile.Profile() if profile else None
    phases_before = engine.phase_seconds()
    stats_before = engine.stats()
    start = time.perf_counter()
    handle = client.submit_batch(jobs)
    submitted = time.perf_counter()
    if profiler:
        profiler.enable()
    worker, thread = run_worker(redis, engine, name="nightly")  # the worker's defaults, as a user runs it
    record = client.wait(handle.id, poll_s=0.05)
    drained = time.perf_counter()
    worker.request_stop()
    thread.join()
    if profiler:
        profiler.disable()
    rows = list(client.iter_results(handle.id))
    exported = time.perf_counter()
    with (out_dir / "nightly-results.jsonl").open("w") as fh:
        for row in rows[:50]:  # a sample, to keep the artefact small
            fh.write(f"{row}\n")
    queued = [s["timing"].get("queued_s", 0.0) for r in rows for s in [r, *r.get("chain", [])] if "timing" in s]
    engine_s = [s["timing"].get("engine_s", 0.0) for r in rows for s in [r, *r.get("chain", [])] if "timing" in s]
    st = worker.stats
    out = {
        "items": len(jobs),
        "escalated": record.counts.escalated,
        "failed": record.counts.failed,
        "end_to_end_s": exported - start,
        "submit_s": submitted - start,
        "drain_s": drained - submitted,
        "export_s": exported - drained,
        "decisions_per_s": len(jobs) / (exported - start),
        "generated_tokens": st.generated_tokens,
        "generated_tokens_per_s": st.generated_tokens / (drained - submitted),
        "engine_busy_s": st.engine_s,
        "batches": st.batches,
        "switches": st.switches,
        "batch_sizes": dict(st.batch_sizes),
        "peak_memory_bytes": st.peak_memory_bytes,
        "oom": engine.stats().oom - stats_before.oom,
        "captures": engine.stats().captures - stats_before.captures,
        "job_queued_s_mean": statistics.mean(queued) if queued else None,
        "job_engine_s_mean": statistics.mean(engine_s) if engine_s else None,
        # Inside the engine: encode, outputs, and the static loop's setup/prefill/decode (+ its step count).
        "engine_phases_s": {k: round(v - phases_before.get(k, 0), 3) for k, v in engine.phase_seconds().items()},
    }
    if profiler:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(60)
        stats.sort_stats("tottime").print_stats(30)  # where the time is spent itself, GPU waits included
        (out_dir / "nightly-profile.txt").write_text(text.getvalue())
    return out


def interactive(
    redis: Redis, engine: Engine, *, bulk: int, rate_per_s: float, n: int, settings: dict[str, Any]
) -> dict[str, Any]:
    """Single Kev jobs on the interactive lane at a fixed rate while a bulk Laya batch drains, the worker at
    the defaults a user gets: latency submit -> final result, and the bulk batch's throughput against the
    same bulk batch drained alone (the lanes' promise: interactive p95 <= 1 s, bulk throughput -10% at most).
    `settings`: worker settings changed from the defaults (named in the row)."""
    client = Client(redis=redis)
    bulk_jobs = [{**j, "escalate": False} for j in workload(bulk, 0.0, tokenizer=tokenizer(engine), seed=2)]
    bulk_done = threading.Event()

    def drain_bulk(batch_id: str, during: Any = None) -> float:
        handle = client.submit_batch(bulk_jobs, batch_id=batch_id)  # the bulk lane: submit_batch's default
        worker, thread = run_worker(redis, engine, name=f"interactive-{batch_id}", **settings)
        start = time.perf_counter()
        extra = during() if during else None
        client.wait(handle.id, poll_s=0.02)
        drained = time.perf_counter() - start
        if extra is not None:
            bulk_done.set()
            extra.join()
        worker.request_stop()
        thread.join()
        return drained

    alone_s = drain_bulk("bulk-alone")
    latencies: list[float] = []
    under_bulk = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.perf_counter()
        batch, _ = client.submit(
            {"custom_id": f"live{i}", "model": "kev", "prompt": f"Quick check {i}", "max_new_tokens": 16},
            lane="interactive",
        )
        client.wait(batch, poll_s=0.01, timeout_s=600)
        with lock:
            latencies.append(time.perf_counter() - t0)
            under_bulk[0] += not bulk_done.is_set()

    def stream() -> threading.Thread:
        def run() -> None:
            threads = []
            for i in range(n):
                t = threading.Thread(target=one, args=(i,))
                t.start()
                threads.append(t)
                time.sleep(1.0 / rate_per_s)
            for t in threads:
                t.join()

        feeder = threading.Thread(target=run)
        feeder.start()
        return feeder

    with_stream_s = drain_bulk("bulk-with-interactive", during=stream)
    latencies.sort()
    return {
        "bulk_items": bulk,
        "rate_per_s": rate_per_s,
        "n": n,
        "answered_while_bulk_ran": under_bulk[0],  # latencies count only while this is n (raise --interactive-bulk)
        "p50_s": latencies[len(latencies) // 2],
        "p95_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.95))],
        "max_s": latencies[-1],
        "latencies_s": [round(x, 3) for x in latencies],
        "bulk_alone_s": alone_s,
        "bulk_with_interactive_s": with_stream_s,
        "bulk_throughput_drop": 1 - alone_s / with_stream_s,
        "settings": f"worker defaults (max_wait_ms {DEFAULTS.max_wait_ms}, bulk_every_takes "
        f"{DEFAULTS.bulk_every_takes}, paced_take_ms {DEFAULTS.paced_take_ms}, interactive_window_s "
        f"{DEFAULTS.interactive_window_s})" + (f" but {settings}" if settings else ""),
    }


def seed_approach(config_path: Path, device: str, budget: int | None, jobs: list[dict[str, Any]], sample: int) -> dict:
    """Two separately loaded 4-bit bases, one request at a time, gc + empty_cache on every switch."""
    engine = Engine(
        load_config(config_path), device=device, memory_budget_bytes=budget, max_batch_rows=1, decode="eager"
    )
    current, switches = None, 0
    laya_n = kev_n = 0
    sync(device)
    start = time.perf_counter()
    for spec in jobs[:sample]:
        steps = ["laya", "kev"] if spec["escalate"] else ["laya"]
        for model in steps:
            if current is not None and model != current:
                gc.collect()  # the seed's switch: collect, return cached blocks, clear the KV cache
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
                switches += 1
            current = model
            job = Job(custom_id=spec["custom_id"], model=model, prompt=spec["prompt"])
            engine.run([job])
            laya_n += model == "laya"
            kev_n += model == "kev"
    sync(device)
    elapsed = time.perf_counter() - start
    scale = len(jobs) / sample
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "sample_items": sample,
        "sample_requests": laya_n + kev_n,
        "sample_switches": switches,
        "sample_s": elapsed,
        "extrapolated_s": elapsed * scale,
        "extrapolated": True,
        "decisions_per_s": sample / elapsed,
    }


def queue_layer(redis: Redis, n: int) -> dict[str, Any]:
    """The same no-op work through our batch worker and through a stock RQ SimpleWorker."""
    redis.flushdb()
    client = Client(redis=redis)
    handle = client.submit_batch([{"custom_id": f"q{i}", "model": "laya", "prompt": "x"} for i in range(n)])
    start = time.perf_counter()
    noop = NoopEngine()
    BatchWorker(redis, noop, noop.config, WorkerSettings(burst=True, name="noop")).work()
    ours = time.perf_counter() - start
    assert client.status(handle.id).complete
    queue = Queue("bench-noop", connection=redis, serializer=serializer)
    queue.enqueue_many([Queue.prepare_data("bench.noop.noop_job", args=[{"i": i}]) for i in range(n)])
    start = time.perf_counter()
    SimpleWorker([queue], connection=redis, serializer=serializer).work(burst=True, logging_level="WARNING")
    stock = time.perf_counter() - start
    redis.flushdb()
    return {"jobs": n, "kevlaya_jobs_s": n / ours, "rq_simpleworker_jobs_s": n / stock, "ratio": stock / ours}


def batch_sweep(engine: Engine, device: str, sizes: list[int], out_dir: Path) -> list[dict[str, Any]]:
    rows = []
    specs = workload(max(sizes), 0.0, tokenizer=tokenizer(engine), seed=3)
    jobs = [Job(custom_id=str(j["custom_id"]), model="laya", prompt=j["prompt"]) for j in specs]
    engine.run(jobs[:2])
    for size in sizes:
        sync(device)
        t0 = time.perf_counter()
        outs = engine.run(jobs[:size])
        sync(device)
        elapsed = time.perf_counter() - t0
        tokens = sum(o.completion_tokens for o in outs)
        rows.append({"batch": size, "decisions_s": size / elapsed, "tok_s": tokens / elapsed})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["batch"] for r in rows], [r["decisions_s"] for r in rows], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel("Laya decisions/s (32 new tokens)")
        ax.set_title(f"throughput vs batch size ({device})")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / f"throughput-vs-batch-{device.split(':')[0]}.png", dpi=100)
    except ImportError:
        print("matplotlib not installed: no plot")
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench nightly", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default=None, help="qwen2.5-1.5b (default on CUDA) or demo (default on CPU)")
    parser.add_argument("--memory-budget", default="6GiB")
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--escalation-rate", type=float, default=0.25)
    parser.add_argument("--seed-sample", type=int, default=12)
    parser.add_argument("--interactive-n", type=int, default=20)
    parser.add_argument("--interactive-rate", type=float, default=2.0)
    parser.add_argument("--interactive-bulk", type=int, default=None, help="bulk Laya rows behind them (items/2)")
    parser.add_argument(
        "--paced-take-ms", type=int, default=None, help="the worker's --paced-take-ms (default: its default)"
    )
    parser.add_argument(
        "--prefill-group-tokens",
        type=int,
        default=None,
        help="prompt tokens a layer-major prefill group holds (default: the loop's, 0: every chunk alone, each "
        "layer dequantised per chunk; 32768: groups of 8 chunks)",
    )
    parser.add_argument("--queue-jobs", type=int, default=5000)
    parser.add_argument("--sweep", default="1,8,32,128,256")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: nightly,interactive,seed,queue,sweep")
    parser.add_argument("--decode", default="auto", choices=["auto", "eager", "static"], help="decode path")
    parser.add_argument("--no-compile", action="store_true", help="the loop's fused elementwise steps run eagerly")
    parser.add_argument(
        "--pointwise-kernels", action="store_true", help="the decode step's rotary and SiLU x up by our Triton kernels"
    )
    parser.add_argument("--profile", action="store_true", help="cProfile the nightly drain (written beside the JSON)")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--verbose", action="store_true", help="log each batch of the decode loop (rows, phases)")
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)d %(name)s %(message)s")
        logging.getLogger("kevlaya.fastpath").setLevel(logging.DEBUG)
        logging.getLogger("kevlaya.engine").setLevel(logging.INFO)
        logging.getLogger("kevlaya.worker").setLevel(logging.INFO)
    skip = set(filter(None, args.skip.split(",")))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shape = args.shape or ("qwen2.5-1.5b" if args.device.startswith("cuda") else "demo")
    budget = parse_bytes(args.memory_budget) if args.device.startswith("cuda") else None
    root = prepare_models(Path(".kevlaya/demo")).parent if shape == "demo" else model_dir(shape, device=args.device)
    # The trained demo models keep their adapters under adapters/; the benchmark shapes beside the base.
    adapters = ("adapters/kev", "adapters/laya") if shape == "demo" else ("adapter-kev", "adapter-laya")
    config_path = write_config(root, device=args.device, name="nightly.toml", adapters=adapters)
    seed_config = write_config(root, device=args.device, separate_bases=True, name="seed.toml", adapters=adapters)
    report: dict[str, Any] = {"hardware": hardware(args.device, budget), "shape": shape, "items": args.items}
    with EmbeddedRedis() as server:
        redis = Redis.from_url(server.url)
        engine = Engine(
            load_config(config_path),
            device=args.device,
            memory_budget_bytes=budget,
            decode=args.decode,
            ops=OpsOptions(compile_ops=not args.no_compile, pointwise_kernels=args.pointwise_kernels),
        )
        if args.prefill_group_tokens is not None:
            for decoder in engine.decoders.values():
                decoder.prefill.group_tokens = args.prefill_group_tokens  # read by each take and each plan
        graphs = any(d.use_graphs for d in engine.decoders.values())
        report["decode"] = ("static+graphs" if graphs else "static") if engine.decoders else "HF generate"
        if args.pointwise_kernels:
            report["decode"] += " with our rotary and SiLU x up kernels"
        jobs = workload(args.items, args.escalation_rate, tokenizer=tokenizer(engine))
        if "nightly" not in skip:
            report["nightly"] = nightly(redis, engine, jobs, out_dir, args.profile)
            print("nightly:", report["nightly"], flush=True)
            save_json(out_dir, "nightly.json", report)  # early: later parts may run out of time
        if "interactive" not in skip:
            bulk = args.interactive_bulk or max(200, args.items // 2)
            changed = {} if args.paced_take_ms is None else {"paced_take_ms": args.paced_take_ms}
            report["interactive"] = interactive(
                redis, engine, bulk=bulk, rate_per_s=args.interactive_rate, n=args.interactive_n, settings=changed
            )
            print("interactive:", report["interactive"], flush=True)
        if "sweep" not in skip:
            report["sweep"] = batch_sweep(engine, args.device, [int(s) for s in args.sweep.split(",")], out_dir)
            print("sweep:", report["sweep"], flush=True)
        if "queue" not in skip:
            report["queue_layer"] = queue_layer(redis, args.queue_jobs)
            print("queue layer:", report["queue_layer"], flush=True)
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if "seed" not in skip:
            report["seed"] = seed_approach(seed_config, args.device, budget, jobs, args.seed_sample)
            if "nightly" in report:
                report["ratio_vs_seed"] = report["seed"]["extrapolated_s"] / report["nightly"]["end_to_end_s"]
            print("seed:", report["seed"], flush=True)
    save_json(out_dir, "nightly.json", report)
    append_results(_row(report, sys.argv[1:] if argv is None else argv), out_dir)
    return report


def _row(r: dict[str, Any], argv: list[str]) -> str:
    model = "Qwen2.5-1.5B shape NF4" if r["shape"] == "qwen2.5-1.5b" else f"{r['shape']} models NF4"
    parts = []
    if "nightly" in r:
        n = r["nightly"]
        parts.append(
            f"{n['end_to_end_s']:.1f} s end to end, {n['decisions_per_s']:.1f} decisions/s, "
            f"{n['generated_tokens_per_s']:.0f} generated tok/s, {n['escalated']} escalated, {n['batches']} batches, "
            f"{n['switches']} switches, {n.get('oom', 'n/a')} OOM, {n.get('captures', 'n/a')} captures, "
            f"peak {n['peak_memory_bytes'] / MIB:.0f} MiB (torch's allocator)"
        )
        ph = n.get("engine_phases_s", {})
        if "prefill" in ph:
            parts.append(
                f"in the engine: prefill {ph['prefill']:.1f} s, decode {ph['decode']:.1f} s "
                f"({ph['decode_steps']:.0f} steps), setup {ph['setup']:.1f} s (captures {ph.get('capture', 0):.2f} s), "
                f"encode {ph.get('encode', 0):.1f} s, outputs {ph.get('outputs', 0):.1f} s"
            )
    if "seed" in r:
        ratio = f": **{r['ratio_vs_seed']:.0f}x**" if "ratio_vs_seed" in r else ""
        parts.append(
            f"seed approach {r['seed']['extrapolated_s']:.0f} s (extrapolated from {r['seed']['sample_items']} items)"
            f"{ratio}"
        )
    if "interactive" in r:
        i = r["interactive"]
        parts.append(
            f"interactive lane p50 {i['p50_s']:.2f} s / p95 {i['p95_s']:.2f} s at {i['rate_per_s']}/s under "
            f"{i['bulk_items']} bulk items ({i['answered_while_bulk_ran']}/{i['n']} answered while bulk ran), "
            f"bulk throughput {-100 * i['bulk_throughput_drop']:+.1f}% ({i['settings']})"
        )
    if "queue_layer" in r:
        q = r["queue_layer"]
        parts.append(
            f"queue layer {q['kevlaya_jobs_s']:.0f} vs RQ SimpleWorker {q['rq_simpleworker_jobs_s']:.0f} jobs/s "
            f"({q['ratio']:.1f}x)"
        )
    if "sweep" in r:
        best = max(r["sweep"], key=lambda s: s["decisions_s"])
        parts.append(f"engine alone peaks at {best['decisions_s']:.1f} decisions/s at batch {best['batch']}")
    cmd = " ".join(["python -m bench nightly", *argv])
    model += f", decode {r.get('decode', 'auto')}, worker defaults"
    return f"| nightly-{r['items']} | {r['hardware']} | {model} | {'; '.join(parts)} | `{cmd}` |"


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
