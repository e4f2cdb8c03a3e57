"""Engine figures (issue: the engine): memory after base and adapters, adapter switch cost, decode tok/s
by batch size, choice-mode decisions/s. `python -m bench engine --device cuda --memory-budget 6GiB`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import append_results, hardware, model_dir, save_json, sync, write_config
from shared.job import Job
from worker.config import load_config
from worker.engine import Engine
from worker.loading import attach_adapter, load_base
from worker.memory import DTYPE_BYTES, MIB, parse_bytes, plan_batch

PROMPT = (
    "Loan application: yearly income 52000, amount requested 12000, debt ratio 0.31, credit history clean. "
    "Step 1: check income. Step 2: check debt. Step 3: decide. "
)


def prompt(i: int, words: int = 40) -> str:
    return f"case {i}: " + (PROMPT * 4)[: words * 7]


def load_measured(config: Any, device: torch.device) -> tuple[dict[str, Any], dict[str, int]]:
    mem: dict[str, int] = {}
    bases = {n: load_base(config.bases[n], device) for n in {m.base for m in config.models.values()}}
    if device.type == "cuda":
        mem["after_base_bytes"] = torch.cuda.memory_allocated(device)
    for m in config.models.values():
        attach_adapter(bases[m.base], m.name, m.adapter)
    if device.type == "cuda":
        mem["after_adapters_bytes"] = torch.cuda.memory_allocated(device)
    return bases, mem


def timed(engine: Engine, jobs: list[Job], device: str) -> tuple[float, list[Any]]:
    sync(device)
    start = time.perf_counter()
    outs = engine.run(jobs)
    sync(device)
    return time.perf_counter() - start, outs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench engine", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--memory-budget", default="6GiB")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16,64,max")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    budget = parse_bytes(args.memory_budget)
    out_dir = Path(args.out)
    root = model_dir(args.shape, device=args.device)
    config = load_config(write_config(root, device=args.device, kev_new=args.new_tokens, laya_new=args.new_tokens))
    dev = torch.device(args.device)
    bases, mem = load_measured(config, dev)
    engine = Engine(config, device=args.device, memory_budget_bytes=budget, bases=bases, max_batch_rows=1024)
    report: dict[str, Any] = {"hardware": hardware(args.device, budget), "shape": args.shape, "memory": mem}

    # Adapter switch: the engine selects an adapter per batch with set_adapter (no weights move).
    peft = engine.base_for("kev").model
    start = time.perf_counter()
    for i in range(1000):
        peft.set_adapter("kev" if i % 2 else "laya")
    report["set_adapter_us"] = (time.perf_counter() - start) / 1000 * 1e6
    one = [
        Job(custom_id=str(i), model=m, prompt=prompt(i), max_new_tokens=8) for i, m in enumerate(["kev", "laya"] * 5)
    ]
    timed(engine, one[:2], args.device)  # warm-up
    alternating = sum(timed(engine, [j], args.device)[0] for j in one)
    same = sum(timed(engine, [j.__class__(**{**j.__dict__, "model": "kev"})], args.device)[0] for j in one)
    report["switch_cost_ms_per_request"] = (alternating - same) / len(one) * 1000

    # Decode tokens/s by batch size; "max" = the largest batch the memory plan allows for these rows.
    shape = engine.base_for("kev").shape
    prompt_tokens = len(engine.encoder.encode(Job(custom_id="x", model="kev", prompt=prompt(0))).ids)
    plan = plan_batch(
        shape,
        budget_bytes=budget,
        resident_bytes=engine.memory.resident_bytes,
        input_tokens=prompt_tokens,
        new_tokens=args.new_tokens,
        dtype_bytes=DTYPE_BYTES[config.bases["default"].compute_dtype],
        max_rows_cap=1024,
    )
    sizes = [plan.max_rows if s == "max" else int(s) for s in args.batches.split(",")]
    report["prompt_tokens"] = prompt_tokens
    report["plan_max_rows"] = plan.max_rows
    decode = []
    for size in sizes:
        jobs = [
            Job(custom_id=str(i), model="kev", prompt=prompt(i), max_new_tokens=args.new_tokens) for i in range(size)
        ]
        engine.memory.mark()  # each take resets torch's peak: the engine keeps the most since this mark
        elapsed, outs = timed(engine, jobs, args.device)
        tokens = sum(o.completion_tokens for o in outs)
        errors = sum(o.error is not None for o in outs)
        peak = engine.memory.peak_since_mark() if args.device.startswith("cuda") else engine.peak_memory_bytes()
        row = {"batch": size, "seconds": elapsed, "tokens": tokens, "tok_s": tokens / elapsed, "errors": errors}
        row["ms_per_step"] = elapsed / max(1, args.new_tokens) * 1000
        row["peak_bytes"] = peak
        decode.append(row)
        print(
            f"decode batch {size}: {row['tok_s']:.0f} tok/s, {row['ms_per_step']:.1f} ms/step, peak {peak / MIB:.0f}MiB"
        )
    report["decode"] = decode

    # Choice mode: score 3 labels per job in one forward pass, no generation.
    n = max(sizes)
    labels = ("approve", "reject", "review")
    jobs = [Job(custom_id=str(i), model="laya", prompt=prompt(i), choices=labels) for i in range(n)]
    timed(engine, jobs[:4], args.device)
    elapsed, outs = timed(engine, jobs, args.device)
    report["choices"] = {
        "jobs": n,
        "seconds": elapsed,
        "decisions_s": n / elapsed,
        "errors": sum(o.error is not None for o in outs),
    }
    report["peak_bytes"] = engine.peak_memory_bytes()
    save_json(out_dir, "engine.json", report)
    d = {r["batch"]: r for r in decode}
    cells = ", ".join(f"b{b}: {d[b]['tok_s']:.0f} tok/s" for b in sizes)
    mem_txt = (
        f"base {mem['after_base_bytes'] / MIB:.0f} MiB, +adapters {mem['after_adapters_bytes'] / MIB:.0f} MiB, "
        if mem
        else ""
    )
    append_results(
        f"| engine | {report['hardware']} | {args.shape} NF4 + Kev r16/Laya r8 | {mem_txt}{cells} "
        f"({prompt_tokens}-token prompts, {args.new_tokens} new); "
        f"choices {report['choices']['decisions_s']:.0f} decisions/s at b{n}; "
        f"adapter switch {report['set_adapter_us']:.0f} µs (set_adapter), "
        f"{report['switch_cost_ms_per_request']:.1f} ms/request alternating vs same model "
        f"| `python -m bench engine --device {args.device} --memory-budget {args.memory_budget}` |",
        out_dir,
    )
    print(report)
    return report


if __name__ == "__main__":
    main()
