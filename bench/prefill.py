"""Prefill variants side by side in one process: chunk size and which elementwise kernels prefill runs.

    python -m bench prefill --device cuda --memory-budget 6GiB
    python -m bench prefill --device cpu --shape tiny --rows 16 --chunks 256,512 --ops compiled   # a smoke run

One engine (the worker's defaults but the variant), then for every (ops, chunk tokens, group tokens) variant and
workload, a warm-up run and `--repeats` timed runs of the engine generating one token a row (so: setup, prefill,
outputs), reported as prompt tokens per second of the median run, beside the engine's phases (`prefill`, or
`score` for choices; `decode_steps` counts the takes). Workloads: `nightly` (nightly-2000's 128-256-token Laya
prompts), `long` (Kev prompts cut at the 1,024-token input limit) and `choices` (the nightly prompts with 3
labels scored inside the prefill, the choices' steps compiled in every variant), `mixed` (the
nightly prompts, every other row Kev: each chunk holds both adapters, their LoRA masked per row) and, named with
`--only`, `mixed-choices` (`bench mixed`'s own choice jobs: prompts of 60-300 words). On CUDA each
run also reports its peak allocation above the start (the reused KV pool not in it: prefill's transients, its
held hidden states, the first-token logits) beside the held states and the plan's chunk set-aside. One new token a
row keeps each take's KV small: a variant that plans more prefill memory costs generation takes more rows than
these show. Machine to machine the figures move 10-20%: compare variants within one run only.

`--ops compiled` is the loop's torch.compile'd rotary and SiLU x up (eager on the CPU), `kernels` ours
(`worker/fastpath/pointwise.py`, what prefill runs by default on a GPU); each run records whether ours really
ran (`kernels_ran`: a failing kernel hands over to the compiled ones for good). `--groups` the layer-major group
sizes (the loop's default 32,768; 0: each chunk alone). `--chunks` the chunk sizes (0, the default: the loop's own
choice, 4,096 tokens or up to 8,192 where the memory free as the take's prefill starts holds them). `--prefixes`
the fewest tokens every row of a take must share for prefill to run them once (worker/fastpath/prefix.py; the
loop's default 16; 0: off), each variant on a fresh set of kept prefixes, so its warm-up run makes them; each run
reports the prefixes it made (`prefixes_made`). `--mlp-blocks` the most tokens the MLP's gate/up runs at once
(the loop's default 4,096; 0: a chunk's whole), named in a run's cell only where it is not the default; the
plan's set-aside (`chunk planned`) is always the default's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import os
import pstats
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.common import append_results, hardware, model_dir, save_json, sync, write_config
from bench.fastpath import kernel_profile
from bench.mixed import CHOICES
from bench.mixed import workloads as mixed_workloads
from bench.nightly import workload
from shared.job import Job
from worker import planner
from worker.config import load_config
from worker.engine import Engine
from worker.fastpath.prefill import MAX_CHUNK_TOKENS
from worker.fastpath.prefix import MIN_TOKENS, PrefixCache
from worker.memory import MIB, PREFILL_MLP_BLOCK_TOKENS, parse_bytes, prefill_chunk_bytes


def workloads(engine: Engine, rows: int) -> dict[str, list[Job]]:
    tok = engine.base_for("laya").tokenizer
    specs = workload(rows, 0.0, tokenizer=tok, seed=5)
    nightly = [Job(custom_id=s["custom_id"], model="laya", prompt=s["prompt"], max_new_tokens=1) for s in specs]
    words = " ".join(s["prompt"] for s in specs[:8])
    long = [
        Job(custom_id=f"k{i}", model="kev", prompt=f"Case {i}: {words}", max_new_tokens=1, truncate=True)
        for i in range(max(1, rows // 4))
    ]
    choices = [replace(j, choices=tuple(CHOICES), max_new_tokens=None) for j in nightly]
    # Kev and Laya rows of the same lengths side by side: every chunk holds both adapters (LoRA masked per row).
    mixed = [replace(j, model="kev" if i % 2 else "laya") for i, j in enumerate(nightly)]
    # `bench mixed`'s own choice jobs (prompts of 60-300 words): the takes behind its choices figure, in one process.
    cli = [Job.from_dict(d) for d in mixed_workloads(rows / 600 + 1e-6)["choices"][:rows]]
    return {"nightly": nightly, "long": long, "choices": choices, "mixed": mixed, "mixed-choices": cli}


def timed(engine: Engine, jobs: list[Job], device: str, repeats: int) -> dict[str, Any]:
    """The median of `repeats` runs after a warm-up: wall seconds, prompt tokens, and the engine's phases of the
    median run (setup, prefill, score, outputs...) with the allocator's retries (a cudaMalloc that failed under
    the cap and freed the cache to retry: each a device synchronisation)."""
    sync(device)
    made_before = prefixes_made(engine)
    t0 = time.perf_counter()
    engine.run(jobs)
    sync(device)
    first = time.perf_counter() - t0  # the workload's first run: shapes, kernels and allocations new to it
    first_made = prefixes_made(engine) - made_before
    runs = []
    for _ in range(repeats):
        before, retries, made = engine.phase_seconds(), alloc_retries(device), prefixes_made(engine)
        sync(device)
        start_bytes = reset_peak(engine, device)
        t0 = time.perf_counter()
        outs = engine.run(jobs)
        sync(device)
        wall = time.perf_counter() - t0
        after = engine.phase_seconds()
        phases = {k: round(after[k] - before.get(k, 0.0), 4) for k in after if after[k] != before.get(k, 0.0)}
        runs.append(
            {
                "wall_s": round(wall, 4),
                "phases_s": phases,
                "alloc_retries": alloc_retries(device) - retries,
                "prefixes_made": prefixes_made(engine) - made,
                "peak_above_start_mib": round((engine.memory.peak_since_mark() - start_bytes) / MIB),
            }
        )
        if errors := [o.error for o in outs if o.error is not None]:
            raise RuntimeError(f"{len(errors)} rows failed, e.g. {errors[0]}")
    tokens = sum(o.prompt_tokens for o in outs)
    median = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    median = {**median, **memory_figures(engine, jobs, max(r["peak_above_start_mib"] for r in runs))}
    return {
        "first_wall_s": round(first, 4),
        "first_prefixes_made": first_made,
        "rows": len(jobs),
        "prompt_tokens": tokens,
        **median,
        "walls_s": [r["wall_s"] for r in runs],
        "tokens_per_s": round(tokens / median["wall_s"]),
    }


def host_profile(engine: Engine, jobs: list[Job], out: Path, label: str) -> None:
    """Where the host's time goes in one run (cProfile, by own time): the GPU runs behind it asynchronously, so
    a prefill whose host work outlasts its kernels shows here what to cut."""
    engine.run(jobs)
    profiler = cProfile.Profile()
    profiler.enable()
    engine.run(jobs)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"host-{label}.txt").write_text(text.getvalue())


def alloc_retries(device: str) -> int:
    return planner.alloc_retries(torch.device(device)) if device.startswith("cuda") else 0


def reset_peak(engine: Engine, device: str) -> int:
    """CUDA: starts the engine's peak window afresh (its takes each reset torch's); returns what is allocated
    now (0 elsewhere)."""
    if not device.startswith("cuda"):
        return 0
    import torch

    engine.memory.mark()
    return int(torch.cuda.memory_allocated())


def memory_figures(engine: Engine, jobs: list[Job], peak_above_mib: int) -> dict[str, int]:
    """The take's memory beside what the planner sets aside for it: the peak above what was allocated before
    the run (the KV pool reused, so: prefill's transients, its held hidden states, the first-token logits),
    the held states measured from their tensors, the chunk size the run used, and the plan's set-aside for a
    chunk of that size."""
    decoder = engine.decoders[engine.config.models[jobs[0].model].base]
    base = engine.base_for(jobs[0].model)
    vocab = base.shape.vocab
    one = len({j.model for j in jobs}) == 1  # the mixed workload runs both adapters: a second layer's copy planned
    return {
        "peak_above_start_mib": peak_above_mib,
        "held_mib": round(decoder.prefill.held_bytes / MIB),
        "logits_mib": round(len(jobs) * vocab * 2 / MIB),
        "chunk_tokens_run": decoder.prefill.last_tokens,
        "planned_chunk_mib": round(
            prefill_chunk_bytes(
                base.shape,
                chunk_tokens=decoder.prefill.last_tokens,
                input_tokens=512,
                flash=decoder.own_prefill,
                one_adapter=one,
            )
            / MIB
        ),
    }


def prefixes_made(engine: Engine) -> int:
    return sum(d.prefill.prefixes.made for d in engine.decoders.values())


def use_variant(
    engine: Engine,
    ops: str,
    chunk_tokens: int,
    group_tokens: int,
    prefix_tokens: int = MIN_TOKENS,
    mlp_block_tokens: int = PREFILL_MLP_BLOCK_TOKENS,
) -> None:
    """`chunk_tokens` 0: the loop's default (chunks of 4,096 tokens, up to `MAX_CHUNK_TOKENS` where memory holds
    them); otherwise chunks of exactly that size. `prefix_tokens`: the fewest shared tokens run once (0: off), on
    a fresh set of kept prefixes. `mlp_block_tokens`: the most tokens the MLP's gate/up runs at once (0: whole)."""
    for decoder in engine.decoders.values():
        decoder.stack.mlp_block_tokens = mlp_block_tokens or 1 << 40
        decoder.prefill.prefixes = PrefixCache(min_tokens=prefix_tokens)
        decoder.prefill.tokens = chunk_tokens or 4096
        decoder.prefill.max_tokens = chunk_tokens or MAX_CHUNK_TOKENS
        decoder.prefill.group_tokens = group_tokens
        stack = decoder.stack
        if ops == "kernels" and not stack.prefill_ops.kernels:
            raise SystemExit("our kernels are not available here (Triton on CUDA, bf16/fp16)")
        decoder.prefill.ops = stack.prefill_ops if ops == "kernels" else stack.ops


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench prefill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--memory-budget", default="6GiB")
    parser.add_argument("--rows", type=int, default=256, help="rows of the nightly and choices workloads")
    parser.add_argument(
        "--chunks", default="0", help="prefill chunk sizes (tokens) to compare; 0: the loop's default (4,096-8,192)"
    )
    parser.add_argument("--groups", default="0,32768", help="layer-major group sizes (tokens; 0: each chunk alone)")
    parser.add_argument("--ops", default="compiled,kernels", help="compiled and/or kernels (ours)")
    parser.add_argument(
        "--prefixes", default=str(MIN_TOKENS), help="fewest shared prefix tokens run once, to compare (0: off)"
    )
    parser.add_argument(
        "--mlp-blocks",
        default=str(PREFILL_MLP_BLOCK_TOKENS),
        help="most tokens the MLP's gate/up runs at once, to compare (0: a chunk's whole)",
    )
    parser.add_argument("--only", default="nightly,long,choices,mixed", help="workloads to run (also: mixed-choices)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--profile", action="store_true", help="CUDA: a kernel table per workload, first variant (kernels-prefill-*)"
    )
    parser.add_argument(
        "--host-profile", action="store_true", help="cProfile one run per workload, first variant (host-prefill-*)"
    )
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)  # the kernel tables are written before anything else
    budget = parse_bytes(args.memory_budget) if args.device.startswith("cuda") else None
    config = load_config(
        write_config(model_dir(args.shape, device=args.device), device=args.device, name="prefill.toml")
    )
    ops = args.ops.split(",")
    engine = Engine(config, device=args.device, memory_budget_bytes=budget)
    if not engine.decoders:
        raise SystemExit("no static loop on this device/model: nothing to compare")
    loads = {k: v for k, v in workloads(engine, args.rows).items() if k in args.only.split(",")}
    report: dict[str, Any] = {"hardware": hardware(args.device, budget), "shape": args.shape, "runs": []}
    for op in ops:
        variants = itertools.product(ints(args.chunks), ints(args.groups), ints(args.prefixes), ints(args.mlp_blocks))
        for chunk, group, shared, mlp in variants:
            use_variant(engine, op, chunk, group, shared, mlp)
            for name, jobs in loads.items():
                figures = timed(engine, jobs, args.device, args.repeats)
                ran = all(d.prefill.ops.kernels for d in engine.decoders.values())
                r = {"ops": op, "chunk_tokens": chunk, "group_tokens": group, "prefix_tokens": shared, "workload": name}
                r["mlp_block_tokens"] = mlp
                r |= figures
                r["kernels_ran"] = ran
                report["runs"].append(r)
                print("prefill", r, flush=True)
    use_variant(engine, ops[0], *(ints(a)[0] for a in (args.chunks, args.groups, args.prefixes, args.mlp_blocks)))
    for name, jobs in loads.items():
        if args.profile and args.device.startswith("cuda"):
            kernel_profile(engine, jobs, Path(args.out), f"prefill-{name}")
        if args.host_profile:
            host_profile(engine, jobs, Path(args.out), f"prefill-{name}")
    save_json(Path(args.out), "prefill.json", report)
    cells = "; ".join(cell(r) for r in report["runs"])
    append_results(
        f"| prefill | {report['hardware']} | {args.shape} NF4, worker defaults but the variant named "
        f"(ops chunk tokens/layer-major group tokens/shared prefix tokens) | {cells} | "
        f"`python -m bench prefill {' '.join(sys.argv[1:] if argv is None else argv)}` |",
        Path(args.out),
    )
    return report


