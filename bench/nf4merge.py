"""A candidate for prefill's weights, not yet the worker's: a 4-bit weight dequantised with one adapter's LoRA
merged into it (W + B A) by one Triton kernel, against the worker's two steps (bitsandbytes' dequantise, then
`addmm_` of the LoRA into the dequantised buffer: `weights.Proj.merge` / `Group.merge`).

Why: prefill dequantises and merges each layer's weights once per take. The two steps move ~6.5 bytes a weight
(0.5 packed in and 2 out, then 2 in and 2 out again for the merge); one kernel moves 2.5. In the H100's prefill
kernel table at a4d05c5 (`bench/profiles/kernels-h100-prefill-nightly-chunks-alone-a4d05c5.txt`) the dequantise
is 4.3% and the merges' `addmm_` 7.3% of prefill's GPU time. The merge's arithmetic is `addmm_`'s: the weight
rounded to the compute dtype as the dequantise rounds it, plus B A summed in float32, rounded once (cuBLAS sums
in another order: equal up to that). Written in the twenty-seventh session and never timed on a GPU (no machine
started for it); where it beats the two steps, it moves into `worker/fastpath/quant4.py` for `merged`.

    python -m bench nf4merge --out bench/out
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from bench.common import append_results, save_json
from bench.kernels import PROJECTIONS, graph_ms, random_nf4
from worker.fastpath.pointwise import Launcher, cdiv, triton
from worker.fastpath.quant4 import Layout4bit

# Output tile (rows x columns) a program writes; `TILES` are the ones `bench nf4merge` tries.
TILE = (64, 128)
TILES = ((32, 128), (64, 128), (64, 256), (128, 128))
WARPS = 4

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _nf4_merge_kernel(packed, absmax, code, b, a, out, rows, cols, rank, sb_r, sa_r, BS: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr):  # fmt: skip
        # A BM x BN tile of W + B A: its packed bytes (BN / 2 a row, both weights of a byte from the 16-entry
        # code, joined back into element order), each byte's scale (both its weights share a block: even columns
        # and blocks), the tile's B rows and A columns (rank padded to RP with zeros) through one dot.
        i = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        half = tl.program_id(1).to(tl.int64) * (BN // 2) + tl.arange(0, BN // 2)
        in_rows = i < rows
        in_bytes = in_rows[:, None] & (2 * half < cols)[None, :]
        byte = tl.load(packed + i[:, None] * (cols // 2) + half[None, :], mask=in_bytes, other=0).to(tl.int32)
        scale = tl.load(absmax + (i[:, None] * cols + 2 * half[None, :]) // BS, mask=in_bytes, other=0.0)
        first = (tl.load(code + (byte >> 4)) * scale).to(out.dtype.element_ty)  # a byte's first: its high nibble
        second = (tl.load(code + (byte & 15)) * scale).to(out.dtype.element_ty)
        weight = tl.reshape(tl.join(first, second), (BM, BN))
        j = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
        r = tl.arange(0, RP)
        in_rank = r < rank
        b_tile = tl.load(b + i[:, None] * sb_r + r[None, :], mask=in_rows[:, None] & in_rank[None, :], other=0.0)
        a_tile = tl.load(a + r[:, None] * sa_r + j[None, :], mask=in_rank[:, None] & (j < cols)[None, :], other=0.0)
        delta = tl.dot(b_tile, a_tile, input_precision="ieee")
        merged = (weight.to(tl.float32) + delta).to(out.dtype.element_ty)
        tl.store(out + i[:, None] * cols + j[None, :], merged, mask=in_rows[:, None] & (j < cols)[None, :])

    NF4_MERGE = Launcher(_nf4_merge_kernel, outputs=(5,), num_warps=WARPS)


def dense_merged(
    layout: Layout4bit, packed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, tile: tuple[int, int] = TILE
) -> torch.Tensor:
    """The (out, in) weight of `layout` dequantised with B (out, rank) A (rank, in) added, in the layout's dtype:
    `layout.dense(packed).addmm_(b, a)` in one kernel. Rows of whole bytes only (an even `in`)."""
    assert layout.code is not None
    rows, cols = layout.shape
    assert cols % 2 == 0 and layout.blocksize % 2 == 0, (layout.shape, layout.blocksize)
    rank = a.shape[0]
    b, a = b.to(layout.dtype).contiguous(), a.to(layout.dtype).contiguous()
    out = torch.empty(rows, cols, dtype=layout.dtype, device=packed.device)
    bm, bn = tile
    NF4_MERGE(
        (cdiv(rows, bm), cdiv(cols, bn)), packed.view(-1), layout.absmax, layout.code, b, a, out, rows, cols, rank,
        b.stride(0), a.stride(0), BS=layout.blocksize, BM=bm, BN=bn, RP=max(16, triton.next_power_of_2(rank)),
    )  # fmt: skip
    return out


def shape_report(name: str, device: torch.device) -> dict[str, Any]:
    """One projection's 28 layers, each its own weight and a rank-16 LoRA: the worker's two steps, our dequantise
    with `addmm_`, and the candidate at each of `TILES`; ms, and the largest difference from the worker's."""
    rows, cols = PROJECTIONS[name]
    layers = []
    for _ in range(28):
        weight = random_nf4((rows, cols), device)
        b = torch.randn(rows, 16, device=device, dtype=torch.bfloat16) * 0.02
        a = torch.randn(16, cols, device=device, dtype=torch.bfloat16) * 0.02
        layers.append((weight.layout, weight.packed, b, a))
    layout, packed, b, a = layers[0]
    want = layout.dense(packed).addmm_(b, a)
    ms = {
        "bitsandbytes+addmm_": graph_ms(lambda: [lo.dense(p).addmm_(bb, aa) for lo, p, bb, aa in layers]),
        "ours+addmm_": graph_ms(lambda: [lo.dense_with(p, None).addmm_(bb, aa) for lo, p, bb, aa in layers]),
    }
    error = {}
    for tile in TILES:
        label = f"fused {tile[0]}x{tile[1]}"
        error[label] = float((dense_merged(layout, packed, b, a, tile).float() - want.float()).abs().max())
        ms[label] = graph_ms(lambda tile=tile: [dense_merged(lo, p, bb, aa, tile) for lo, p, bb, aa in layers])
    return {"ms_x28": ms, "max_error": error}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench nf4merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    torch.manual_seed(0)
    report = {name: shape_report(name, device) for name in PROJECTIONS}
    print(report, flush=True)
    save_json(out_dir, "nf4merge.json", report)
    cells = []
    for name, r in report.items():
        figures = ", ".join(f"{label} {ms:.3f}" for label, ms in r["ms_x28"].items())
        worst = max(r["max_error"].values())
        cells.append(f"{name}: {figures} ms (max diff {worst:.2g})")
    command = f"`python -m bench nf4merge {' '.join(sys.argv[1:] if argv is None else argv)}`"
    append_results(
        f"| nf4merge | {torch.cuda.get_device_name(device)} | NF4 -> bf16 with a rank-16 LoRA merged, a Qwen2.5-1.5B "
        f"layer's projections x 28 layers (graph-replayed, each its own weights): the worker's dequantise then "
        f"addmm_ against one kernel | {'; '.join(cells)} | {command} |",
        out_dir,
    )
    return report


if __name__ == "__main__":
    main()
