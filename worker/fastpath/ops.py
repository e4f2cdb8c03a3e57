"""The elementwise steps of a decoder layer, fused where that gives the same numbers.

Residual adds with the RMSNorm after them, rotary embeddings and SiLU x up run as one torch.compile'd
(Inductor) kernel each in bf16/fp16 on a GPU, where eager launches 2-5 kernels, each a full pass over memory;
RMSNorm's statistics use torch's fused kernel. Also the attention helpers prefill and scoring share.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.fastpath import pointwise

log = logging.getLogger("kevlaya.fastpath")


class RMSNorm:
    """HF's Llama-family RMSNorm (float32 statistics, scaled in the input dtype) with torch's fused kernel
    for the statistics: 4 kernels where the module launches 8 (two of these per layer and decode step)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.weight, self.eps = module.weight, float(module.variance_epsilon)
        self.shape = (module.weight.shape[-1],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_scaled(x, self.weight, self.eps)


def norm_of(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module itself unless it is the plain RMSNorm `RMSNorm` reproduces."""
    plain = type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
    return RMSNorm(module) if plain and getattr(module, "weight", None) is not None else module


def rms_scaled(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)


def add_rms(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the next RMSNorm (HF's arithmetic: the sum rounded, statistics in float32)."""
    h = h + delta
    return h, rms_scaled(h, weight, eps)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb, element for element (rotate_half, then q * cos + rotated * sin)."""
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return (qk * cos) + (rotated * sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@dataclass(frozen=True)
class OpsOptions:
    """Which elementwise kernels the loop runs (the worker's `--no-compile` and `--pointwise-kernels`).
    `compile_ops`: the fused steps torch.compile'd (bf16/fp16 on a GPU), and prefill's rotary and SiLU x up by our
    Triton kernels where they run; off, everything eager (for comparisons). `pointwise_kernels`: the decode
    step's rotary and SiLU x up by ours too (and prefill's even without `compile_ops`)."""

    compile_ops: bool = True
    pointwise_kernels: bool = False


DEFAULT_OPS = OpsOptions()  # what the worker runs without `--no-compile` or `--pointwise-kernels`


class Fused:
    """One of the functions above, compiled by torch.compile (Inductor: one generated kernel where eager
    launches 2-5, each a full pass over memory) when asked, else run as it is. Compiled only for bf16/fp16
    compute on CUDA: Inductor keeps the eager casts (`emulate_precision_casts`), but its reductions may sum in
    another order, so float32 runs -- the exact agreement checks -- stay eager. Compiling happens at the
    first call of each shape family (the engine's warm-up); a failure to compile falls back to eager for
    good, with a log line."""

    def __init__(self, fn: Callable[..., Any], compiled: bool) -> None:
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None
        if compiled:
            import torch._inductor.config as inductor_config

            inductor_config.emulate_precision_casts = True  # round where eager rounds (bf16 intermediates)
            self.compiled = torch.compile(fn, dynamic=True)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception:  # a compiler missing or failing: the eager function computes the same
                log.exception("fast path: torch.compile of %s failed; running it eagerly", self.fn.__name__)
                self.compiled = None
        return self.fn(*args)


@dataclass
class KernelSwitch:
    """Whether our kernels run, shared by the sets that run them: off once one failed (logged), the compiled or
    eager functions computing the same from then on."""

    on: bool


class Ops:
    """The fused elementwise steps of a layer, compiled or eager (see `Fused`); with `kernels`, rotary, SiLU x up
    and (prefill's, `norm_kernel`) the residual add with its RMSNorm by our own Triton kernels (`pointwise`)
    instead (rotary and SiLU x up bit-equal to eager on the H200, 1.7-14x faster on GPU time; the norm's sum of
    squares in another order, as the compiled one's), launched with a fraction of the compiled functions' host
    time. The stack hands a kernels copy (`with_kernels`) to prefill wherever they run: in its layer-major groups
    (dequantised once per group) rotary and SiLU x up took a nightly take's prefill from 0.39 to 0.33 s (`bench
    prefill`), and a prefill chunk's layer step is as much host work as GPU work on the H200 machines. The
    decode step gets one only when asked (the worker's `--pointwise-kernels`): replayed from graphs, it has no
    host time to save, and the end-to-end rows have not shown a gain there yet (`bench/RESULTS.md`)."""

    def __init__(self, compiled: bool, kernels: bool = False) -> None:
        self.add_rms = Fused(add_rms, compiled)
        self.rms = Fused(rms_scaled, compiled)
        self.rotary = Fused(rope, compiled)
        self.silu_mul = Fused(silu_mul, compiled)
        self.switch = KernelSwitch(on=kernels)
        # Our residual-add-and-norm kernel too: prefill's only. Its sum of squares runs in another order than
        # eager's, and decode steps replay from graphs, with no host time to save.
        self.norm_kernel = False

    @property
    def kernels(self) -> bool:
        return self.switch.on

    @kernels.setter
    def kernels(self, on: bool) -> None:
        self.switch.on = on

    def with_kernels(self) -> Ops:
        """This set with our rotary and SiLU x up kernels, sharing the compiled functions (compiled once)."""
        ops = copy.copy(self)
        ops.switch = KernelSwitch(on=True)
        return ops

    def with_norm_kernel(self) -> Ops:
        """This kernels set with our residual-add-and-norm kernel too, switched off with it (one switch)."""
        ops = copy.copy(self)
        ops.norm_kernel = True
        return ops

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """HF's rotary embedding of `qk` (rows, T, heads, D) by cos/sin (rows or 1, T, D), handed back as
        (rows, heads, T, D). Our kernel reads the tokens-first layout the projection wrote; the compiled
        function runs on the heads-first view, the layout every measurement of the loop was taken on."""
        if self.kernels and pointwise.rope_fits(qk):
            out = self._ours(pointwise.rope, qk, cos, sin)
            if out is not None:
                return out.transpose(1, 2)
        return self.rotary(qk.transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))

    def _ours(self, kernel: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`kernel(*args)`, or None once it failed (logged once; the compiled or eager functions compute the
        same from then on). The first call of each is in the engine's warm-up, outside any graph capture."""
        try:
            return kernel(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception:  # a Triton build or launch failure on this device: ours are an optional speed-up
            log.exception("fast path: our %s kernel failed; using the compiled functions from now on", kernel.__name__)
            self.kernels = False
            return None

    def norm(self, norm: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        if isinstance(norm, RMSNorm):
            return self.rms(h, norm.weight, norm.eps)
        return norm(h)

    def add_norm(
        self,
        h: torch.Tensor,
        delta: torch.Tensor,
        norm: Callable[[torch.Tensor], torch.Tensor],
        *,
        room: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual sum and the norm of it; `room`: the norm's output may hold room for its padded rows
        (`pointwise.add_rms`; False for states held between prefill's layers, which the planner counts exactly)."""
        if isinstance(norm, RMSNorm):
            if self.norm_kernel and self.kernels and pointwise.add_rms_fits(h, delta, norm.weight):
                out = self._ours(pointwise.add_rms, h, delta, norm.weight, norm.eps, room=room)
                if out is not None:
                    return out
            return self.add_rms(h, delta, norm.weight, norm.eps)
        h = h + delta
        return h, norm(h)

    def act_mul(
        self,
        act: Callable[[torch.Tensor], torch.Tensor],
        gate: torch.Tensor,
        up: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """act(gate) x up; written into `out` where given (contiguous, gate's shape: a block's slice of the
        chunk's product), which is returned. Into `out`, where our kernel does not run, eagerly in place: no
        block-sized temporary beside it (the planner counts none), bit-equal to `silu_mul`."""
        silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
        if out is None:
            made = self._ours(pointwise.silu_mul, gate, up) if silu and self.kernels else None
            if made is not None:
                return made
            return self.silu_mul(gate, up) if silu else act(gate) * up
        pointwise.check_out("act_mul", out, gate)  # before our kernel, which would take a refusal for a failure
        if silu and self.kernels and self._ours(pointwise.silu_mul, gate, up, out) is not None:
            return out
        if silu:
            # SiLU straight into `out`, then the product in place: eager's roundings and its element order (a
            # copy of gate made SiLU in place ran another CPU loop, ~1 ulp off in float32).
            torch.ops.aten.silu.out(gate, out=out)
            return out.mul_(up)
        return torch.mul(act(gate), up, out=out)


def prefill_attention(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """SDPA kernels for prefill on CUDA: flash (or memory-efficient), not cuDNN. cuDNN builds an execution
    plan for every new (rows, length) shape, and prefill chunks come in many: on the H200 the nightly
    benchmark's prefill took 16.8 s with cuDNN and 8.9 s without (a warmed-up 192-row batch: 0.5 s either
    way)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Causal SDPA of (rows, heads, T, D) queries over (rows, kv_heads, T, D) keys and values, query head j
    reading KV head j // groups as in HF's repeat_kv. Where the kernel SDPA picks reads grouped heads itself
    (`enable_gqa`: flash on CUDA, every CPU kernel) K/V are not copied to every query head (~4% of prefill GPU
    time on the H200); elsewhere (CUDA float32, whose only GQA kernel is the math one with its full score
    matrix) they are, as HF does."""
    if k.shape[2] != q.shape[2]:
        return shifted_causal_attention(q, k, v, scale=scale)
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if reads_grouped_heads(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), is_causal=True, scale=scale)


def shifted_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """`causal_attention` of queries at the last L of the keys' S positions (S > L: a shared prompt prefix's
    keys before the chunk's own): query i sees keys up to S - L + i, the causal mask aligned to the bottom
    right. SDPA's `is_causal` aligns it to the top left and refuses flash for unequal lengths; flash's own causal
    kernel aligns it to the bottom right, so on CUDA that kernel runs directly (grouped KV heads read as they
    are; what torch's `causal_lower_right` does, without its tensor subclass and dispatch on every layer step),
    elsewhere SDPA under the mask itself."""
    if q.is_cuda and q.shape[-1] % 8 == 0 and reads_grouped_heads(q, k, v, causal=False):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[0]
    length, keys = q.shape[2], k.shape[2]
    sees = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sees, scale=scale)
    if sdpa_has_gqa() and not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sees, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=sees, scale=scale)


def reads_grouped_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> bool:
    """Whether causal SDPA with `enable_gqa` runs a kernel that reads the KV heads as they are: on CUDA only
    flash attention does (asked of torch for these very tensors, under the kernels `prefill_attention`
    allows), on the CPU every kernel does; never where this torch has no `enable_gqa`. `causal` False: asked
    without SDPA's causal flag, which flash refuses for queries fewer than keys (`shifted_causal_attention`
    runs flash's own causal kernel directly)."""
    if not sdpa_has_gqa():
        return False
    if q.device.type != "cuda":
        return True
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return bool(can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, causal, True)))


@functools.cache
def sdpa_has_gqa() -> bool:
    """Whether this torch's SDPA takes `enable_gqa` (torch >= 2.5)."""
    q = torch.zeros(1, 2, 1, 8)
    try:
        F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(rows, kv_heads, T, D) -> (rows, heads, T, D), head j reading KV head j // groups (HF's repeat_kv):
    equal head counts keep every SDPA kernel eligible (a copy per layer in prefill)."""
    if groups == 1:
        return x
    rows, kv_heads, length, dim = x.shape
    return x[:, :, None].expand(rows, kv_heads, groups, length, dim).reshape(rows, kv_heads * groups, length, dim)
