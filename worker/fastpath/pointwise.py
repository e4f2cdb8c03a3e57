"""Rotary embedding and SiLU x up as hand-written Triton kernels, with eager's rounding.

torch.compile'd with dynamic shapes (the loop's steps come in many widths), on the H200 the rotary kernel ran
at ~1/17 of its bandwidth bound and SiLU x up at ~1/2 (in prefill chunks, 11% of GPU time each; the likely
cause, not confirmed, is per-element index arithmetic over the symbolic sizes). Here one program covers a
token's heads (rotary) or a block of a token's features (SiLU x up), with offsets from the strides. Measured
(`python -m bench kernels`), 28 calls: rotary 3.0 -> 0.21 ms and SiLU x up 3.1 -> 1.5 ms at a 4,096-token
chunk, 0.13 -> 0.05 and 0.24 -> 0.14 ms at 256 decode rows.

Rounding is eager's: rotary rounds each product to the compute dtype, then the sum (compiled without
multiply-add contraction, which rounds once: bit-equal to eager on the H200); SiLU uses IEEE exp and division
(libdevice), as torch's CUDA kernel computes it in float32.

Triton is optional (the GPU build of torch brings it): without it, or off CUDA, `available` says no and the
compiled or eager functions in `ops` run. Under `TRITON_INTERPRET=1` the kernels run on the CPU (the tests).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from worker.fastpath import gemm

try:
    import triton
except ImportError:  # CPU-only installs
    triton = None

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
log = logging.getLogger("kevlaya.fastpath")

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    # Not specialised on what a chunk's length sets (Triton compiles a variant per divisibility pattern, and a
    # compile inside a take costs it seconds); the heads and the strides within a row are a model's (the warm-up
    # meets their few patterns), and specialised they let Triton vectorise.
    @triton.jit(do_not_specialize=["T", "sx_r", "sc_r"])
    def _rope_kernel(
        x, cos, sin, out, T, H, sx_r, sx_t, sx_h, sc_r, sc_t, BH: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0)
        r = token // T
        t = token % T
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        d = tl.arange(0, D)
        first = d < D // 2
        src = x + r * sx_r + t * sx_t + h[:, None] * sx_h
        inside = (h[:, None] < H) & (d[None, :] < D)
        v = tl.load(src + d[None, :], mask=inside, other=0.0)
        partner = tl.load(src + ((d + D // 2) % D)[None, :], mask=inside, other=0.0)
        rotated = tl.where(first[None, :], -partner, partner)  # HF's rotate_half
        c = tl.load(cos + r * sc_r + t * sc_t + d)[None, :]
        s = tl.load(sin + r * sc_r + t * sc_t + d)[None, :]
        dtype = out.dtype.element_ty
        a = (v.to(tl.float32) * c.to(tl.float32)).to(dtype)
        b = (rotated.to(tl.float32) * s.to(tl.float32)).to(dtype)
        y = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
        tl.store(out + (token * H + h[:, None]) * D + d[None, :], y, mask=inside)

    # The feature count and row strides specialised: they are a model's (its MLP width, its joint outputs' widths),
    # a handful of patterns compiled in the warm-up; multiples of 16 let Triton vectorise. Unspecialised, SiLU x up
    # took 140 us at 8,192 rows on the H200, 113 us specialised (`probe` of 2026-12-03).
    @triton.jit
    def _silu_mul_kernel(gate, up, out, F, s_gate, s_up, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < F
        g = tl.load(gate + row * s_gate + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(up + row * s_up + cols, mask=inside, other=0.0).to(tl.float32)
        dtype = out.dtype.element_ty
        if LIBDEVICE:
            silu = libdevice.div_rn(g, 1.0 + libdevice.exp(-g)).to(dtype)
        else:  # the interpreter (numpy's exp and division are IEEE already)
            silu = (g / (1.0 + tl.exp(-g))).to(dtype)
        tl.store(out + row * F + cols, (silu.to(tl.float32) * u).to(dtype), mask=inside)

    # Specialised as SiLU x up is, and run in 8 warps: 39.3 -> 29.7 us at 8,192 rows of 1,536 on the H200.
    @triton.jit
    def _add_rms_kernel(h, delta, weight, h_out, x_out, N, s_h, s_d, eps, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        dtype = h_out.dtype.element_ty
        a = tl.load(h + row * s_h + cols, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(delta + row * s_d + cols, mask=inside, other=0.0).to(tl.float32)
        total = (a + b).to(dtype)  # the residual sum, rounded as eager's add rounds it
        tl.store(h_out + row * N + cols, total, mask=inside)
        x = total.to(tl.float32)
        mean = tl.sum(x * x, axis=0) / N
        if LIBDEVICE:  # noqa: SIM108 (a static branch on a constexpr)
            scale = libdevice.rsqrt(mean + eps)  # CUDA's rsqrtf, as torch's rms_norm kernel computes it
        else:
            scale = 1.0 / tl.sqrt(mean + eps)
        normed = (x * scale).to(dtype)
        w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(x_out + row * N + cols, (w * normed.to(tl.float32)).to(dtype), mask=inside)


class Launcher:
    """Launches a kernel of ours, through Triton's compiled launcher once a specialisation has run. Triton's own
    `kernel[grid](...)` binds and specialises every argument again on every call: ~40-90 us of host time a
    launch in the H200 machine's profile, where a 256-row take's prefill launches ~1,700 of them while the GPU
    waits on the host. A compiled kernel is kept per what Triton specialises ours on (`specialisation`) and
    trusted only after one launch through it gave the same outputs as Triton's own, bit for bit (its launcher's
    arguments are Triton's internals: on any other version, a mismatch or an error keeps Triton's own launch
    for good). The trial holds a copy of the outputs: once per specialisation, in the engine's warm-up for the
    shapes it runs."""

    def __init__(self, kernel: Any, outputs: tuple[int, ...], **options: Any) -> None:
        self.kernel = kernel
        self.outputs = outputs  # the positions of the arguments the kernel writes (wholly; it reads no output)
        self.options = options  # compile options (Triton's own keywords), not kernel arguments
        self.compiled: dict[tuple[Any, ...], Any] = {}
        self.direct = not INTERPRETED and knobs is not None
        # Per argument, whether Triton specialises an integer there on its value (1, a multiple of 16).
        params = getattr(kernel, "params", None)
        self.specialised: Iterable[bool] = (
            tuple(not p.do_not_specialize for p in params) if params is not None else itertools.repeat(True)
        )

    def __call__(self, grid: tuple[int, int], *args: Any, **constexprs: Any) -> None:
        key = (tuple(map(specialisation, args, self.specialised)), tuple(constexprs.items()))
        compiled = self.compiled.get(key) if self.direct else None
        if compiled is not None:
            self._run(compiled, grid, args, constexprs)
            return
        compiled = self.kernel[grid](*args, **constexprs, **self.options)
        if self.direct and not torch.cuda.is_current_stream_capturing():
            self._trust(key, compiled, grid, args, constexprs)

    def _run(self, compiled: Any, grid: tuple[int, int], args: tuple[Any, ...], constexprs: dict[str, Any]) -> None:
        """Every argument in the kernel's order, as Triton's `run` hands them to the compiled launcher (with the
        launch hooks and their metadata, as it does)."""
        values = (*args, *(constexprs[n] for n in self.kernel.arg_names[len(args) :]))
        stream = raw_stream()
        hooks = knobs.runtime
        compiled.run(
            grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata,
            compiled.launch_metadata(grid, stream, *values), hooks.launch_enter_hook, hooks.launch_exit_hook, *values,
        )  # fmt: skip

    def _trust(
        self,
        key: tuple[Any, ...],
        compiled: Any,
        grid: tuple[int, int],
        args: tuple[Any, ...],
        constexprs: dict[str, Any],
    ) -> None:
        """Launch again through the compiled launcher; keep it if the outputs come out the same."""
        want = [args[i].clone() for i in self.outputs]
        try:
            for i in self.outputs:
                args[i].zero_()
            self._run(compiled, grid, args, constexprs)
            # Bit for bit (a NaN equals itself here); the outputs are fresh contiguous tensors.
            bits = lambda t: t.view(torch.uint8)  # noqa: E731
            same = all(torch.equal(bits(args[i]), bits(w)) for i, w in zip(self.outputs, want, strict=True))
        except Exception:
            same = False
        if same:
            self.compiled[key] = compiled
            return
        for i, w in zip(self.outputs, want, strict=True):
            args[i].copy_(w)
        self.direct = False
        log.warning("fast path: Triton's compiled launcher is not what we expect here; using Triton's own launch")


def specialisation(arg: Any, on_value: bool = True) -> Any:
    """What Triton compiles a variant of our kernels per, for one argument: a tensor's dtype, device and 16-byte
    alignment; an integer's width (i32 or i64, by its value) and, where Triton specialises on its value
    (`on_value`: not `do_not_specialize`), whether it is 1 and whether a multiple of 16; other values' type.
    Exact type checks first: this runs for every argument of every launch."""
    kind = type(arg)
    if kind is int or (kind is not bool and isinstance(arg, int)):
        if on_value:
            return int, -(2**31) <= arg < 2**31, arg == 1, arg % 16 == 0
        return int, -(2**31) <= arg < 2**31
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.device.index, arg.data_ptr() % 16 == 0
    return kind


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host code: Triton 3.6 makes it a constexpr function, ~8 us a call from the host."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (see `cdiv`)."""
    return 1 << max(0, n - 1).bit_length()


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether these kernels serve tensors on `device` in `dtype` (bf16/fp16 on CUDA; the CPU when interpreted)."""
    if triton is None:
        return False
    if INTERPRETED:
        return device.type == "cpu"
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding of `qk` (rows, T, heads, D), any strides with D contiguous, by cos/sin (rows or 1,
    T, D): a fresh contiguous (rows, T, heads, D) tensor. D must be a power of two (`rope_fits`)."""
    rows, length, heads, dim = qk.shape
    out = torch.empty(rows, length, heads, dim, dtype=qk.dtype, device=qk.device)
    cos, sin = cos.expand(rows, length, dim), sin.expand(rows, length, dim)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    block_heads = min(16, next_power_of_2(heads))
    grid = (rows * length, cdiv(heads, block_heads))
    with on_device(qk.device):
        ROPE(
            grid, qk, cos, sin, out, length, heads, qk.stride(0), qk.stride(1), qk.stride(2), cos.stride(0),
            cos.stride(1), BH=block_heads, D=dim,
        )  # fmt: skip
    return out


