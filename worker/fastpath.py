"""The fast decode path: a static KV cache and one CUDA-graph-captured decode step per bucket.

HF `generate` spends most of a decode step in Python and kernel launches (measured on the H200: ~75-150 ms a
step whatever the batch size), so the GPU idles. Here greedy decoding of a batch runs as:

1. prefill by the loop's own layer code, in chunks of rows of similar length (~4,096 tokens each, bounding
   activation memory), each right-padded only to its own longest prompt so causal attention needs no mask;
   K/V go straight into a preallocated cache of `rows x cache_len` slots, where every row's prompt ends in
   the same column; 4-bit weights are dequantised by one op per projection, not bitsandbytes' Python path;
2. one decode step -- embedding, every decoder layer, the LM head, the greedy choice, its log-probability,
   stop/limit bookkeeping -- written over static buffers, so on CUDA it is captured once per (rows bucket,
   length bucket, adapters) and replayed; the host checks "all rows finished?" only every few steps;
3. LoRA applied here, not by PEFT's forward: one graph serves a mixed Kev/Laya batch by multiplying each
   adapter's delta with a per-row 0/1 mask (no Python-side split, no index copies), and a single-adapter
   batch does PEFT's arithmetic (in the compute dtype where PEFT would cast to float32 and back);
4. grouped-query attention without expanding K/V to every head: in a decode step the query length is 1, so
   the `heads / kv_heads` query heads that share a KV head are passed to SDPA as that head's query rows;
5. fewer kernels per step where the result is the same element for element: RMSNorm's statistics by torch's
   fused kernel, rotary embeddings on queries and keys together, 4-bit scales decoded once, not per call.

Supported: Llama-style decoder layers (qwen2, llama, mistral) with full attention, greedy decoding. The
engine falls back to HF `generate` (with a log line) for anything else. On CPU the loop runs without graphs,
which is how the tests check it token for token against HF `generate`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("kevlaya.fastpath")

ARCHITECTURES = ("qwen2", "llama", "mistral")
# Rows are padded up to one of these, so a handful of graphs serve every batch size. Steps of 16 from 64 to
# 256: the memory plan is rounded down to one, and a take cut at 192 where 214 fit cost a whole extra batch.
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, *range(64, 257, 16), 288, 320, 352, 384, 448, 512)
LENGTH_QUANTUM = 64  # cache lengths are multiples of this (aligned SDPA masks, few distinct graphs)
MAX_GRAPHS = 12  # captured graphs kept (least recently used dropped); each pins its static buffers
GroupDense = tuple[torch.Tensor | None, ...]
Masks = list[tuple[str, torch.Tensor | None]]  # (adapter, per-row 0/1 mask or None: every row) per LoRA delta
AdapterSelect = Callable[[Sequence[str | None]], contextlib.AbstractContextManager[dict[str, Any]]]
# Per layer: the q/k/v group's ready weights, o's, the gate/up group's, down's (a group: one joint weight or one
# per member; None: that base layer runs itself).
Dense = tuple[GroupDense, torch.Tensor | None, GroupDense, torch.Tensor | None]
NO_DENSE: Dense = ((), None, (), None)


@dataclass(frozen=True)
class DecodeRow:
    ids: list[int]
    max_new: int
    adapter: str | None


@dataclass(frozen=True)
class Decoded:
    tokens: torch.Tensor  # (rows, steps) on the CPU; past a row's end: padding
    logprobs: torch.Tensor  # (rows, steps) float32 log-probability of each chosen token
    bad: torch.Tensor  # (rows,) bool: non-finite logits seen while the row was live
    cut_short: bool  # the deadline ended the loop before every row finished


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask (1 = real token), each row left-padded to `width` (default: the longest),
    so every row's last prompt token sits in the same column."""
    width = width or max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return to_device(ids, device), to_device(mask, device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without waiting for the GPU: a plain `.to("cuda")` synchronises the stream,
    so each prefill chunk's inputs would wait for the previous chunk's kernels to finish."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def row_bucket(rows: int) -> int:
    return next((b for b in ROW_BUCKETS if b >= rows), rows)


def length_bucket(tokens: int) -> int:
    return LENGTH_QUANTUM * math.ceil(tokens / LENGTH_QUANTUM)


def unsupported_reason(model: Any) -> str | None:
    """Why the static loop cannot run this model (None when it can)."""
    lm = _causal_lm(model)
    cfg = lm.config
    if cfg.model_type not in ARCHITECTURES:
        return f"architecture {cfg.model_type!r} is not one of {', '.join(ARCHITECTURES)}"
    layer_types = getattr(cfg, "layer_types", None) or ()
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention layers"
    layer = lm.model.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(layer.self_attn, name):
            return f"attention has no {name}"
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not hasattr(layer.mlp, name):
            return f"MLP has no {name}"
    if hasattr(layer.self_attn, "q_norm"):
        return "per-head query/key norms"
    return None


def _causal_lm(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class _RMSNorm:
    """HF's Llama-family RMSNorm (float32 statistics, scaled in the input dtype) with torch's fused kernel
    for the statistics: 4 kernels where the module launches 8 (two of these per layer and decode step)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.weight, self.eps = module.weight, float(module.variance_epsilon)
        self.shape = (module.weight.shape[-1],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_scaled(x, self.weight, self.eps)


def _norm(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module itself unless it is the plain RMSNorm `_RMSNorm` reproduces."""
    plain = type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
    return _RMSNorm(module) if plain and getattr(module, "weight", None) is not None else module


def _rms_scaled(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)


def _add_rms(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the next RMSNorm (HF's arithmetic: the sum rounded, statistics in float32)."""
    h = h + delta
    return h, _rms_scaled(h, weight, eps)


def _rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb, element for element (rotate_half, then q * cos + rotated * sin)."""
    half = qk.shape[-1] // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    return (qk * cos) + (rotated * sin)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _Fused:
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


class _Ops:
    """The fused elementwise steps of a layer, compiled or eager (see `_Fused`)."""

    def __init__(self, compiled: bool) -> None:
        self.add_rms = _Fused(_add_rms, compiled)
        self.rms = _Fused(_rms_scaled, compiled)
        self.rope = _Fused(_rope, compiled)
        self.silu_mul = _Fused(_silu_mul, compiled)

    def norm(self, norm: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        if isinstance(norm, _RMSNorm):
            return self.rms(h, norm.weight, norm.eps)
        return norm(h)

    def add_norm(
        self, h: torch.Tensor, delta: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(norm, _RMSNorm):
            return self.add_rms(h, delta, norm.weight, norm.eps)
        h = h + delta
        return h, norm(h)

    def act_mul(
        self, act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor
    ) -> torch.Tensor:
        if isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation":
            return self.silu_mul(gate, up)
        return act(gate) * up


@torch.no_grad()
def float_absmax(state: Any) -> torch.Tensor | None:
    """A 4-bit weight's per-block scales in float32, computed once as bitsandbytes computes them per call:
    with double quantisation they are themselves 8-bit, and decoding them costs two kernels every time.
    None for a layout bitsandbytes itself does not run (nested scales in blocks other than 256)."""
    if len(state.shape) != 2:
        return None
    if not state.nested:
        return state.absmax
    if state.state2.blocksize != 256:
        return None
    absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
        state.absmax, state.state2.absmax, state.state2.code, 256, torch.float32
    )
    return absmax + state.offset


@dataclass(frozen=True)
class _Layout4bit:
    """How bitsandbytes reads a packed 4-bit weight (one projection's, or a group's joint buffer), and its two
    ops on it, called directly: without decoding the scales again or bitsandbytes' ~150 us of Python a call."""

    absmax: torch.Tensor  # float32 per-block scales
    blocksize: int
    quant_type: str
    shape: list[int]  # (out, in) of the unpacked weight
    dtype: torch.dtype  # compute dtype

    def dense(self, packed: torch.Tensor) -> torch.Tensor:
        """The weight dequantised as bitsandbytes' dequantise-then-linear path does it for large inputs."""
        return torch.ops.bitsandbytes.dequantize_4bit.default(
            packed, self.absmax, self.blocksize, self.quant_type, self.shape, self.dtype
        )

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """bitsandbytes' own 4-bit matmul op (its kernel choice by batch size), as `Linear4bit.forward` calls it."""
        out = torch.ops.bitsandbytes.gemm_4bit.default(
            x.to(self.dtype), packed, self.shape, self.absmax, self.blocksize, self.quant_type, bias=bias
        )
        return out.to(x.dtype)


@dataclass(frozen=True)
class _Lora:
    a: torch.nn.Module
    b: torch.nn.Module
    scaling: float


class _Proj:
    """One linear of a decoder layer: its base layer and, when PEFT wrapped it, each adapter's A, B, scale.

    PEFT keeps adapter weights in float32, so with a bf16/fp16 model every LoRA call costs a cast in, two
    float32 matmuls, a scale, a cast out and an add: six small kernels per adapter and projection, ~45% of
    a decode step's GPU time in the measured kernel table. Where that cast is needed the loop instead uses
    compute-dtype copies with the scale folded into B (`linear` + `addmm`, two kernels); where it is not
    (float32 models, the CPU tests) it keeps PEFT's exact arithmetic."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, *, fuse: bool = True) -> None:
        self.base = getattr(module, "base_layer", module)
        self.lora: dict[str, _Lora] = {}
        self.fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if hasattr(module, "lora_A"):
            for name in module.lora_A:
                lora = _Lora(module.lora_A[name], module.lora_B[name], float(module.scaling[name]))
                self.lora[name] = lora
                plain = lora.a.bias is None and lora.b.bias is None
                if fuse and plain and lora.a.weight.dtype != dtype:
                    with torch.no_grad():
                        self.fused[name] = (lora.a.weight.to(dtype), (lora.b.weight * lora.scaling).to(dtype))
        # PEFT's bnb layers cast the delta to the output dtype before adding; its plain layers add, then cast.
        self.cast_delta_first = type(module).__module__.endswith("lora.bnb")
        self.dtype = dtype
        # On CPU bitsandbytes repacks a 4-bit weight for its own kernel at the first call: leave it to that.
        state = getattr(self.base.weight, "quant_state", None)
        on_gpu = self.base.weight.device.type == "cuda"
        self._absmax = float_absmax(state) if state is not None and on_gpu else None

    def dense(self) -> torch.Tensor | None:
        """The base weight ready for `F.linear`: a plain layer's own weight, or a CUDA 4-bit weight dequantised
        by one op (`_Layout4bit.dense`). None: the base layer must run itself (4-bit on CPU, where
        bitsandbytes repacks the weight for its own kernel)."""
        weight = self.base.weight
        if getattr(weight, "quant_state", None) is None:
            return weight if isinstance(self.base, torch.nn.Linear) and weight.dtype == self.dtype else None
        layout = self._layout()
        return None if layout is None else layout.dense(weight.view(-1, 1))

    def _layout(self) -> _Layout4bit | None:
        """This 4-bit weight's layout on its float32 scales (None: no scales decoded, the module runs)."""
        if self._absmax is None:
            return None
        state = self.base.weight.quant_state
        dtype = getattr(self.base, "compute_dtype", None) or self.dtype
        return _Layout4bit(
            absmax=self._absmax, blocksize=state.blocksize, quant_type=state.quant_type, shape=list(state.shape),
            dtype=dtype,
        )  # fmt: skip

    def merged(self, adapter: str | None) -> torch.Tensor | None:
        """`dense()` with `adapter`'s fused LoRA delta added into the weight (W + B A, one small matmul per
        prefill chunk instead of two on every token); None where that cannot be done exactly as planned (no
        ready weight, or PEFT's float32 arithmetic kept)."""
        weight = self.dense()
        if weight is None or adapter is None or adapter not in self.lora:
            return weight
        if adapter not in self.fused:
            return None
        a, b = self.fused[adapter]
        return torch.addmm(weight, b, a)

    def __call__(self, x: torch.Tensor, masks: Masks, dense: torch.Tensor | None = None) -> torch.Tensor:
        return self.add_lora(self.base_out(x, dense), x, masks)

    def base_out(self, x: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        if dense is not None:
            bias = self.base.bias
            return F.linear(x.to(dense.dtype), dense, None if bias is None else bias.to(dense.dtype)).to(x.dtype)
        if (layout := self._layout()) is not None:
            bias = None if self.base.bias is None else self.base.bias.to(layout.dtype)
            return layout.matmul(x, self.base.weight.view(-1, 1), bias)
        return self.base(x)

    def add_lora(self, result: torch.Tensor, x: torch.Tensor, masks: Masks) -> torch.Tensor:
        """`result` (this projection's base output) plus each adapter's delta, masked per row when mixed."""
        out_dtype = result.dtype
        for name, mask in masks:
            if name in self.fused:
                a, b = self.fused[name]
                result = _fused_delta(result, x, a, b, mask)
                continue
            lora = self.lora.get(name)
            if lora is None:
                continue
            delta = lora.b(lora.a(x.to(lora.a.weight.dtype))) * lora.scaling
            if self.cast_delta_first:
                delta = delta.to(out_dtype)
            if mask is not None:
                delta = delta * mask
            result = result + delta
        return result.to(out_dtype)


def _fused_delta(
    result: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """result + mask * (x A^T) B^T in two kernels (`linear`, then `addmm` adding into the result)."""
    low = F.linear(x, a)
    if mask is not None:
        low = low * mask
    flat = torch.addmm(result.reshape(-1, result.shape[-1]), low.reshape(-1, low.shape[-1]), b.t())
    return flat.view(result.shape)


class _Group:
    """Projections of one input (q/k/v; gate/up) as one matmul: their weights concatenated along the output
    dimension. A decode step then launches one 4-bit dequantise-and-matmul where it launched three, and
    prefill dequantises once per group, not per projection; the outputs are views of the joint result.

    The members' own weights become views of the joint buffer (no second copy in memory), so PEFT's forward
    -- the fallback paths -- reads the same bytes. 4-bit weights join when they share block size, type and
    compute dtype: 4-bit blocks never straddle two matrices (each holds a multiple of 64 weights), so the
    joint dequantisation gives the members' values element for element. LoRA deltas join too where the loop
    fuses them (compute-dtype copies): A's stacked, B block-diagonal, so one `linear` + `addmm` per adapter
    serves the group; elsewhere each member adds PEFT's exact delta to its slice."""

    def __init__(self, projs: list[_Proj], dtype: torch.dtype, *, join: bool = True) -> None:
        self.projs = projs
        self.sizes = [p.base.out_features for p in projs]
        # join=False: the members run one by one (to compare against the joint matmul).
        self.joint = _join_bases(projs, dtype) if join and len(projs) > 1 else None
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        names = set(projs[0].fused)
        if self.joint is not None and names and all(set(p.fused) == names and not p.lora.keys() - names for p in projs):
            with torch.no_grad():
                for name in names:
                    self.lora[name] = (torch.cat([p.fused[name][0] for p in projs]), _block_diagonal(
                        [p.fused[name][1] for p in projs]))  # fmt: skip
            for p in projs:
                p.fused = {}  # the joint copies replace them

    def dense(self) -> GroupDense:
        if self.joint is not None:
            return (self.joint.dense(),)
        return tuple(p.dense() for p in self.projs)

    def merged(self, adapter: str | None) -> GroupDense | None:
        """`dense()` with `adapter`'s LoRA merged into the weights (see `_Proj.merged`), or None."""
        if self.joint is None:
            parts = tuple(p.merged(adapter) for p in self.projs)
            return None if any(part is None for part in parts) else parts
        weight = self.joint.dense()
        if adapter is None or not any(adapter in p.lora for p in self.projs):
            return (weight,)
        if adapter not in self.lora:
            return None
        a, b = self.lora[adapter]
        return (torch.addmm(weight, b, a),)

    def __call__(
        self, x: torch.Tensor, masks: Masks, dense: GroupDense = ()
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Each member's output, and the joint output they are views of (None: members ran separately)."""
        if self.joint is None:
            dense = dense or (None,) * len(self.projs)
            return [p(x, masks, d) for p, d in zip(self.projs, dense, strict=True)], None
        joint = self.joint.base_out(x, dense[0] if dense else None)
        if self.lora:
            for name, mask in masks:
                if name in self.lora:  # else no member has this adapter's LoRA
                    a, b = self.lora[name]
                    joint = _fused_delta(joint, x, a, b, mask)
            return list(joint.split(self.sizes, dim=-1)), joint
        parts = joint.split(self.sizes, dim=-1)
        return [p.add_lora(part, x, masks) for p, part in zip(self.projs, parts, strict=True)], None


def _block_diagonal(blocks: list[torch.Tensor]) -> torch.Tensor:
    """(sum out, sum r) with each (out_i, r_i) block on the diagonal: the stacked low-rank inputs of one
    member only reach that member's outputs (the zeros add exactly nothing)."""
    out = blocks[0].new_zeros(sum(b.shape[0] for b in blocks), sum(b.shape[1] for b in blocks))
    row = col = 0
    for b in blocks:
        out[row : row + b.shape[0], col : col + b.shape[1]] = b
        row, col = row + b.shape[0], col + b.shape[1]
    return out


class _JointBase:
    """The concatenated base weights of a `_Group`, as a `_Proj` runs its base layer (4-bit or plain)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant: _Layout4bit | None) -> None:
        self.weight, self.bias, self.quant = weight, bias, quant

    def dense(self) -> torch.Tensor:
        return self.weight if self.quant is None else self.quant.dense(self.weight)

    def base_out(self, x: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        if dense is None and self.quant is not None:
            return self.quant.matmul(x, self.weight, self.bias)
        weight = self.weight if dense is None else dense
        return F.linear(x.to(weight.dtype), weight, self.bias).to(x.dtype)


@torch.no_grad()
def _join_bases(projs: list[_Proj], dtype: torch.dtype) -> _JointBase | None:
    """One buffer for the members' base weights (and biases), the members' weights rebound to views of it;
    None where they cannot join (4-bit on the CPU, mixed layouts or dtypes, a base layer of another kind)."""
    bases = [p.base for p in projs]
    states = [getattr(b.weight, "quant_state", None) for b in bases]
    if len({b.in_features for b in bases}) != 1:
        return None
    if all(s is None for s in states):
        if not all(isinstance(b, torch.nn.Linear) and b.weight.dtype == dtype for b in bases):
            return None
        weight = torch.cat([b.weight.data for b in bases])
        _rebind([b.weight for b in bases], weight)
        return _JointBase(weight, _joint_bias(bases, dtype), None)
    if any(s is None for s in states) or any(p._absmax is None for p in projs):
        return None
    compute = {getattr(b, "compute_dtype", None) or dtype for b in bases}
    layouts = {(s.blocksize, s.quant_type) for s in states}
    if len(compute) != 1 or len(layouts) != 1 or any(math.prod(s.shape) % s.blocksize for s in states):
        return None
    (blocksize, quant_type), (compute_dtype,) = layouts.pop(), compute
    weight = torch.cat([b.weight.data.reshape(-1) for b in bases]).view(-1, 1)
    _rebind([b.weight for b in bases], weight)
    absmax = torch.cat([p._absmax for p in projs])
    for p, view in zip(projs, absmax.split([p._absmax.numel() for p in projs]), strict=True):
        if p._absmax is p.base.weight.quant_state.absmax:
            p.base.weight.quant_state.absmax = view  # plain (not nested) scales: bitsandbytes' own, shared
        p._absmax = view
    shape = [sum(s.shape[0] for s in states), states[0].shape[1]]
    layout = _Layout4bit(absmax=absmax, blocksize=blocksize, quant_type=quant_type, shape=shape, dtype=compute_dtype)
    return _JointBase(weight, _joint_bias(bases, compute_dtype), layout)


def _joint_bias(bases: list[torch.nn.Module], dtype: torch.dtype) -> torch.Tensor | None:
    if all(b.bias is None for b in bases):
        return None
    return torch.cat([
        b.bias.to(dtype) if b.bias is not None else torch.zeros(b.out_features, dtype=dtype, device=b.weight.device)
        for b in bases
    ])  # fmt: skip


def _rebind(params: list[torch.Tensor], joint: torch.Tensor) -> None:
    """Each parameter's data becomes its slice of `joint` (same shape): one copy of the weights in memory."""
    offset = 0
    for param in params:
        n = param.data.numel()
        param.data = joint.reshape(-1)[offset : offset + n].view(param.data.shape)
        offset += n


class _Layer:
    def __init__(self, layer: torch.nn.Module, dtype: torch.dtype, fuse: bool, join: bool = True) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)

        def group(module: torch.nn.Module, *names: str) -> _Group:
            return _Group([_Proj(getattr(module, n), dtype, fuse=fuse) for n in names], dtype, join=join)

        self.qkv = group(attn, "q_proj", "k_proj", "v_proj")
        self.o = _Proj(attn.o_proj, dtype, fuse=fuse)
        self.gate_up = group(mlp, "gate_proj", "up_proj")
        self.down = _Proj(mlp.down_proj, dtype, fuse=fuse)
        self.act = mlp.act_fn
        self.scaling = float(attn.scaling)

    def dense(self) -> Dense:
        return (self.qkv.dense(), self.o.dense(), self.gate_up.dense(), self.down.dense())

    def merged(self, masks: Masks) -> Dense | None:
        """Ready weights with the one adapter of a single-adapter chunk merged in (its LoRA then costs nothing
        per token), or None: a mixed chunk, or a projection that cannot merge."""
        if len(masks) > 1 or (masks and masks[0][1] is not None):
            return None
        adapter = masks[0][0] if masks else None
        qkv, gate_up = self.qkv.merged(adapter), self.gate_up.merged(adapter)
        o, down = self.o.merged(adapter), self.down.merged(adapter)
        if qkv is None or gate_up is None or o is None or down is None:
            return None
        return (qkv, o, gate_up, down)


@dataclass(frozen=True)
class _Ends:
    """How a row ends: the id a non-finite row is forced to emit, the padding finished rows emit, and every
    stop id. Part of a graph's key: the ids are baked into (or owned by) the captured step."""

    end_id: int
    pad_id: int
    stops: tuple[int, ...]


class _State:
    """Every tensor one graph reads and writes (a captured graph reads them by address, so it owns them all);
    the KV tensors are views of the shared pool for its rows x length."""

    def __init__(
        self,
        rows: int,
        length: int,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        ends: _Ends,
        device: torch.device,
    ) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.rows, self.length, self.kv = rows, length, kv
        # The stop ids live here, not in a tensor built per call: a captured graph reads them by address, and a
        # per-call tensor's block is reused by the allocator once the call returns (no early stop, or a stray
        # token taken for a stop, on a later replay).
        self.end_id, self.pad_id = ends.end_id, ends.pad_id
        self.stop = torch.tensor(ends.stops, dtype=torch.long, device=device)
        self.ids = zeros(rows, 1)
        self.pos = zeros(rows, 1)
        self.cache_pos = zeros(1)
        self.step = zeros(1)
        self.limits = zeros(rows)
        self.mask = zeros(rows, 1, 1, length, dtype=torch.bool)
        self.tokens = zeros(rows, length)
        self.logprobs = zeros(rows, length, dtype=torch.float32)
        self.finished = zeros(rows, dtype=torch.bool)
        self.bad = zeros(rows, dtype=torch.bool)
        self.adapter_masks: dict[str, torch.Tensor] = {}


@dataclass(frozen=True)
class _Chunk:
    """One prefill chunk: its rows of the batch (a slice, or an index tensor) and where their K/V go."""

    where: slice | torch.Tensor
    ids: torch.Tensor  # (rows, span) right-padded prompt tokens
    rows: torch.Tensor  # (rows, 1) the batch rows, for the cache writes
    columns: torch.Tensor  # (rows, span) the cache column of each token
    last: torch.Tensor  # (rows,) each row's last prompt token
    masks: Masks


class StaticDecoder:
    """Greedy batched decoding over a static KV cache, with CUDA graphs when the device is a GPU."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        *,
        use_graphs: bool,
        check_every: int = 8,
        prefill_tokens: int = 4096,
        fuse_lora: bool = True,
        join_projections: bool = True,
        merge_lora: bool = True,
        compile_ops: bool = True,
    ) -> None:
        self.model = model  # what prefill calls (the PEFT wrapper, so adapters apply)
        lm = _causal_lm(model)
        cfg = lm.config
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"
        self.check_every = check_every
        # A captured graph of up to this many times a batch's rows serves it (no graphs, nothing to save).
        self.reuse_slack = 1.5 if self.use_graphs else 1.0
        self.prefill_tokens = prefill_tokens
        # Prefill a single-adapter chunk with its (fused) LoRA merged into the dequantised weights.
        self.merge_lora = merge_lora
        self.own_prefill = True  # False: prefill through the model's forward (after a failure, or to compare)
        self.embed, self.norm, self.rotary = lm.model.embed_tokens, _norm(lm.model.norm), lm.model.rotary_emb
        self.head = lm.lm_head
        self.dtype = self.embed.weight.dtype
        # Residual adds with the norms after them, rotary, SiLU x up: one compiled kernel each (bf16/fp16 on a GPU).
        compiled = compile_ops and device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
        self.ops = _Ops(compiled)
        # fuse_lora=False keeps PEFT's float32 LoRA arithmetic in bf16/fp16 models too (slower; for comparisons).
        # join_projections=False runs q/k/v and gate/up as separate matmuls (for comparisons).
        layers = lm.model.layers[: cfg.num_hidden_layers]
        self.layers = [_Layer(layer, self.dtype, fuse_lora, join_projections) for layer in layers]
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self._pool: torch.Tensor | None = None
        self._graphs: OrderedDict[tuple[Any, ...], tuple[_State, torch.cuda.CUDAGraph | None]] = OrderedDict()
        self._graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.captures = 0  # graphs captured so far (a benchmark figure)
        self.phase_s: Counter[str] = Counter()  # seconds per phase of `decode` (and steps), for benchmarks

    # ---- memory ------------------------------------------------------------------------------
    def _kv_views(self, rows: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer K and V views into one pool, so graphs of different buckets share the memory (only one
        batch decodes at a time). Growing the pool moves it, which invalidates every captured graph."""
        per = rows * self.kv_heads * length * self.head_dim
        need = 2 * len(self.layers) * per
        if self._pool is None or self._pool.numel() < need:
            self.release()
            self._pool = torch.zeros(need, dtype=self.dtype, device=self.device)
        shape = (rows, self.kv_heads, length, self.head_dim)
        views = []
        for i in range(len(self.layers)):
            k = self._pool[2 * i * per : (2 * i + 1) * per].view(shape)
            v = self._pool[(2 * i + 1) * per : (2 * i + 2) * per].view(shape)
            views.append((k, v))
        return views

    def holds_memory(self) -> bool:
        """Whether `release` would free anything: a KV pool or captured graphs."""
        return self._pool is not None or bool(self._graphs)

    def release(self) -> None:
        """Drop the graphs and the KV pool (after an out-of-memory error, or to hand memory back)."""
        self._graphs.clear()
        self._pool = None
        if self.use_graphs:
            # A graph memory pool whose graphs are all gone cannot take a new capture (the allocator asserts
            # on it), so later captures share a fresh one.
            self._graph_pool = torch.cuda.graph_pool_handle()

    # ---- the step ----------------------------------------------------------------------------
    def _masks(self, state: _State, adapters: tuple[str, ...], mixed: bool) -> Masks:
        if not mixed:
            return [(name, None) for name in adapters]
        return [(name, state.adapter_masks[name]) for name in adapters]

    def _forward(self, state: _State, masks: Masks) -> torch.Tensor:
        """Logits (rows, vocab) for the tokens in `state.ids`, their K/V written at `state.cache_pos`."""
        rows = state.rows
        h = self.embed(state.ids)
        cos, sin = self.rotary(h, state.pos)
        groups = self.heads // self.kv_heads
        x = self.ops.norm(self.layers[0].norm1, h)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, state.kv, strict=True)):
            q, k, v = self._qkv(layer, x, masks, cos, sin)
            k_cache.index_copy_(2, state.cache_pos, k)
            v_cache.index_copy_(2, state.cache_pos, v)
            # Query length 1: the query heads sharing a KV head become that head's query rows -- GQA with no
            # K/V expansion. Head j uses KV head j // groups, as in HF's repeat_kv.
            q = q.reshape(rows, self.kv_heads, groups, self.head_dim)
            out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=state.mask, scale=layer.scaling)
            attn = out.reshape(rows, 1, self.heads * self.head_dim)
            h, x = self._rest(layer, h, attn, masks, self._next_norm(i))
        return self.head(x)[:, 0]

    def _next_norm(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The norm after layer i: the next layer's input norm, or the model's final one."""
        return self.layers[i + 1].norm1 if i + 1 < len(self.layers) else self.norm

    def _qkv(
        self,
        layer: _Layer,
        x: torch.Tensor,
        masks: Masks,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dense: Dense = NO_DENSE,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, heads, T, D) queries and (rows, kv_heads, T, D) keys/values of the normed input `x`, rotary
        applied as HF applies it."""
        rows, width = x.shape[:2]
        (q, k, v), joint = layer.qkv(x, masks, dense[0])
        v = v.reshape(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
        # Rotary on queries and keys together (half the kernels): adjacent in the joint output, they need no
        # concatenation.
        qk_width = (self.heads + self.kv_heads) * self.head_dim
        qk = joint[..., :qk_width] if joint is not None else torch.cat((q, k), dim=-1)
        qk = qk.view(rows, width, self.heads + self.kv_heads, self.head_dim).transpose(1, 2)
        qk = self.ops.rope(qk, cos.unsqueeze(1), sin.unsqueeze(1))
        return qk[:, : self.heads], qk[:, self.heads :], v

    def _rest(
        self,
        layer: _Layer,
        h: torch.Tensor,
        attn: torch.Tensor,
        masks: Masks,
        next_norm: Callable[[torch.Tensor], torch.Tensor],
        dense: Dense = NO_DENSE,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after attention -- output projection and residual, the MLP and its residual -- and the
        next norm's output (each residual add fused with the norm after it)."""
        h, x = self.ops.add_norm(h, layer.o(attn, masks, dense[1]), layer.norm2)
        (gate, up), _ = layer.gate_up(x, masks, dense[2])
        return self.ops.add_norm(h, layer.down(self.ops.act_mul(layer.act, gate, up), masks, dense[3]), next_norm)

    def _choose(self, state: _State, logits: torch.Tensor) -> None:
        """Greedy choice and bookkeeping, all on the device (no host sync): as HF's greedy search does it --
        argmax of the float32 logits, finished rows emit padding -- plus the chosen token's log-probability
        and non-finite rows forced to end (flagged, so their batch-mates carry on)."""
        logits = logits.float()
        finite = torch.isfinite(logits).all(dim=-1)
        token = torch.where(finite, logits.argmax(dim=-1), state.end_id)
        logprob = logits.log_softmax(dim=-1).gather(1, token.unsqueeze(1)).squeeze(1)
        state.bad |= ~finite & ~state.finished
        token = torch.where(state.finished, state.pad_id, token)
        state.tokens.index_copy_(1, state.step, token.unsqueeze(1))
        state.logprobs.index_copy_(1, state.step, logprob.unsqueeze(1))
        state.finished |= torch.isin(token, state.stop) | (state.step + 1 >= state.limits)
        state.ids.copy_(token.unsqueeze(1))
        state.pos += 1
        state.cache_pos += 1
        state.step += 1

    def _step(self, state: _State, masks: Masks) -> None:
        state.mask.index_fill_(-1, state.cache_pos, True)  # the slot this step writes is now attended
        self._choose(state, self._forward(state, masks))

    # ---- graphs ------------------------------------------------------------------------------
    def _entry(
        self,
        rows: int,
        length: int,
        adapters: tuple[str, ...],
        mixed: bool,
        ends: _Ends,
    ) -> tuple[_State, Callable[[], None]]:
        rest = (adapters, mixed, ends)
        rows = self._reusable_rows(rows, length, rest)
        key = (rows, length, *rest)
        kv = self._kv_views(rows, length)  # first: may clear the graphs
        if key not in self._graphs:
            state = _State(rows, length, kv, ends, self.device)
            for name in adapters if mixed else ():
                state.adapter_masks[name] = torch.zeros(rows, 1, 1, dtype=self.dtype, device=self.device)
            graph = self._capture(state, self._masks(state, adapters, mixed)) if self.use_graphs else None
            self._graphs[key] = (state, graph)
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        state, graph = self._graphs[key]
        if graph is not None:
            return state, graph.replay
        masks = self._masks(state, adapters, mixed)
        return state, lambda: self._step(state, masks)

    def _reusable_rows(self, rows: int, length: int, rest: tuple[Any, ...]) -> int:
        """The rows of an already captured graph that can serve this batch instead of a new capture: same
        length and adapters, at most `reuse_slack` x the rows (its extra rows idle along). A capture costs
        ~0.5 s on the H200; a step of 256 rows costs ~5% more than one of 224."""
        fits = [
            k[0] for k in self._graphs if k[1] == length and k[2:] == rest and rows <= k[0] <= rows * self.reuse_slack
        ]
        return min(fits, default=rows)

    def _capture(self, state: _State, masks: Masks) -> Any:
        # Warm up on a side stream first (lazy cuBLAS/bnb initialisation must not happen inside a capture);
        # the warm-up writes garbage into the state, which every batch overwrites before replaying.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(state, masks)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            # Blocks cached for ordinary allocations cannot be handed to the graph's pool while it captures
            # (freeing them there is not allowed), so under a memory cap a capture runs out of memory unless
            # the cache is emptied first -- as `torch.cuda.graph(...)` does, but without its garbage
            # collection (~0.6 s a capture in the nightly profile).
            torch.cuda.empty_cache()
            with torch.cuda.stream(stream):
                graph.capture_begin(self._graph_pool)
                try:
                    self._step(state, masks)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        except RuntimeError as exc:
            self.release()
            if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc):
                # The engine splits the batch on this; whatever else broke the capture stays a RuntimeError.
                raise torch.OutOfMemoryError(f"out of memory while capturing a decode graph: {exc}") from exc
            raise
        self.captures += 1
        self.phase_s["captures"] += 1
        return graph

    # ---- one batch ---------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(
        self,
        rows: Sequence[DecodeRow],
        *,
        stop_ids: Sequence[int],
        pad_id: int,
        select: AdapterSelect,
        deadline: float | None = None,
    ) -> Decoded:
        """Greedy-decode every row to its stop token or its own `max_new`; `select(adapters)` is the engine's
        adapter choice for the prefill forward passes (PEFT's own path)."""
        n = len(rows)
        width = max(len(r.ids) for r in rows)
        max_new = max(r.max_new for r in rows)
        bucket = row_bucket(n)
        length = length_bucket(width + max_new)
        names = {r.adapter for r in rows}
        adapters = tuple(sorted(a for a in names if a is not None))
        mixed = len(names) > 1
        ends = _Ends(end_id=stop_ids[0], pad_id=pad_id, stops=tuple(sorted(set(stop_ids))))
        started = time.perf_counter()
        state, replay = self._entry(bucket, length, adapters, mixed, ends)
        self._reset(state, rows, width, adapters if mixed else ())
        prefill_at = time.perf_counter()
        first = self._prefill(state, rows, width, select, pad_id)
        self._choose(state, first)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # one wait per batch, so the phase times below are the GPU's
        decode_at = time.perf_counter()
        steps = 1
        cut_short = False
        while steps < max_new:
            for _ in range(min(self.check_every, max_new - steps)):
                replay()
                steps += 1
            if bool(state.finished[:n].all()):
                break
            if deadline is not None and time.monotonic() >= deadline:
                cut_short = True
                break
        cpu = torch.device("cpu")  # copies: on the CPU `.cpu()` would hand out views the next batch overwrites
        result = Decoded(
            tokens=state.tokens[:n, :steps].to(cpu, copy=True),
            logprobs=state.logprobs[:n, :steps].to(cpu, copy=True),
            bad=state.bad[:n].to(cpu, copy=True),
            cut_short=cut_short,  # only set while some row is unfinished
        )
        done = time.perf_counter()
        self.phase_s["setup"] += prefill_at - started  # graph captures included
        self.phase_s["prefill"] += decode_at - prefill_at
        self.phase_s["decode"] += done - decode_at
        self.phase_s["decode_steps"] += steps
        log.debug(
            "batch rows=%d bucket=%d length=%d width=%d steps=%d setup=%.3fs prefill=%.3fs decode=%.3fs captures=%d",
            n, state.rows, length, width, steps, prefill_at - started, decode_at - prefill_at, done - decode_at,
            self.captures,
        )  # fmt: skip
        return result

    def _reset(self, state: _State, rows: Sequence[DecodeRow], width: int, mixed_adapters: tuple[str, ...]) -> None:
        """Fresh state for a batch: zeroed cache (stale or uninitialised slots must not hold NaNs: a masked
        slot's weight is 0, but 0 x NaN is NaN), masks over each row's real tokens, per-row limits."""
        n, bucket = len(rows), state.rows
        for k, v in state.kv:
            k.zero_()
            v.zero_()
        mask = torch.zeros(bucket, state.length, dtype=torch.bool)
        pos = torch.zeros(bucket, 1, dtype=torch.long)
        limits = torch.ones(bucket, dtype=torch.long)
        finished = torch.ones(bucket, dtype=torch.bool)  # bucket padding rows are finished from the start
        mask[n:, width - 1] = True
        for i, row in enumerate(rows):
            mask[i, width - len(row.ids) : width] = True
            pos[i, 0] = len(row.ids) - 1  # _choose advances it to the first generated token's position
            limits[i] = row.max_new
            finished[i] = False
        state.mask.copy_(mask.view(bucket, 1, 1, -1))
        state.pos.copy_(pos)
        state.limits.copy_(limits)
        state.finished.copy_(finished)
        state.bad.zero_()
        state.step.zero_()
        state.cache_pos.fill_(width - 1)
        for name in mixed_adapters:
            state.adapter_masks[name][:n].copy_(self._adapter_mask(rows, name))
            state.adapter_masks[name][n:] = 0.0

    def _prefill(
        self, state: _State, rows: Sequence[DecodeRow], width: int, select: AdapterSelect, pad_id: int
    ) -> torch.Tensor:
        """The prompts' K/V into the static cache; returns the first tokens' logits (float32, one per row).

        The loop's own layer code runs it (see `_prefill_own`); if that ever fails on a device, the model's own
        forward takes over from then on (with a log line)."""
        logits = torch.zeros(state.rows, self.head.out_features, dtype=torch.float32, device=self.device)
        if self.own_prefill:
            try:
                with _prefill_attention(self.device):
                    self._prefill_own(state, rows, width, pad_id, logits)
                return logits
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:
                log.exception("fast path: the loop's own prefill failed; using the model's forward from now on")
                self.own_prefill = False
        chunk = max(1, self.prefill_tokens // max(1, width))
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            ids, mask = left_pad([r.ids for r in part], pad_id, self.device, width)  # the whole batch's width
            where = slice(start, start + len(part))
            logits[where] = self._prefill_model(state, where, part, ids, mask, _positions(mask), select)
        return logits

    def _chunks(self, rows: Sequence[DecodeRow], width: int, pad_id: int) -> list[_Chunk]:
        """Rows grouped by prompt length into chunks of about `prefill_tokens` tokens, each right-padded only to
        its own longest prompt: causal attention then needs no mask (a real token never sees the padding after
        it), so SDPA runs its flash kernel with grouped-query heads as they are."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids))
        groups: list[list[int]] = [[]]
        for i in order:  # ascending: the newcomer is the longest of its group
            if groups[-1] and (len(groups[-1]) + 1) * len(rows[i].ids) > self.prefill_tokens:
                groups.append([])
            groups[-1].append(i)
        return [self._chunk(rows, group, width, pad_id) for group in groups]

    def _chunk(self, rows: Sequence[DecodeRow], group: list[int], width: int, pad_id: int) -> _Chunk:
        lengths = [len(rows[i].ids) for i in group]
        span = max(lengths)
        ids = torch.full((len(group), span), pad_id, dtype=torch.long)
        # Where each token's K/V goes: a row's real tokens right-aligned at the batch width (where its decode
        # mask expects them), its padding into its own masked columns on the left (distinct slots, never read).
        columns = torch.empty((len(group), span), dtype=torch.long)
        steps = torch.arange(span)
        for j, (i, n) in enumerate(zip(group, lengths, strict=True)):
            ids[j, :n] = torch.tensor(rows[i].ids, dtype=torch.long)
            columns[j] = torch.where(steps < n, width - n + steps, steps - n)
        contiguous = group == list(range(group[0], group[0] + len(group)))
        index = to_device(torch.tensor(group)[:, None], self.device)
        return _Chunk(
            where=slice(group[0], group[0] + len(group)) if contiguous else index[:, 0],
            ids=to_device(ids, self.device),
            rows=index,
            columns=to_device(columns, self.device),
            last=to_device(torch.tensor(lengths) - 1, self.device),
            masks=self._row_masks([rows[i] for i in group]),
        )

    def _prefill_own(
        self, state: _State, rows: Sequence[DecodeRow], width: int, pad_id: int, logits: torch.Tensor
    ) -> None:
        """Each chunk through the decoder layers as HF computes them (same modules, same LoRA arithmetic as
        PEFT), without PEFT's per-module Python or a dynamic cache to copy from: K/V go straight into the
        static cache, and 4-bit weights are dequantised by one op instead of bitsandbytes' Python path."""
        groups = self.heads // self.kv_heads
        for c in self._chunks(rows, width, pad_id):
            h = self.embed(c.ids)
            count, span = c.ids.shape
            positions = torch.arange(span, device=self.device).expand(count, span)
            cos, sin = self.rotary(h, positions)
            x = self.ops.norm(self.layers[0].norm1, h)
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, state.kv, strict=True)):
                merged = layer.merged(c.masks) if self.merge_lora else None
                dense, masks = (merged, []) if merged is not None else (layer.dense(), c.masks)
                q, k, v = self._qkv(layer, x, masks, cos, sin, dense)
                # (rows, kv_heads, span, D) -> the cache's (rows, span) slots: advanced indices put those first.
                k_cache[c.rows, :, c.columns] = k.transpose(1, 2)
                v_cache[c.rows, :, c.columns] = v.transpose(1, 2)
                out = F.scaled_dot_product_attention(
                    q, _repeat_kv(k, groups), _repeat_kv(v, groups), is_causal=True, scale=layer.scaling
                )
                attn = out.transpose(1, 2).reshape(count, span, self.heads * self.head_dim)
                h, x = self._rest(layer, h, attn, masks, self._next_norm(i), dense)
            last = x[torch.arange(count, device=self.device), c.last]
            logits[c.where] = self.head(last).float()

    def _row_masks(self, part: Sequence[DecodeRow]) -> Masks:
        """LoRA selection for a prefill chunk: no masks when every row uses one adapter (PEFT's arithmetic),
        else a 0/1 row mask per adapter."""
        names = {r.adapter for r in part}
        adapters = sorted(a for a in names if a is not None)
        if len(names) == 1:
            return [(name, None) for name in adapters]
        return [(name, self._adapter_mask(part, name)) for name in adapters]

    def _adapter_mask(self, rows: Sequence[DecodeRow], name: str) -> torch.Tensor:
        """(rows, 1, 1): 1 where the row uses adapter `name`, else 0 -- multiplies that adapter's LoRA delta."""
        sel = [1.0 if r.adapter == name else 0.0 for r in rows]
        return to_device(torch.tensor(sel, dtype=self.dtype), self.device).view(-1, 1, 1)

    def _prefill_model(
        self,
        state: _State,
        where: slice,
        part: Sequence[DecodeRow],
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        select: AdapterSelect,
    ) -> torch.Tensor:
        """One chunk through the model's own forward (PEFT selects the adapters); its cache copied over."""
        with select([r.adapter for r in part]) as kwargs:
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1, **kwargs
            )
        width = ids.shape[1]
        for (k_cache, v_cache), (keys, values) in zip(state.kv, _cache_layers(out), strict=True):
            k_cache[where, :, :width].copy_(keys)
            v_cache[where, :, :width].copy_(values)
        return out.logits[:, -1].float()


def _prefill_attention(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """SDPA kernels for prefill on CUDA: flash (or memory-efficient), not cuDNN. cuDNN builds an execution
    plan for every new (rows, length) shape, and prefill chunks come in many: on the H200 the nightly
    benchmark's prefill took 16.8 s with cuDNN and 8.9 s without (a warmed-up 192-row batch: 0.5 s either
    way)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows, as HF's generate derives them from the attention mask."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(rows, kv_heads, T, D) -> (rows, heads, T, D), head j reading KV head j // groups (HF's repeat_kv):
    equal head counts keep every SDPA kernel eligible (a small copy per layer in prefill)."""
    if groups == 1:
        return x
    rows, kv_heads, length, dim = x.shape
    return x[:, :, None].expand(rows, kv_heads, groups, length, dim).reshape(rows, kv_heads * groups, length, dim)


def _cache_layers(out: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a forward pass's cache, across transformers 4.5x-5.x names."""
    cache = getattr(out, "cache", None) or out.past_key_values
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            yield layer.keys, layer.values
    else:
        yield from zip(cache.key_cache, cache.value_cache, strict=True)
