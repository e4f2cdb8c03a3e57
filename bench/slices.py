"""A candidate for the decode step's 4-bit matmuls, not yet the worker's: each weight dequantised and multiplied a
row slice at a time, each slice at most a share of the GPU's L2 cache, against the worker's whole dequantise then
matmul (`worker.fastpath.weights.folded_matmul`), a Qwen2.5-1.5B layer's four projections x 28 layers (each
layer its own weights, both adapters' LoRA folded in, rows of both), graph-replayed.

Why: the worker dequantises a whole weight into a bf16 buffer and its matmul reads that back. A gate/up weight's
bf16 is 55 MB, more than the H100's or H200's 50 MB of L2, so it goes out to device memory and comes back: 4 of
the 4.5 bytes a weight a decode step moves. Slices of a quarter of L2, two buffers alternating, could be read
back from L2 instead. Against it: each slice's matmul has fewer output tiles to spread over the SMs, and there
are more launches. Written in the twenty-seventh session and never timed on a GPU (no machine started for it);
where a share beats the whole weight, `row_spans` and `sliced_matmul` move into the worker's `folded_matmul`.

    python -m bench slices --out bench/out
    python -m bench slices --rows 176,256 --shares 2,4,8 --out bench/out
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import append_results, save_json
from bench.kernels import PROJECTIONS, graph_ms, random_nf4
from worker.fastpath import nf4
from worker.fastpath.pointwise import cdiv
from worker.fastpath.quant4 import Layout4bit
from worker.fastpath.weights import Fold, Masks, expand_folded, folded_matmul

SPAN_ROWS = 128  # a slice's rows: whole output tiles of cuBLAS' kernels


@dataclass(frozen=True)
class RowSpan:
    """Rows `first` to `first + count` of a weight."""

    first: int
    count: int


def row_spans(shape: tuple[int, int], itemsize: int, blocksize: int, most_bytes: int) -> tuple[RowSpan, ...]:
    """A weight's rows in as few slices of even size as keep each slice's dequantised bytes within `most_bytes`
    (0: one slice; a slice of the alignment alone where even that is more), each a multiple of `SPAN_ROWS` rows
    that starts a scale block (the last may be shorter; the LoRA rows `sliced_matmul` appends to it not counted)."""
    rows, cols = shape
    row_bytes = cols * itemsize
    if most_bytes <= 0 or rows * row_bytes <= most_bytes:
        return (RowSpan(0, rows),)
    align = math.lcm(SPAN_ROWS, blocksize // math.gcd(cols, blocksize))
    parts = cdiv(rows * row_bytes, most_bytes)
    step = cdiv(cdiv(rows, parts), align) * align
    while step > align and step * row_bytes > most_bytes:  # rounded up to the alignment past the budget
        parts += 1
        step = cdiv(cdiv(rows, parts), align) * align
    return tuple(RowSpan(first, min(step, rows - first)) for first in range(0, rows, step))


def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache (0 where unknown: off CUDA)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))


def dequantize_rows(
    layout: Layout4bit, packed: torch.Tensor, span: RowSpan, extra: torch.Tensor | None
) -> torch.Tensor | None:
    """Rows `span` of the weight by the worker's kernel (its packed bytes and scales from that row on), `extra`
    appended below them."""
    assert layout.code is not None
    cols = layout.shape[1]
    start = span.first * cols
    assert start % layout.blocksize == 0, (span, layout.shape)
    return nf4.dequantize(
        packed.view(-1)[start // 2 :], layout.absmax[start // layout.blocksize :], layout.code,
        shape=(span.count, cols), blocksize=layout.blocksize, dtype=layout.dtype, extra=extra,
    )  # fmt: skip


def sliced_matmul(
    x: torch.Tensor, layout: Layout4bit, packed: torch.Tensor, fold: Fold, masks: Masks, spans: tuple[RowSpan, ...]
) -> torch.Tensor | None:
    """`folded_matmul` with x [W; A]^T (+ bias) a row slice at a time (`spans`; the A rows with the last), each
    slice's matmul writing its own columns of the output; then the same expand."""
    flat = x.reshape(-1, x.shape[-1]).to(layout.dtype)
    extra_rows = 0 if fold.a is None else fold.a.shape[0]
    out = torch.empty(flat.shape[0], layout.shape[0] + extra_rows, dtype=layout.dtype, device=x.device)
    for i, span in enumerate(spans):
        weight = dequantize_rows(layout, packed, span, fold.a if i == len(spans) - 1 else None)
        if weight is None:
            return None
        cols = slice(span.first, span.first + weight.shape[0])
        if fold.bias is None:
            torch.mm(flat, weight.t(), out=out[:, cols])
        else:
            torch.addmm(fold.bias[cols], flat, weight.t(), out=out[:, cols])
    return expand_folded(out.view(*x.shape[:-1], out.shape[-1]), x, layout.shape[0], fold, masks)


