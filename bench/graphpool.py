"""What a decode graph's capture adds to a fresh graphs' pool, against take rows and against the memory plan.

    python -m bench graphpool --device cuda --memory-budget 6GiB --out $OUT/gp     # rows 16-288, ~90 s

The loop captures a take's decode graph before its prompts run, into a pool of its own that lives beside the
prefill's transients; the memory plan counts a per-row estimate of a step's temporaries (`decode_row_bytes`) and,
for a take that will capture into a fresh pool, the part of the loop's own readings past that estimate
(`worker.memory.graph_pool_fixed_bytes`). This runs nightly-like Laya takes of each `--rows` count, each into a
fresh pool (the loop released before it), and reports what each capture grew the pool by beside the plan's
per-row estimate and float32 choice chunk, and what those leave uncovered -- what the plan would set aside
from that reading alone. One row in bench/RESULTS.md.
CUDA only: there are no graphs on a CPU.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import append_results, hardware, model_dir, save_json, write_config
from bench.fastpath import jobs_from
from bench.nightly import workload
from worker.config import load_config
from worker.engine import Engine
from worker.fastpath.sampling import CHOICE_CHUNK_ROWS
from worker.memory import MIB, choice_chunk_set_aside_bytes, graph_pool_fixed_bytes, parse_bytes

NEW_TOKENS = 8  # enough for a replay after the capture; the pool does not grow with the steps


@dataclass(frozen=True)
class PoolReading:
    rows: int  # the captured graph's rows (the take's, padded up to a row bucket)
    grew_bytes: int  # what the take's capture grew the fresh pool by
    planned_row_bytes: int  # the plan's per-row estimate of a step's temporaries (`decode_row_bytes`)
    planned_chunk_bytes: int  # the plan's set-aside for the step's float32 choice chunk

    @property
    def fixed_bytes(self) -> int:
        """What the plan sets aside for a fresh pool from this reading alone: what its own terms do not cover."""
        return graph_pool_fixed_bytes({self.rows: self.grew_bytes}, self.planned_row_bytes, self.planned_chunk_bytes)


def summary(readings: list[PoolReading]) -> str:
    """The row's figures: each count's growth against the plan's terms for it, and what they leave uncovered."""
    return "; ".join(
        f"{r.rows} rows: grew {r.grew_bytes / MIB:.0f} MiB, planned {r.rows * r.planned_row_bytes / MIB:.0f} MiB "
        f"for the rows + {r.planned_chunk_bytes / MIB:.0f} MiB choice chunk, {r.fixed_bytes / MIB:.0f} MiB uncovered"
        for r in readings
    )


def measure(engine: Engine, rows: list[int], input_tokens: int) -> list[PoolReading]:
    decoder = engine.decoders[engine.config.models["laya"].base]
    base = engine.base_for("laya")
    chunk = choice_chunk_set_aside_bytes(base.shape, CHOICE_CHUNK_ROWS)
    specs = workload(max(rows), 0.0, tokenizer=base.tokenizer, seed=3)
    readings = []
    for n in rows:
        decoder.release()
        engine.refresh_memory()
        plan = engine.plan("laya", input_tokens=input_tokens, new_tokens=NEW_TOKENS, may_release=False)
        captures = decoder.captures
        engine.run(jobs_from(specs, "laya", NEW_TOKENS)[:n])
        if decoder.captures != captures + 1 or decoder.graph_rows < n:
            raise RuntimeError(f"{n} rows ran as more than one take or without a capture: raise --memory-budget")
        grew = decoder.graphs.last_pool_growth_bytes
        readings.append(PoolReading(decoder.graph_rows, grew, plan.decode_row_bytes, chunk))
    decoder.release()
    return readings


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench graphpool", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--memory-budget", default="6GiB", help="the worker's budget (default 6GiB)")
    parser.add_argument("--rows", default="16,64,128,176,256,288", help="comma-separated take rows (each one take)")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        parser.error("needs a CUDA device: decode graphs and their pool exist only there")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: give comma-separated row counts")
    if not rows or min(rows) < 1:
        parser.error("--rows: every count at least 1")
    budget = parse_bytes(args.memory_budget)
    config = load_config(write_config(model_dir("qwen2.5-1.5b", device=args.device), device=args.device))
    engine = Engine(config, device=args.device, memory_budget_bytes=budget, max_batch_rows=max(rows))
    engine.warm_up()
    readings = measure(engine, rows, input_tokens=300)
    report = {"hardware": hardware(args.device, budget), "readings": [asdict(r) for r in readings]}
    out = Path(args.out)
    save_json(out, "graphpool.json", report)
    append_results(
        f"| graphpool | {report['hardware']} | Qwen2.5-1.5B shape NF4, nightly-like Laya takes, each into a fresh "
        f"graphs' pool | {summary(readings)} | `python -m bench graphpool {' '.join(given)}` |",
        out,
    )
    print(f"graphpool: {summary(readings)}", flush=True)
    return report


if __name__ == "__main__":
    main()
