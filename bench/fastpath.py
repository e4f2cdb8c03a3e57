"""The static/CUDA-graph decode loop against HF generate, on the same engine and the same prompts.

    python -m bench fastpath --device cuda --memory-budget 6GiB

Reports (JSON + a row in bench/RESULTS.md + kernel tables beside the JSON):
1. agreement: greedy outputs of both paths on the nightly workload's prompts (Laya rows, Kev rows, and a
   mixed batch), row by row: identical text, and the share of generated tokens before the first difference;
2. ms per decode step at batch 1/64/256 (128-token prompts): (time for 1 + n new tokens - time for 1) / n,
   for both paths; the first call of each size is a warm-up (it captures the graph);
3. prefill: prompt tokens per second for 192 nightly-like prompts (128-256 tokens), one new token each;
4. kernel-time tables: HF generate, the loop without graphs, the loop with graphs (256 rows, 17 new tokens
   each), and the prefill alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.common import append_results, hardware, model_dir, save_json, sync, write_config
from bench.nightly import workload
from shared.job import Job
from worker.config import load_config
from worker.engine import Engine
from worker.fastpath import OpsOptions, StaticDecoder
from worker.memory import MIB, parse_bytes


def jobs_from(specs: list[dict[str, Any]], model: str, max_new: int | None = None) -> list[Job]:
    return [
        Job(custom_id=f"{model}{i}", model=model, prompt=s["prompt"], max_new_tokens=max_new)
        for i, s in enumerate(specs)
    ]


class TokenRecorder(Engine):
    """An engine that keeps each row's generated token ids (the random-weight models' ids mostly lie past the
    tiny tokenizer's vocabulary and decode to "", so texts alone cannot show agreement)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokens: dict[str, list[int]] = {}

    def _row_output(self, call: Any, item: Any, decoded: Any, row: int) -> Any:
        out = super()._row_output(call, item, decoded, row)
        self.tokens[item.job.custom_id] = decoded.tokens[row][: out.completion_tokens].tolist()
        return out


def agreement(eager: TokenRecorder, static: TokenRecorder, batches: dict[str, list[Job]]) -> dict[str, Any]:
    report = {}
    for name, jobs in batches.items():
        a, b = eager.run(jobs), static.run(jobs)
        same, prefix, total = 0, 0, 0
        for job in jobs:
            xs, ys = eager.tokens[job.custom_id], static.tokens[job.custom_id]
            same += xs == ys
            prefix += next((i for i, (p, q) in enumerate(zip(xs, ys, strict=False)) if p != q), min(len(xs), len(ys)))
            total += max(len(xs), 1)
        errors = sum(o.error is not None for o in [*a, *b])
        report[name] = {
            "rows": len(jobs),
            "identical_rows": same,
            "token_prefix_share": prefix / total,
            "errors": errors,
        }
        print("agreement", name, report[name], flush=True)
    return report


def ms_per_step(engine: Engine, device: str, jobs: list[Job], sizes: list[int], new: int) -> dict[int, float]:
    out = {}
    for size in sizes:
        batch = jobs[:size]
        one = [Job(custom_id=j.custom_id, model=j.model, prompt=j.prompt, max_new_tokens=1) for j in batch]
        many = [Job(custom_id=j.custom_id, model=j.model, prompt=j.prompt, max_new_tokens=new + 1) for j in batch]
        engine.run(many)  # warm-up: captures the graph for this bucket
        timings = []
        for rows in (one, many):
            sync(device)
            t0 = time.perf_counter()
            outs = engine.run(rows)
            sync(device)
            timings.append(time.perf_counter() - t0)
        steps = max(o.completion_tokens for o in outs) - 1
        out[size] = 1000 * (timings[1] - timings[0]) / max(1, steps)
        print(f"batch {size}: {out[size]:.1f} ms/step ({steps} steps)", flush=True)
    return out


