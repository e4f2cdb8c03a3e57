"""A layer's matmuls at token counts the math library has not seen, against the same token counts again.

    python -m bench shapes --device cuda --out $OUT/sh                    # the Qwen2.5-1.5B shape's matmuls
    python -m bench shapes --device cpu --shape tiny --counts 4 --low 17 --high 64 --block 16  # a smoke run

Prefill runs each chunk's matmuls at M = rows x span tokens, a count a live stream seldom repeats, and the first
call at a new M costs the library a kernel's first use and its choice: on the H200 4.4 ms for a layer's four
matmuls the first time at a new count between 4096 and 8192, 0.82 ms again (bench/RESULTS.md). This measures it
alone: a layer's four matmuls (joint q/k/v with its bias, output projection, joint gate/up, down) at `--counts`
token counts drawn between `--low` and `--high`, each the first time and then again (wall time, the device
synchronised around each call), once as one matmul per count and once as the worker runs them
(`worker/fastpath/gemm.py`: the rows in blocks of `--block`, so the counts the library meets are the block's
multiples), the two passes taking turns count by count. One row in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import append_results, hardware, save_json, sync
from worker.fastpath.gemm import ROW_BLOCK, blocked_linear, body_rows
from worker.tools.tinymodel import SHAPES, TinyShape

Matmuls = Callable[[int], None]


def layer_matmuls(shape: TinyShape, device: str, dtype: torch.dtype, high: int, block: int | None) -> Matmuls:
    """A function running one layer's four prefill matmuls at a token count (at most `high`), in row blocks of
    `block` as the worker runs them (None: one matmul each)."""
    head_dim = shape.hidden // shape.heads
    qkv = (shape.heads + 2 * shape.kv_heads) * head_dim

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype) / cols**0.5

    w_qkv, b_qkv = weight(qkv, shape.hidden), torch.zeros(qkv, device=device, dtype=dtype)
    w_o, w_gate_up = weight(shape.hidden, shape.heads * head_dim), weight(2 * shape.intermediate, shape.hidden)
    w_down = weight(shape.hidden, shape.intermediate)
    x = torch.randn(high, shape.hidden, device=device, dtype=dtype)
    act = torch.randn(high, shape.intermediate, device=device, dtype=dtype)

    def run(tokens: int) -> None:
        # As prefill's inputs are laid out: the q/k/v and output projections' inputs (the held normed states,
        # the attention's output) end where their storage ends, so their blocked matmuls run in two; gate/up's
        # and down's (transient kernel outputs) hold room for their rows up to the next block (`gemm.empty_rows`)
        # and run as one. Without blocks every input is read as it is.
        tight = x[high - tokens :]
        blocked_linear(tight, w_qkv, b_qkv, block)
        blocked_linear(tight, w_o, None, block)
        blocked_linear(x[:tokens], w_gate_up, None, block)
        blocked_linear(act[:tokens], w_down, None, block)

    return run


def timed_ms(run: Matmuls, tokens: int, device: str) -> float:
    sync(device)
    started = time.perf_counter()
    run(tokens)
    sync(device)
    return (time.perf_counter() - started) * 1e3


def passes(runs: list[tuple[Matmuls, list[int]]], device: str) -> list[dict[str, float]]:
    """Per (matmuls, counts): the mean and median milliseconds of a layer's matmuls at each count the first time,
    then again. The runs take turns count by count, so a kernel one loads first serves both about as often (the
    first time at a count is mostly a kernel's first use)."""
    first: list[list[float]] = [[] for _ in runs]
    again: list[list[float]] = [[] for _ in runs]
    for times in (first, again):
        for i in range(max(len(counts) for _, counts in runs)):
            for (run, counts), out in zip(runs, times, strict=True):
                if i < len(counts):
                    out.append(timed_ms(run, counts[i], device))
    return [
        {
            "first_ms": round(statistics.fmean(f), 3),
            "again_ms": round(statistics.fmean(a), 3),
            "first_median_ms": round(statistics.median(f), 3),
            "again_median_ms": round(statistics.median(a), 3),
        }
        for f, a in zip(first, again, strict=True)
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="bench shapes", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    parser.add_argument("--counts", type=int, default=24, help="token counts drawn (distinct)")
    parser.add_argument("--low", type=int, default=4096, help="the fewest tokens drawn")
    parser.add_argument("--high", type=int, default=8192, help="the most tokens drawn (a prefill chunk's most)")
    parser.add_argument("--block", type=int, default=ROW_BLOCK, help="the worker's row block (gemm.ROW_BLOCK)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    if not 1 <= args.low <= args.high or args.counts > args.high - args.low + 1 or args.block < 1:
        parser.error("need 1 <= --low <= --high, --counts at most the counts between them, and --block >= 1")
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    shape = SHAPES[args.shape]
    warm = args.high + args.block + 1  # past every count the passes use
    whole = layer_matmuls(shape, device, dtype, warm, None)
    blocked = layer_matmuls(shape, device, dtype, warm, args.block)
    whole(warm)  # the library loaded and set up once, at a count none of the passes uses
    whole(warm)
    rng = random.Random(args.seed)
    counts = rng.sample(range(args.low, args.high + 1), args.counts)
    # Counts of their own for the blocked pass (its first time is the first at these counts too), in the same range.
    pool = sorted(set(range(args.low, args.high + 1)) - set(counts))
    others = rng.sample(pool, min(len(pool), args.counts)) or counts
    shapes: set[int] = set()  # the row counts the blocked pass's matmuls run at
    for m in others:
        body = body_rows(m, args.block)
        shapes |= {m} if body is None else {body, args.block}
    report = {
        "hardware": hardware(device, None),
        "shape": args.shape,
        "counts": len(counts),
        "low": args.low,
        "high": args.high,
        "block": args.block,
        "blocked_shapes": len(shapes),
    }
    report["exact"], report["blocked"] = passes([(whole, counts), (blocked, others)], device)
    out = Path(args.out)
    save_json(out, "shapes.json", report)
    exact, rows = report["exact"], report["blocked"]
    append_results(
        f"| shapes | {report['hardware']} | {args.shape}, {dtype} (a layer's q/k/v + bias, o, gate/up, down) | "
        f"{len(counts)} token counts in {args.low}-{args.high}, one matmul each: {exact['first_ms']:.3f} ms a layer "
        f"the first time, {exact['again_ms']:.3f} ms again (medians {exact['first_median_ms']:.3f} / "
        f"{exact['again_median_ms']:.3f}); {len(others)} others in blocks of {args.block} rows "
        f"({report['blocked_shapes']} matmul shapes): {rows['first_ms']:.3f} / {rows['again_ms']:.3f} ms (medians "
        f"{rows['first_median_ms']:.3f} / {rows['again_median_ms']:.3f}) | "
        f"`python -m bench shapes {' '.join(sys.argv[1:] if argv is None else argv)}` |",
        out,
    )
    print("shapes", report, flush=True)
    return report


if __name__ == "__main__":
    main()
