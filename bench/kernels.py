"""Our Triton kernels (`worker/fastpath/pointwise.py`) against the torch.compile'd functions they replace.

Rotary embedding and SiLU x up at a 4,096-token prefill chunk's shape and a 256-row decode step's, each figure
28 calls (one per layer of a Qwen2.5-1.5B shape) captured as a CUDA graph and replayed (GPU time only, no host
launch cost); and whether each kernel's output equals eager's bit for bit.

    python -m bench kernels --out bench/out
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import append_results, save_json


def graph_ms(fn: Callable[[], object], reps: int = 20) -> float:
    """Milliseconds per call of `fn` captured once as a CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def pointwise_report(device: torch.device) -> dict[str, Any]:
    """Rotary and SiLU x up: our kernels against the compiled ones at a prefill chunk's (16 x 256 tokens) and a
    256-row decode step's shapes, 28 calls (a step's layers) per figure; equality with eager."""
    out: dict[str, Any] = {}
    for label, rows, length in (("prefill", 16, 256), ("decode", 256, 1)):
        out.update(shape_report(label, rows, length, device))
    return out


def shape_report(label: str, rows: int, length: int, device: torch.device) -> dict[str, Any]:
    from worker.fastpath import ops, pointwise

    compiled_rope, compiled_silu = ops.Fused(ops.rope, True), ops.Fused(ops.silu_mul, True)
    joint = torch.randn(rows, length, 2048, device=device, dtype=torch.bfloat16)
    qk = joint[..., :1792].view(rows, length, 14, 128)  # q and k heads of a joint q/k/v output
    cos = torch.randn(1 if length > 1 else rows, length, 128, device=device, dtype=torch.bfloat16)
    sin = torch.randn_like(cos)
    gate, up = (torch.randn(rows, length, 17920, device=device, dtype=torch.bfloat16) * 4).split(8960, dim=-1)
    wide_cos, wide_sin = cos.unsqueeze(2), sin.unsqueeze(2)
    heads_first, heads_cos_sin = qk.transpose(1, 2), (cos.unsqueeze(1), sin.unsqueeze(1))
    return {
        f"{label}_rope_equal": bool(torch.equal(pointwise.rope(qk, cos, sin), ops.rope(qk, wide_cos, wide_sin))),
        f"{label}_silu_equal": bool(torch.equal(pointwise.silu_mul(gate, up), ops.silu_mul(gate, up))),
        f"{label}_rope_ms_x28": {
            # On the heads-first view, as the loop runs it.
            "compiled": graph_ms(lambda: [compiled_rope(heads_first, *heads_cos_sin) for _ in range(28)]),
            "triton": graph_ms(lambda: [pointwise.rope(qk, cos, sin) for _ in range(28)]),
        },
        f"{label}_silu_ms_x28": {
            "compiled": graph_ms(lambda: [compiled_silu(gate, up) for _ in range(28)]),
            "triton": graph_ms(lambda: [pointwise.silu_mul(gate, up) for _ in range(28)]),
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    report = pointwise_report(torch.device("cuda"))
    print(report, flush=True)
    save_json(out_dir, "kernels.json", report)

    def figure(label: str, op: str) -> str:
        ms, equal = report[f"{label}_{op}_ms_x28"], report[f"{label}_{op}_equal"]
        return (
            f"{label} {op} {ms['compiled']:.2f} -> {ms['triton']:.2f} ms ({'' if equal else 'NOT '}bit-equal to eager)"
        )

    figures = "; ".join(figure(label, op) for label in ("prefill", "decode") for op in ("rope", "silu"))
    append_results(
        f"| kernels | H200 | Qwen2.5-1.5B shape, bf16, 28 calls per figure (graph-replayed) | compiled -> Triton: "
        f"{figures} | `python -m bench kernels {' '.join(sys.argv[1:] if argv is None else argv)}` |",
        out_dir,
    )
    return report


if __name__ == "__main__":
    main()