def rope_fits(qk: torch.Tensor) -> bool:
    """Whether `rope` can take `qk`: its head dimension contiguous and a power of two (one `tl.arange` spans it)."""
    dim = qk.shape[-1]
    return qk.stride(-1) == 1 and dim >= 2 and dim & (dim - 1) == 0


def check_out(who: str, out: torch.Tensor, like: torch.Tensor) -> None:
    """Refuses an `out` an elementwise kernel cannot write as `like`'s rows: of another shape, or not contiguous."""
    if out.shape != like.shape or not out.is_contiguous():
        raise ValueError(
            f"{who}: out must be contiguous and {tuple(like.shape)}; got {tuple(out.shape)}, "
            f"{'contiguous' if out.is_contiguous() else 'not contiguous'}"
        )


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(gate) x up for same-shaped (..., F) tensors whose rows are evenly strided (views of a joint output);
    written into `out` where given (same shape, contiguous: a block's slice of the whole chunk's product)."""
    features = gate.shape[-1]
    g, u = gate.reshape(-1, features), up.reshape(-1, features)
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        g, u = g.contiguous(), u.contiguous()
    if out is None:
        # The down projection's input: room for its padded rows (`gemm.empty_rows`).
        out = gemm.empty_rows(*g.shape, dtype=gate.dtype, device=gate.device)
    else:
        check_out("silu_mul", out, gate)
    block = 1024
    grid = (g.shape[0], cdiv(features, block))
    with on_device(gate.device):
        SILU_MUL(grid, g, u, out, features, g.stride(0), u.stride(0), BLOCK=block, LIBDEVICE=not INTERPRETED)
    return out.view(gate.shape)


def add_rms(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, room: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum h + delta and its RMSNorm scaled by `weight` (`ops.add_rms`' arithmetic, the sum of
    squares in another order), for same-shaped (..., N) tensors with contiguous features; both fresh tensors.
    `room`: the norm's output (the next matmul's input) holds room for its padded rows (`gemm.empty_rows`)."""
    features = h.shape[-1]
    a, b = h.reshape(-1, features), delta.reshape(-1, features)
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        a, b = a.contiguous(), b.contiguous()
    total = torch.empty(a.shape, dtype=h.dtype, device=h.device)
    allocate = gemm.empty_rows if room else torch.empty
    normed = allocate(*a.shape, dtype=h.dtype, device=h.device)
    with on_device(h.device):
        ADD_RMS(
            (a.shape[0], 1), a, b, weight, total, normed, features, a.stride(0), b.stride(0), eps,
            BLOCK=next_power_of_2(features), LIBDEVICE=not INTERPRETED,
        )  # fmt: skip
    return total.view(h.shape), normed.view(h.shape)


