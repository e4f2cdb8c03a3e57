"""Kernel variants against the kernels the worker runs: NF4 dequantise, SiLU x up, add + RMSNorm.

Each variant's time (Triton's `do_bench`: the L2 flushed between runs, the median) and whether its output is bit-equal
to the worker's kernel. What a variant tells is whether to change the worker's kernel, which then carries its own
tests; nothing here runs in the worker. Needs CUDA (`python -m bench variants --only nf4,silu,rms`)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch

from worker.fastpath import nf4, pointwise
from worker.fastpath.pointwise import triton

# The NF4 code (bitsandbytes' values), so the probe needs no bitsandbytes.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
# A Qwen2.5-1.5B layer's four 4-bit weights (joint q/k/v and gate/up), (out, in).
LAYER = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
BLOCKSIZE = 64

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _nf4_2d(packed, absmax, code, out, n_blocks, G: tl.constexpr, BS: tl.constexpr):
        """One scale load a block: G blocks of BS weights a program."""
        blk = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)
        j = tl.arange(0, BS)
        at = blk[:, None] * BS + j[None, :]
        inside = (blk < n_blocks)[:, None]
        b = tl.load(packed + at // 2, mask=inside, other=0).to(tl.int32)
        value = tl.load(code + tl.where((j % 2 == 0)[None, :], b >> 4, b & 15))
        scale = tl.load(absmax + blk, mask=blk < n_blocks, other=0.0)[:, None]
        tl.store(out + at, (value * scale).to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_2d(gate, up, out, M, F, s_gate, s_up, R: tl.constexpr, BLOCK: tl.constexpr):
        """R rows x BLOCK features a program, every size specialised."""
        rows = tl.program_id(0) * R + tl.arange(0, R)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = (rows < M)[:, None] & (cols < F)[None, :]
        r = rows.to(tl.int64)[:, None]
        g = tl.load(gate + r * s_gate + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        u = tl.load(up + r * s_up + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        dtype = out.dtype.element_ty
        silu = libdevice.div_rn(g, 1.0 + libdevice.exp(-g)).to(dtype)
        tl.store(out + r * F + cols[None, :], (silu.to(tl.float32) * u).to(dtype), mask=inside)

    @triton.jit
    def _add_rms_2d(h, delta, weight, h_out, x_out, M, N, eps, R: tl.constexpr, BLOCK: tl.constexpr):
        """R contiguous rows a program, every size specialised."""
        rows = tl.program_id(0) * R + tl.arange(0, R)
        cols = tl.arange(0, BLOCK)
        inside = (rows < M)[:, None] & (cols < N)[None, :]
        at = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dtype = h_out.dtype.element_ty
        total = (tl.load(h + at, mask=inside, other=0.0).to(tl.float32) + tl.load(delta + at, mask=inside, other=0.0)
                 .to(tl.float32)).to(dtype)  # fmt: skip
        tl.store(h_out + at, total, mask=inside)
        x = total.to(tl.float32)
        scale = libdevice.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        normed = (x * scale[:, None]).to(dtype)
        w = tl.load(weight + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(x_out + at, (w[None, :] * normed.to(tl.float32)).to(dtype), mask=inside)


def microseconds(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1000.0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def nf4_rows(device: torch.device) -> list[str]:
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    table = nf4.code_table(code)
    lines, totals = [], {}
    for name, (rows, cols) in LAYER.items():
        n = rows * cols
        packed = torch.randint(0, 256, (n // 2,), dtype=torch.uint8, device=device)
        absmax = torch.rand(n // BLOCKSIZE, dtype=torch.float32, device=device) + 0.01
        ours = functools.partial(
            nf4.dequantize, packed, absmax, table, shape=(rows, cols), blocksize=BLOCKSIZE, dtype=torch.bfloat16
        )
        want = ours()
        assert want is not None
        out = torch.empty_like(want)
        blocks = n // BLOCKSIZE
        variants: dict[str, Callable[[], Any]] = {"worker": ours}
        for group, warps in ((32, 4), (64, 8)):
            launch = _nf4_2d[(-(-blocks // group),)]
            variants[f"2d G{group} w{warps}"] = functools.partial(
                launch, packed, absmax, code, out, blocks, G=group, BS=BLOCKSIZE, num_warps=warps
            )
        moved = n * 2 + n // 2 + blocks * 4
        for variant, fn in variants.items():
            out.fill_(float("nan"))  # the variants share `out`: none may pass on another's values
            got = fn()
            equal = same_bits(got if isinstance(got, torch.Tensor) else out, want)
            us = microseconds(fn)
            totals[variant] = totals.get(variant, 0.0) + us
            lines.append(f"nf4 {name} {variant}: {us:.1f} us, {moved / us / 1e6:.2f} TB/s, bit-equal {equal}")
    lines += [f"nf4 layer {variant}: {us:.1f} us" for variant, us in sorted(totals.items(), key=lambda kv: kv[1])]
    return lines


def silu_rows(device: torch.device) -> list[str]:
    lines = []
    features = LAYER["down"][1]
    for m in (8192, 4096, 256):
        joint = torch.randn(m, 2 * features, dtype=torch.bfloat16, device=device)
        gate, up = joint[:, :features], joint[:, features:]
        want = pointwise.silu_mul(gate, up)
        lines.append(f"silu {m} rows worker: {microseconds(lambda g=gate, u=up: pointwise.silu_mul(g, u)):.1f} us")
        out = torch.empty_like(want)
        for rows, block, warps in ((1, 2048, 8), (2, 1024, 4), (4, 512, 4)):
            launch = _silu_2d[(-(-m // rows), -(-features // block))]
            fn = functools.partial(
                launch, gate, up, out, m, features, joint.stride(0), joint.stride(0), R=rows, BLOCK=block,
                num_warps=warps,
            )  # fmt: skip
            out.fill_(float("nan"))  # the variants share `out`: none may pass on another's values
            fn()
            us = microseconds(fn)
            lines.append(f"silu {m} rows R{rows} B{block} w{warps}: {us:.1f} us, bit-equal {same_bits(out, want)}")
    return lines


def rms_rows(device: torch.device) -> list[str]:
    lines = []
    n = LAYER["o"][0]
    for m in (8192, 256):
        h, d = (torch.randn(m, n, dtype=torch.bfloat16, device=device) for _ in range(2))
        w = torch.randn(n, dtype=torch.bfloat16, device=device)
        want_h, want_x = pointwise.add_rms(h, d, w, 1e-6)
        us = microseconds(lambda h=h, d=d, w=w: pointwise.add_rms(h, d, w, 1e-6))
        lines.append(f"rms {m} rows worker: {us:.1f} us")
        got_h, got_x = torch.empty_like(h), torch.empty_like(h)
        for rows, warps in ((2, 8), (4, 8)):
            launch = _add_rms_2d[(-(-m // rows),)]
            fn = functools.partial(launch, h, d, w, got_h, got_x, m, n, 1e-6, R=rows, BLOCK=2048, num_warps=warps)
            got_h.fill_(float("nan"))
            got_x.fill_(float("nan"))
            fn()
            equal = same_bits(got_h, want_h) and same_bits(got_x, want_x)
            lines.append(f"rms {m} rows R{rows} w{warps}: {microseconds(fn):.1f} us, bit-equal {equal}")
    return lines


SECTIONS = {"nf4": nf4_rows, "silu": silu_rows, "rms": rms_rows}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench variants", description=__doc__)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated of {', '.join(SECTIONS)}")
    args = parser.parse_args()
    asked = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in asked if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if triton is None or not torch.cuda.is_available():
        parser.exit(2, "bench variants: needs CUDA and Triton\n")
    device = torch.device("cuda")
    torch.manual_seed(0)
    for section in asked:
        for line in SECTIONS[section](device):
            print(line, flush=True)


if __name__ == "__main__":
    main()