def cell(r: dict[str, Any]) -> str:
    """One run's figures in the row: the chunk size named (`auto (N)`: the loop's own choice, N what it ran)."""
    chunk = r["chunk_tokens"] or f"auto ({r['chunk_tokens_run']})"
    fell_back = "" if r["kernels_ran"] == (r["ops"] == "kernels") else " (FELL BACK)"
    mlp = r.get("mlp_block_tokens", PREFILL_MLP_BLOCK_TOKENS)
    blocks = "" if mlp == PREFILL_MLP_BLOCK_TOKENS else f" MLP {'whole' if not mlp else f'in {mlp}'}"
    return (
        f"{r['workload']} {r['ops']}{fell_back} {chunk}/{r['group_tokens']}/{r['prefix_tokens']}{blocks}: "
        f"{r['tokens_per_s']} tok/s "
        f"({r['wall_s']:.3f} s, {phase(r)} {r['phases_s'].get(phase(r), 0):.3f} s, peak +{r['peak_above_start_mib']} "
        f"MiB: held {r['held_mib']}, logits {r['logits_mib']}, chunk planned {r['planned_chunk_mib']})"
    )


def phase(run: dict[str, Any]) -> str:
    """The engine phase that holds a workload's prompts: scoring runs its prefill inside `score`."""
    return "score" if run["workload"].endswith("choices") else "prefill"


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