def add_rms_fits(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `add_rms` takes these: one dtype throughout (a float32 weight promotes eager's product) and a
    row that one program spans."""
    return (
        h.dtype == delta.dtype == weight.dtype and weight.dim() == 1 and weight.is_contiguous() and h.shape[-1] <= 16384
    )


def launched(launch: Callable[[], None], device: torch.device, what: str) -> bool:
    """`launch()` with `device` current; False where it failed (logged: our `what` kernel is an optional speed-up,
    its caller switches it off and runs its torch or bitsandbytes path from then on)."""
    try:
        with on_device(device):
            launch()
    except torch.OutOfMemoryError:
        raise
    except Exception:  # a Triton build or launch failure on this device
        log.exception("fast path: our %s kernel failed; using the path without it from now on", what)
        return False
    return True


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Triton launches on the current CUDA device and its stream: the tensors' own device made current for the
    launch (an engine on `cuda:1` does not make it current), nothing on the CPU or where it is current already
    (`torch.cuda.device` costs ~10 us of host time to build, per launch)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def raw_stream(index: int | None = None) -> int:
    """A CUDA device's current stream (default: the current device's), as the handle a compiled launcher takes:
    torch's C accessor (what Inductor's generated code calls) where this build has it;
    `torch.cuda.current_stream()` checks its argument in Python, ~30 us of host time a launch on the H200 machine."""
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(torch.cuda.current_device() if index is None else index))
    return int((torch.cuda.current_stream() if index is None else torch.cuda.current_stream(index)).cuda_stream)


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


if triton is not None:
    try:
        from triton import knobs  # Triton 3.4+: where its launcher's hooks live
    except ImportError:
        knobs = None

    ROPE = Launcher(_rope_kernel, outputs=(3,), enable_fp_fusion=False)
    SILU_MUL = Launcher(_silu_mul_kernel, outputs=(2,))
    ADD_RMS = Launcher(_add_rms_kernel, outputs=(3, 4), num_warps=8)