def prefill_rate(engine: Engine, device: str, jobs: list[Job]) -> dict[str, float]:
    """Prompt tokens per second of one batch generating a single token (so: setup, prefill, outputs)."""
    one = [replace(j, max_new_tokens=1) for j in jobs]
    engine.run(one)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    outs = engine.run(one)
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(o.prompt_tokens for o in outs)
    out = {"rows": len(jobs), "prompt_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    print("prefill", out, flush=True)
    return out


def kernel_profile(engine: Engine, jobs: list[Job], out: Path, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    engine.run(jobs)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.run(jobs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(getattr(e, "device_time", 0.0) for e in kernels) / 1000
    head = f"{label}: wall {1000 * wall:.1f} ms under the profiler, {len(kernels)} kernels, {busy:.1f} ms GPU busy\n"
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60)
    (out / f"kernels-{label}.txt").write_text(head + table)
    print(head, end="", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench fastpath", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--memory-budget", default="6GiB")
    parser.add_argument("--rows", type=int, default=64, help="rows per agreement batch")
    parser.add_argument("--sizes", default="1,64,256")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--compute-dtype", default=None, help="float32 to check agreement without bf16 rounding")
    parser.add_argument("--exact-lora", action="store_true", help="PEFT's float32 LoRA arithmetic in the loop")
    parser.add_argument(
        "--pointwise-kernels", action="store_true", help="rotary and SiLU x up of decode steps by our Triton kernels"
    )
    parser.add_argument("--skip-eager", action="store_true", help="no eager ms/step and kernel table")
    parser.add_argument("--skip-profiles", action="store_true", help="no kernel tables (agreement and timings only)")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = parse_bytes(args.memory_budget) if args.device.startswith("cuda") else None
    root = model_dir(args.shape, device=args.device)
    path = write_config(root, device=args.device, name="fastpath.toml")
    if args.compute_dtype:
        path.write_text(
            path.read_text().replace('compute_dtype = "bfloat16"', f'compute_dtype = "{args.compute_dtype}"')
        )
    config = load_config(path)
    ops = OpsOptions(pointwise_kernels=args.pointwise_kernels)  # every loop engine of this run
    eager = TokenRecorder(config, device=args.device, memory_budget_bytes=budget, max_batch_rows=512, decode="eager")
    static = TokenRecorder(
        config,
        device=args.device,
        memory_budget_bytes=budget,
        max_batch_rows=512,
        decode="auto",
        bases=eager.bases,
        ops=ops,
    )
    if args.exact_lora:
        for name, decoder in static.decoders.items():
            static.decoders[name] = StaticDecoder(
                static.bases[name].model,
                static.device,
                use_graphs=decoder.use_graphs,
                fuse_lora=False,
                ops=ops,
            )
        static.give_prefill_room()
    tok = eager.base_for("laya").tokenizer
    specs = workload(max(args.rows, 256), 0.0, tokenizer=tok, seed=5)
    laya, kev = jobs_from(specs[: args.rows], "laya"), jobs_from(specs[: args.rows], "kev", 64)
    mixed = [j for pair in zip(laya[: args.rows // 2], kev[: args.rows // 2], strict=True) for j in pair]
    report: dict[str, Any] = {"hardware": hardware(args.device, budget), "shape": args.shape}
    report["compute_dtype"] = config.bases["default"].compute_dtype
    exact = args.exact_lora or report["compute_dtype"] == "float32"  # float32: PEFT's own arithmetic, no casts
    report["lora"] = "exact (PEFT float32)" if exact else "fused in the compute dtype"
    report["pointwise_kernels"] = args.pointwise_kernels
    report["agreement"] = agreement(eager, static, {"laya": laya, "kev": kev, "mixed": mixed})
    sizes = [int(s) for s in args.sizes.split(",")]
    fixed = [
        Job(custom_id=f"f{i}", model="laya", prompt=tok.decode(tok(s["prompt"]).input_ids[:128]))
        for i, s in enumerate(specs)
    ]
    report["static_ms_per_step"] = ms_per_step(static, args.device, fixed, sizes, args.new_tokens)
    if not args.skip_eager:
        report["eager_ms_per_step"] = ms_per_step(eager, args.device, fixed, sizes, args.new_tokens)
    nightly_like = jobs_from(specs[:192], "laya")  # 128-256-token prompts, as in bench nightly
    report["prefill"] = prefill_rate(static, args.device, nightly_like)
    report["graphs_captured"] = sum(d.captures for d in static.decoders.values())
    if args.device.startswith("cuda"):
        # Each take resets torch's peak; the engines keep the most across theirs (the process's, between them).
        report["peak_memory_bytes"] = max(static.peak_memory_bytes(), eager.peak_memory_bytes())
    if args.device.startswith("cuda") and not args.skip_profiles:
        big = fixed[: max(sizes)]
        few = [Job(custom_id=j.custom_id, model=j.model, prompt=j.prompt, max_new_tokens=4) for j in big]
        if not args.skip_eager:
            kernel_profile(eager, few, out_dir, "eager")
        static_nograph = Engine(  # the step's own kernels (a replayed graph hides them)
            config,
            device=args.device,
            memory_budget_bytes=budget,
            max_batch_rows=512,
            decode="static",
            bases=eager.bases,
            ops=ops,
        )
        kernel_profile(static, [replace(j, max_new_tokens=1) for j in nightly_like], out_dir, "prefill")
        # Decode-heavy (17 new tokens per row): the table is mostly the loop's decode step, run without graphs.
        steps = [Job(custom_id=j.custom_id, model=j.model, prompt=j.prompt, max_new_tokens=17) for j in big]
        kernel_profile(static_nograph, steps, out_dir, "static")
        # The same with graphs (the profiler sees the kernels a replayed graph launches, where CUPTI allows).
        kernel_profile(static, steps, out_dir, "graph")
    save_json(out_dir, "fastpath.json", report)
    st, ea, ag = report["static_ms_per_step"], report.get("eager_ms_per_step", {}), report["agreement"]
    steps = ", ".join(f"b{s}: {st[s]:.1f}" + (f" vs {ea[s]:.1f}" if s in ea else "") + " ms/step" for s in sizes)
    agree = ", ".join(
        f"{k} {v['identical_rows']}/{v['rows']} rows identical "
        f"({100 * v['token_prefix_share']:.0f}% of tokens before a difference)"
        for k, v in ag.items()
    )
    peak = f", peak {report['peak_memory_bytes'] / MIB:.0f} MiB" if "peak_memory_bytes" in report else ""
    kernels = ", our rotary and SiLU x up kernels" if args.pointwise_kernels else ""
    append_results(
        f"| fastpath | {report['hardware']} | {args.shape} NF4 ({report['compute_dtype']} compute) + Kev r16/Laya r8 "
        f"(random weights) | static+graph (LoRA {report['lora']}{kernels}) vs "
        f"HF generate, 128-token prompts: {steps}; prefill {report['prefill']['tokens_per_s']:.0f} prompt tok/s "
        f"(192 rows); greedy agreement: {agree}{peak} | "
        f"`python -m bench fastpath {' '.join(sys.argv[1:] if argv is None else argv)}` |",
        out_dir,
    )
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
