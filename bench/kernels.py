"""Our Triton kernels against what they replace, each figure 28 calls (one per layer of a Qwen2.5-1.5B shape)
captured as a CUDA graph and replayed (GPU time only, no host launch cost):

- pointwise: rotary embedding and SiLU x up (`worker/fastpath/pointwise.py`) against the torch.compile'd
  functions, at a 4,096-token prefill chunk's shape and a 256-row decode step's; bit-equal to eager or not;
- dequant: our NF4 dequantise (`worker/fastpath/nf4.py`) against bitsandbytes', over 28 layers' own weights (the
  L2 cache holds none of them), with the bytes a layer moves; bit-equal or not;
- attention: the decode step's attention (`worker/fastpath/decode_attention.py`) against SDPA under the rows'
  mask, at the shapes of nightly-2000's takes and of long Kev prompts, with the K/V bytes each reads (its own
  columns) and the largest difference from float32 SDPA.

    python -m bench kernels --out bench/out
    python -m bench kernels --only dequant,attention --out bench/out
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import append_results, save_json
from worker.fastpath.quant4 import Layout4bit


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


# A Qwen2.5-1.5B layer's four 4-bit projections, (out, in).
PROJECTIONS = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
# (rows, cache columns, fewest and most columns a row reads, the step's last column): a nightly Kev take, its
# tail, a Laya take, long Kev prompts (~1,024 tokens), and a small take of them.
ATTENTION_SHAPES = (
    (176, 512, 340, 490, 500),
    (124, 512, 340, 490, 500),
    (288, 320, 160, 280, 300),
    (64, 1152, 1000, 1140, 1150),
    (16, 1152, 1000, 1140, 1150),
)


@dataclass(frozen=True)
class Nf4Weight:
    """A random 4-bit weight as the worker's loop holds one: bitsandbytes' packed bytes and their layout."""

    layout: Layout4bit
    packed: torch.Tensor


def random_nf4(shape: tuple[int, int], device: torch.device) -> Nf4Weight:
    """A random (out, in) bf16 weight (a trained layer's scale, ~0.02) in NF4, blocks of 64, scales in float32."""
    import bitsandbytes.functional as bnb

    from worker.fastpath import nf4

    weight = torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02
    packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    layout = Layout4bit(
        absmax=state.absmax.float(), blocksize=64, quant_type="nf4", shape=list(shape), dtype=torch.bfloat16,
        code=nf4.code_table(state.code),
    )  # fmt: skip
    return Nf4Weight(layout=layout, packed=packed)


def dequant_report(device: torch.device) -> dict[str, Any]:
    """Our NF4 dequantise and bitsandbytes' over 28 layers' four projections, each layer its own weights; whether
    ours is bit-equal to bitsandbytes'."""
    import bitsandbytes.functional as bnb

    from worker.fastpath import nf4

    layers = []
    for _ in range(28):
        layer = []
        for rows, cols in PROJECTIONS.values():
            weight = torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * 0.02
            packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4")
            layer.append((packed, state, state.absmax.float(), (rows, cols)))
        layers.append(layer)
    table = nf4.code_table(layers[0][0][1].code)

    def ours(p: torch.Tensor, a: torch.Tensor, s: tuple[int, int]) -> torch.Tensor | None:
        return nf4.dequantize(p, a, table, shape=s, blocksize=64, dtype=torch.bfloat16)

    equal = {"ours": all(torch.equal(ours(p, a, s), bnb.dequantize_4bit(p, st)) for p, st, a, s in layers[0])}
    weights = sum(r * c for r, c in PROJECTIONS.values())
    ms = {
        "bitsandbytes": graph_ms(lambda: [bnb.dequantize_4bit(p, st) for layer in layers for p, st, _, _ in layer]),
        "ours": graph_ms(lambda: [ours(p, a, s) for layer in layers for p, _, a, s in layer]),
    }
    moved = weights * 2 + weights // 2 + weights // 64 * 4  # bf16 out, packed in, float32 scales
    return {"dequant_ms_x28": ms, "dequant_equal": equal, "dequant_bytes_a_layer": moved}


def attention_report(device: torch.device) -> dict[str, Any]:
    """The decode step's attention against SDPA under the mask, at `ATTENTION_SHAPES`."""
    return {f"{shape[0]}x{shape[1]}": attention_shape(*shape, device=device) for shape in ATTENTION_SHAPES}


def attention_shape(rows: int, length: int, fewest: int, most: int, last: int, *, device: torch.device) -> dict:
    """One take's shape: each row reads a random `fewest`..`most` columns ending at `last`, 28 layers' caches."""
    import torch.nn.functional as F

    from worker.fastpath import decode_attention as da

    kv_heads, groups, dim = 2, 6, 128
    scale = dim**-0.5
    joint = torch.randn(rows, (kv_heads * groups + 2 * kv_heads) * dim, device=device, dtype=torch.bfloat16)
    q = joint[:, : kv_heads * groups * dim].view(rows, kv_heads, groups, dim)
    caches = [
        tuple(torch.randn(rows, kv_heads, length, dim, device=device, dtype=torch.bfloat16) for _ in range(2))
        for _ in range(28)
    ]
    end = torch.tensor([last], device=device)
    spans = torch.randint(fewest, most + 1, (rows,), device=device)
    first = (last + 1 - spans).clamp(min=0)
    cols = torch.arange(length, device=device)
    mask = ((cols >= first[:, None]) & (cols <= last)).view(rows, 1, 1, length)
    k0, v0 = caches[0]
    want = F.scaled_dot_product_attention(q.float(), k0.float(), v0.float(), attn_mask=mask, scale=scale)

    got = da.decode_attention(q, k0, v0, first, end, scale=scale)
    error = float((got.float() - want).abs().max()) if got is not None else float("nan")
    figures = {
        "ours": graph_ms(lambda: [da.decode_attention(q, k, v, first, end, scale=scale) for k, v in caches]),
        "sdpa": graph_ms(
            lambda: [F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale) for k, v in caches]
        ),
    }
    read = float(spans.sum()) * kv_heads * dim * 2 * 2 * 28  # K and V, bf16, 28 layers
    return {"ms_x28": figures, "max_error": error, "kv_gb": read / 1e9}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="pointwise,dequant,attention", help="sections to run")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))
    device = torch.device("cuda")
    torch.manual_seed(0)
    command = f"`python -m bench kernels {' '.join(sys.argv[1:] if argv is None else argv)}`"
    report: dict[str, Any] = {}
    if "pointwise" in only:
        report.update(pointwise_report(device))
    if "dequant" in only:
        report.update(dequant_report(device))
    if "attention" in only:
        report["attention"] = attention_report(device)
    print(report, flush=True)
    save_json(out_dir, "kernels.json", report)
    hardware = torch.cuda.get_device_name(device)

    def figure(label: str, op: str) -> str:
        ms, equal = report[f"{label}_{op}_ms_x28"], report[f"{label}_{op}_equal"]
        return (
            f"{label} {op} {ms['compiled']:.2f} -> {ms['triton']:.2f} ms ({'' if equal else 'NOT '}bit-equal to eager)"
        )

    if "pointwise" in only:
        figures = "; ".join(figure(label, op) for label in ("prefill", "decode") for op in ("rope", "silu"))
        append_results(
            f"| kernels | {hardware} | Qwen2.5-1.5B shape, bf16, 28 calls per figure (graph-replayed) | compiled -> "
            f"Triton: {figures} | {command} |",
            out_dir,
        )
    if "dequant" in only:
        ms, moved = report["dequant_ms_x28"], report["dequant_bytes_a_layer"]
        rates = "; ".join(f"{k} {v:.3f} ms ({moved * 28 / v / 1e9:.2f} TB/s)" for k, v in ms.items())
        append_results(
            f"| kernels/dequant | {hardware} | NF4 -> bf16, a Qwen2.5-1.5B layer's 4 projections x 28 layers "
            f"(graph-replayed, each layer its own weights) | {rates}; bit-equal to bitsandbytes: "
            f"{', '.join(f'{k} {v}' for k, v in report['dequant_equal'].items())} | {command} |",
            out_dir,
        )
    if "attention" in only:
        cells = []
        for shape, r in report["attention"].items():
            ms = r["ms_x28"]
            cells.append(
                f"{shape}: ours {ms['ours']:.3f} ms ({r['kv_gb'] / ms['ours']:.2f} TB/s of its columns), SDPA "
                f"{ms['sdpa']:.3f} ms; max err {r['max_error']:.3f}"
            )
        append_results(
            f"| kernels/attention | {hardware} | decode attention, 2 KV heads x 6 queries x 128, 28 layers "
            f"(graph-replayed), rows x cache columns | {'; '.join(cells)} | {command} |",
            out_dir,
        )
    return report


if __name__ == "__main__":
    main()
