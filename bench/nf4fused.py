"""A candidate for the decode step's 4-bit matmuls: NF4 x bf16 fused in one Triton kernel, against what the step
runs today (our NF4 dequantise, `worker/fastpath/nf4.py`, then cuBLAS through `F.linear`). Not used by the worker:
kept to measure the next attempt against (bench/RESULTS.md, "2026-12-02, eighth session").

The kernel never writes the bf16 weight. Each program computes a (BN output features x BM rows) tile of
W x^T, stepping along K one scale block at a time (`blocksize` weights, one float32 scale per row). For each step
it loads the tile's packed bytes, looks up both nibbles' code values in a 16-entry table held in registers
(`tl.gather`; a lookup in memory became one `cp.async` per byte), scales them and rounds once to the compute dtype,
as `dequantize_4bit` rounds. The weight is the left operand, which Hopper's wgmma takes from registers. A byte
holds two neighbouring weights, so within each scale block x's even columns meet the high nibbles and its odd
columns the low ones. x arrives pre-permuted for that (`pair_permuted`: each block's even columns, then its odd
ones), so the right operand loads as contiguous runs. In the worker, the kernel that produces x would write it
in that order. The result matches the reference up to the order of summation.

    python -m bench nf4fused --rows 16,128,256 --out bench/out     # on the GPU
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bitsandbytes.functional import get_4bit_type

from bench.common import append_results, save_json
from bench.kernels import graph_ms
from worker.fastpath import nf4
from worker.fastpath.pointwise import cdiv, next_power_of_2, triton


def nf4_code(device: torch.device) -> torch.Tensor:
    """bitsandbytes' 16 NF4 code values in float32 (a byte's high nibble indexes the first of its two weights)."""
    return get_4bit_type("nf4", device=device).to(torch.float32)


# A Qwen2.5-1.5B decode step's 4-bit matmuls, (out, in) per layer: q/k/v joined, o, gate/up joined, down.
STEP_SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}

if triton is not None:
    import triton.language as tl

    # Specialised on the sizes (Triton's default): knowing x's row stride and N divisible by 16 lets it widen the
    # loads and stores (without, gate/up at 256 rows took ~2x as long).
    @triton.jit
    def _nf4_fused_kernel(x, packed, absmax, code, out, M, N, s_x, K: tl.constexpr, BS: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        dtype = out.dtype.element_ty
        rm = pid_m * BM + tl.arange(0, BM)
        in_m = rm < M
        rn = pid_n * BN + tl.arange(0, BN)
        in_n = rn < N
        half = tl.arange(0, BS // 2)
        row_bytes = rn.to(tl.int64) * (K // 2)
        row_blocks = rn.to(tl.int64) * (K // BS)
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k0 in range(0, K, BS):
            b = tl.load(packed + row_bytes[:, None] + (k0 // 2 + half)[None, :], mask=in_n[:, None], other=0)
            b = b.to(tl.int32)
            scale = tl.load(absmax + row_blocks + k0 // BS, mask=in_n, other=0.0)[:, None]
            values = tl.broadcast_to(tl.load(code + tl.arange(0, 16))[None, :], (BN, 16))
            hi = (tl.gather(values, b >> 4, 1) * scale).to(dtype)
            lo = (tl.gather(values, b & 15, 1) * scale).to(dtype)
            at = x + rm[:, None] * s_x + k0 + half[None, :]
            even = tl.load(at, mask=in_m[:, None], other=0.0)
            odd = tl.load(at + BS // 2, mask=in_m[:, None], other=0.0)
            acc = tl.dot(hi, tl.trans(even), acc)
            acc = tl.dot(lo, tl.trans(odd), acc)
        tl.store(out + rm[None, :].to(tl.int64) * N + rn[:, None], acc.to(dtype), mask=in_m[None, :] & in_n[:, None])


@dataclass(frozen=True)
class Tiles:
    rows: int  # BM: x's rows a program covers
    features: int  # BN: output features a program covers
    warps: int
    stages: int


@dataclass(frozen=True)
class Nf4Weight:
    packed: torch.Tensor  # (out * in / 2,) uint8, bitsandbytes' packing
    absmax: torch.Tensor  # (out * in / blocksize,) float32 scales
    shape: tuple[int, int]  # (out, in)
    blocksize: int

    @classmethod
    def random(cls, shape: tuple[int, int], blocksize: int, device: torch.device) -> Nf4Weight:
        out_features, in_features = shape
        n = out_features * in_features
        packed = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device=device)
        absmax = torch.rand(n // blocksize, device=device) * 0.05 + 0.01
        return cls(packed=packed, absmax=absmax, shape=shape, blocksize=blocksize)


def pair_permuted(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """x (M, K) with each block of `blocksize` columns reordered as its even columns, then its odd ones."""
    rows, features = x.shape
    return x.view(rows, features // blocksize, blocksize // 2, 2).transpose(2, 3).reshape(rows, features).contiguous()


def fused_matmul(
    permuted: torch.Tensor, weight: Nf4Weight, code: torch.Tensor, tiles: Tiles, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T for x given `pair_permuted` (M, in) and the NF4 `weight` (`code`: its 16 float32 values): (M, out).
    A program steps along K a scale block at a time: the block size a power of two from 32 (a dot's depth of 16
    a nibble) dividing the input features, so no block straddles two rows."""
    rows = permuted.shape[0]
    out_features, in_features = weight.shape
    blocksize = weight.blocksize
    if blocksize < 32 or blocksize & (blocksize - 1) or in_features % blocksize:
        raise ValueError(f"block size {blocksize} does not fit {in_features} input features (a power of two >= 32)")
    if out is None:
        out = torch.empty(rows, out_features, dtype=permuted.dtype, device=permuted.device)
    grid = (cdiv(rows, tiles.rows), cdiv(out_features, tiles.features))
    _nf4_fused_kernel[grid](
        permuted, weight.packed, weight.absmax, code, out, rows, out_features, permuted.stride(0), K=in_features,
        BS=weight.blocksize, BM=tiles.rows, BN=tiles.features, num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip
    return out


def reference_matmul(x: torch.Tensor, weight: Nf4Weight, table: torch.Tensor) -> torch.Tensor:
    """What the decode step runs today: our NF4 dequantise, then `F.linear`."""
    dense = nf4.dequantize(
        weight.packed, weight.absmax, table, shape=weight.shape, blocksize=weight.blocksize, dtype=x.dtype
    )
    assert dense is not None, "our NF4 dequantise kernel failed"
    return F.linear(x, dense)


def candidate_tiles(rows: int) -> list[Tiles]:
    """The tiles tried for `rows` rows: one program spans them (up to 256), 64 or 128 features, 4 or 8 warps."""
    span = min(256, max(16, next_power_of_2(rows)))
    return [
        Tiles(rows=span, features=features, warps=warps, stages=stages)
        for features, (warps, stages) in itertools.product((64, 128), ((4, 1), (4, 2), (8, 2)))
    ]


def shape_report(rows: int, name: str, device: torch.device, blocksize: int) -> dict[str, Any]:
    """The reference's and the best tile's microseconds for one shape at `rows` rows, and the relative error."""
    weight = Nf4Weight.random(STEP_SHAPES[name], blocksize, device)
    code = nf4_code(device)
    table = nf4.code_table(code)
    x = torch.randn(rows, weight.shape[1], device=device, dtype=torch.bfloat16)
    permuted = pair_permuted(x, blocksize)
    want = reference_matmul(x, weight, table).float()
    reference_us = graph_ms(lambda: reference_matmul(x, weight, table)) * 1000
    best: dict[str, Any] | None = None
    for tiles in candidate_tiles(rows):
        out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=device)
        got = fused_matmul(permuted, weight, code, tiles, out).float()
        error = float((got - want).abs().max() / want.abs().max())
        us = graph_ms(lambda t=tiles, o=out: fused_matmul(permuted, weight, code, t, o)) * 1000
        if error < 2e-2 and (best is None or us < best["fused_us"]):
            best = {"fused_us": round(us, 1), "tiles": vars(tiles), "error": error}
    return {"reference_us": round(reference_us, 1), **(best or {"fused_us": None})}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench nf4fused", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,128,256", help="row counts of the decode step to compare at")
    parser.add_argument("--shapes", default=",".join(STEP_SHAPES), help=f"of {', '.join(STEP_SHAPES)}")
    parser.add_argument("--blocksize", type=int, default=64, help="the weights' NF4 block size")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    if triton is None or not torch.cuda.is_available():
        parser.error("needs a CUDA GPU and Triton")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    device = torch.device("cuda")
    names = [n for n in args.shapes.split(",") if n]
    report: dict[str, Any] = {}
    for rows in (int(r) for r in args.rows.split(",")):
        for name in names:
            report[f"{rows}/{name}"] = figure = shape_report(rows, name, device, args.blocksize)
            print(rows, name, figure, flush=True)
    save_json(out_dir, "nf4fused.json", report)

    def cell(key: str) -> str:
        r = report[key]
        return f"{key} {r['reference_us']} -> {r['fused_us']} us"

    append_results(
        f"| nf4fused | H200 | NF4 x bf16 fused (candidate, not the worker's) against dequantise + cuBLAS, one "
        f"matmul graph-replayed, best tile | {'; '.join(cell(k) for k in report)} | "
        f"`python -m bench nf4fused {' '.join(sys.argv[1:] if argv is None else argv)}` |",
        out_dir,
    )
    return report


if __name__ == "__main__":
    main()
