"""Scratch: bf16 GEMM rates at prefill chunk shapes, both weight layouts."""
import subprocess
import torch

dev, bf = "cuda", torch.bfloat16


def timed(fn, reps=20):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps / 1000


shapes = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536), "lm_head": (1536, 151936)}
for M in (4096, 8192):
    for name, (K, N) in shapes.items():
        if name == "lm_head" and M > 4096:
            continue
        x = torch.randn(M, K, device=dev, dtype=bf)
        w = torch.randn(N, K, device=dev, dtype=bf)
        wt = w.t().contiguous()
        out = torch.empty(M, N, device=dev, dtype=bf)
        fl = 2 * M * K * N
        a = timed(lambda: torch.mm(x, w.t(), out=out))
        b = timed(lambda: torch.mm(x, wt, out=out))
        c = timed(lambda: torch.nn.functional.linear(x, w))
        print(f"M={M} {name} K={K} N={N}: NT {fl/a/1e12:.0f} TF/s ({a*1e6:.0f} us), NN {fl/b/1e12:.0f} TF/s ({b*1e6:.0f} us), linear {fl/c/1e12:.0f} TF/s")
x = torch.randn(8192, 8192, device=dev, dtype=bf); y = torch.randn(8192, 8192, device=dev, dtype=bf)
t = timed(lambda: x @ y)
print(f"square 8192: {2*8192**3/t/1e12:.0f} TF/s")
for _ in range(200):
    x @ y
print(subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active", "--format=csv"], capture_output=True, text=True).stdout)
torch.cuda.synchronize()
