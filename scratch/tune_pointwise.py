"""Scratch: time variants of our pointwise kernels (graph-replayed, GPU time only)."""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from worker.fastpath import pointwise as pw

dev = "cuda"
bf = torch.bfloat16


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 5 / reps * 1000  # us per call


@triton.jit
def silu2d(gate, up, out, T, F, s_gate, s_up, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = (rows[:, None] < T) & (cols[None, :] < F)
    g = tl.load(gate + rows[:, None] * s_gate + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up + rows[:, None] * s_up + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    dtype = out.dtype.element_ty
    silu = libdevice.div_rn(g, 1.0 + libdevice.exp(-g)).to(dtype)
    tl.store(out + rows[:, None] * F + cols[None, :], (silu.to(tl.float32) * u).to(dtype), mask=inside)


@triton.jit
def addrms_rows(h, delta, weight, h_out, x_out, T, N, s_h, s_d, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    inside = (rows[:, None] < T) & (cols[None, :] < N)
    dtype = h_out.dtype.element_ty
    a = tl.load(h + rows[:, None] * s_h + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    b = tl.load(delta + rows[:, None] * s_d + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    total = (a + b).to(dtype)
    tl.store(h_out + rows[:, None] * N + cols[None, :], total, mask=inside)
    x = total.to(tl.float32)
    mean = tl.sum(x * x, axis=1) / N
    scale = libdevice.rsqrt(mean + eps)
    normed = (x * scale[:, None]).to(dtype)
    w = tl.load(weight + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(x_out + rows[:, None] * N + cols[None, :], (w[None, :] * normed.to(tl.float32)).to(dtype), mask=inside)


for T in (8192, 256):
    print(f"=== T={T}")
    joined = torch.randn(T, 17920, device=dev, dtype=bf)
    g, u = joined[:, :8960], joined[:, 8960:]
    out = torch.empty(T, 8960, device=dev, dtype=bf)
    ref = pw.silu_mul(g, u)
    mb = T * 8960 * 2 * 3 / 1e6
    print(f"silu ours(1024,4): {timed(lambda: pw.silu_mul(g, u)):.1f} us ({mb:.0f} MB)")
    print(f"silu eager: {timed(lambda: torch.nn.functional.silu(g) * u):.1f} us")
    for block, warps in [(512, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16)]:
        grid = (T, triton.cdiv(8960, block))
        f = lambda: pw._silu_mul_kernel[grid](g, u, out, 8960, g.stride(0), u.stride(0), BLOCK=block, LIBDEVICE=True, num_warps=warps)
        t = timed(f)
        print(f"silu 1d block={block} warps={warps}: {t:.1f} us, equal={torch.equal(out, ref)}")
    for rows, block, warps in [(2, 1024, 4), (4, 1024, 8), (8, 512, 8), (2, 2048, 8), (4, 2048, 8), (8, 1024, 8)]:
        grid = (triton.cdiv(T, rows), triton.cdiv(8960, block))
        f = lambda: silu2d[grid](g, u, out, T, 8960, g.stride(0), u.stride(0), ROWS=rows, BLOCK=block, num_warps=warps)
        t = timed(f)
        print(f"silu 2d rows={rows} block={block} warps={warps}: {t:.1f} us, equal={torch.equal(out, ref)}")

    h = torch.randn(T, 1536, device=dev, dtype=bf)
    d = torch.randn(T, 1536, device=dev, dtype=bf)
    w = torch.randn(1536, device=dev, dtype=bf)
    rt, rn = pw.add_rms(h, d, w, 1e-6)
    ho, xo = torch.empty_like(h), torch.empty_like(h)
    print(f"add_rms ours: {timed(lambda: pw.add_rms(h, d, w, 1e-6)):.1f} us ({T*1536*2*4/1e6:.0f} MB)")
    for warps in (1, 2, 8, 16):
        f = lambda: pw._add_rms_kernel[(T, 1)](h, d, w, ho, xo, 1536, h.stride(0), d.stride(0), 1e-6, BLOCK=2048, LIBDEVICE=True, num_warps=warps)
        t = timed(f)
        print(f"add_rms 1row warps={warps}: {t:.1f} us equal={torch.equal(ho, rt) and torch.equal(xo, rn)}")
    for rows, warps in [(2, 4), (4, 4), (4, 8), (8, 8), (16, 8)]:
        f = lambda: addrms_rows[(triton.cdiv(T, rows),)](h, d, w, ho, xo, T, 1536, h.stride(0), d.stride(0), 1e-6, ROWS=rows, BLOCK=2048, num_warps=warps)
        t = timed(f)
        print(f"add_rms rows={rows} warps={warps}: {t:.1f} us equal={torch.equal(ho, rt) and torch.equal(xo, rn)}")

    qkv = torch.randn(1, T, 2048, device=dev, dtype=bf)
    qk = qkv[..., :1792].view(1, T, 14, 128)
    cos = torch.randn(1, T, 128, device=dev, dtype=bf)
    sin = torch.randn(1, T, 128, device=dev, dtype=bf)
    rr = pw.rope(qk, cos, sin)
    ro = torch.empty_like(rr)
    print(f"rope ours(BH16,4w): {timed(lambda: pw.rope(qk, cos, sin)):.1f} us ({T*1792*2*2/1e6:.0f} MB)")
    for bh, warps in [(16, 1), (16, 2), (16, 8), (8, 2), (8, 4), (4, 1), (4, 2), (2, 1)]:
        grid = (T, triton.cdiv(14, bh))
        f = lambda: pw._rope_kernel[grid](qk, cos, sin, ro, T, 14, qk.stride(0), qk.stride(1), qk.stride(2), cos.stride(0), cos.stride(1), BH=bh, D=128, num_warps=warps, enable_fp_fusion=False)
        t = timed(f)
        print(f"rope bh={bh} warps={warps}: {t:.1f} us equal={torch.equal(ro, rr)}")