@dataclass(frozen=True)
class Projection:
    """One layer's 4-bit projection with both adapters' LoRA folded: what `folded_matmul` takes."""

    layout: Layout4bit
    packed: torch.Tensor
    fold: Fold


def projection(shape: tuple[int, int], device: torch.device) -> Projection:
    """A random (out, in) weight in NF4 (`random_nf4`) with a Kev LoRA of rank 16 and a Laya one of rank 8."""
    rows, cols = shape
    weight = random_nf4(shape, device)
    loras = [
        (name, torch.randn(r, cols, device=device, dtype=torch.bfloat16) * 0.02,
         torch.randn(rows, r, device=device, dtype=torch.bfloat16) * 0.02)
        for name, r in (("kev", 16), ("laya", 8))
    ]  # fmt: skip
    return Projection(layout=weight.layout, packed=weight.packed, fold=Fold.of(loras, None))


def shape_report(name: str, rows: int, shares: list[int], device: torch.device) -> dict[str, Any]:
    """One projection's 28 layers at `rows` decode rows: the whole weight and each L2 share, ms and the largest
    difference from the whole weight's output."""
    layers = [projection(PROJECTIONS[name], device) for _ in range(28)]
    x = torch.randn(rows, 1, PROJECTIONS[name][1], device=device, dtype=torch.bfloat16)
    kev = (torch.arange(rows, device=device) % 2 == 0).to(torch.bfloat16).view(rows, 1, 1)
    masks: Masks = [("kev", kev), ("laya", 1 - kev)]
    first = layers[0]
    whole = folded_matmul(x, first.layout, first.packed, first.fold, masks)
    assert whole is not None
    ms = {"whole": graph_ms(lambda: [folded_matmul(x, p.layout, p.packed, p.fold, masks) for p in layers])}
    error: dict[str, float] = {}
    slices: dict[str, int] = {}
    for share in shares:
        layout = first.layout
        spans = row_spans((layout.shape[0], layout.shape[1]), 2, layout.blocksize, l2_bytes(device) // share)
        label = f"L2/{share}"
        slices[label] = len(spans)
        if len(spans) == 1:
            continue
        got = sliced_matmul(x, layout, first.packed, first.fold, masks, spans)
        assert got is not None
        error[label] = float((got.float() - whole.float()).abs().max())

        def run(spans: tuple[RowSpan, ...] = spans) -> None:
            for p in layers:
                sliced_matmul(x, p.layout, p.packed, p.fold, masks, spans)

        ms[label] = graph_ms(run)
    return {"ms_x28": ms, "max_error": error, "slices": slices}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench slices", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,176,256", help="decode rows, comma-separated")
    parser.add_argument("--shares", default="2,4,8", help="slices of at most L2 / each of these")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.manual_seed(0)
    shares = [int(s) for s in args.shares.split(",")]
    report: dict[str, Any] = {"l2_bytes": l2_bytes(device)}
    if not report["l2_bytes"]:
        sys.exit("bench slices: this torch reports no L2 cache size for the device (L2_cache_size)")
    for rows in (int(r) for r in args.rows.split(",")):
        for name in PROJECTIONS:
            report[f"{rows}/{name}"] = shape_report(name, rows, shares, device)
            print(f"{rows}/{name}: {report[f'{rows}/{name}']}", flush=True)
    save_json(out_dir, "slices.json", report)
    hardware = torch.cuda.get_device_name(device)
    cells = []
    for key, r in report.items():
        if key == "l2_bytes":
            continue
        figures = ", ".join(f"{label} {ms:.3f}" for label, ms in r["ms_x28"].items())
        cells.append(f"{key}: {figures} ms")
    command = f"`python -m bench slices {' '.join(sys.argv[1:] if argv is None else argv)}`"
    append_results(
        f"| slices | {hardware} | a Qwen2.5-1.5B layer's 4-bit projections x 28 layers, folded LoRA of both "
        f"adapters, whole dequantise-then-matmul against row slices of at most L2 / share "
        f"({report['l2_bytes'] / 2**20:.0f} MiB L2; graph-replayed) | {'; '.join(cells)} | {command} |",
        out_dir,
    )
    return report


if __name__ == "__main__":
    main()
