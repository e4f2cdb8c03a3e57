"""The weights of a decoder layer as the loop runs them: projections with their LoRA adapters, q/k/v and
gate/up joined into one matmul each, and the layer stack's math shared by prefill, decode and scoring."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from worker.fastpath import nf4, pointwise
from worker.fastpath.gemm import ROW_BLOCK, add_matmul_, empty_rows, linear
from worker.fastpath.ops import DEFAULT_OPS, Ops, OpsOptions, norm_of
from worker.fastpath.quant4 import Layout4bit, float_absmax
from worker.memory import PREFILL_MLP_BLOCK_TOKENS

# Where the loop runs 4-bit weights by bitsandbytes' ops itself (scales decoded once, one dequantise op). On the
# CPU bitsandbytes repacks a 4-bit weight for its own kernel at its first call: left to that (tests that need
# the loop's own 4-bit path on the CPU add "cpu", on models bitsandbytes has not run yet).
OWN_4BIT_DEVICES = frozenset({"cuda"})

GroupDense = tuple[torch.Tensor | None, ...]
Masks = list[tuple[str, torch.Tensor | None]]  # (adapter, per-row 0/1 mask or None: every row) per LoRA delta
# Per layer: the q/k/v group's ready weights, o's, the gate/up group's, down's (a group: one joint weight or one
# per member; None: that base layer runs itself).
Dense = tuple[GroupDense, torch.Tensor | None, GroupDense, torch.Tensor | None]
NO_DENSE: Dense = ((), None, (), None)


def is_mixed(masks: Masks) -> bool:
    """Rows of several adapters (each LoRA masked per row): no single adapter to merge into the weights."""
    return len(masks) > 1 or any(mask is not None for _, mask in masks)


def only_adapter(masks: Masks) -> str | None:
    """The one adapter of rows that are not `is_mixed` (None: the base model)."""
    return masks[0][0] if masks else None


@dataclass(frozen=True)
class Lora:
    a: torch.nn.Module
    b: torch.nn.Module
    scaling: float


class Proj:
    """One linear of a decoder layer: its base layer and, when PEFT wrapped it, each adapter's A, B, scale.

    PEFT keeps adapter weights in float32, so with a bf16/fp16 model every LoRA call costs a cast in, two
    float32 matmuls, a scale, a cast out and an add: six small kernels per adapter and projection, ~45% of
    a decode step's GPU time in the measured kernel table. Where that cast is needed the loop instead uses
    compute-dtype copies with the scale folded into B (`linear` + `addmm`, two kernels); where it is not
    (float32 models, the CPU tests) it keeps PEFT's exact arithmetic."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, *, fuse: bool = True) -> None:
        self.base = getattr(module, "base_layer", module)
        self.lora: dict[str, Lora] = {}
        self.fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if hasattr(module, "lora_A"):
            for name in module.lora_A:
                lora = Lora(module.lora_A[name], module.lora_B[name], float(module.scaling[name]))
                self.lora[name] = lora
                plain = lora.a.bias is None and lora.b.bias is None
                if fuse and plain and lora.a.weight.dtype != dtype:
                    with torch.no_grad():
                        self.fused[name] = (lora.a.weight.to(dtype), (lora.b.weight * lora.scaling).to(dtype))
        # PEFT's bnb layers cast the delta to the output dtype before adding; its plain layers add, then cast.
        self.cast_delta_first = type(module).__module__.endswith("lora.bnb")
        self.dtype = dtype
        state = getattr(self.base.weight, "quant_state", None)
        ours = self.base.weight.device.type in OWN_4BIT_DEVICES
        self.absmax = float_absmax(state) if state is not None and ours else None
        self.code = four_bit_code(state) if self.absmax is not None else None
        self.folds: dict[tuple[str, ...], Fold] = {}  # per adapters (the decode step's): their LoRA folded

    def dense(self) -> torch.Tensor | None:
        """The base weight ready for `F.linear`: a plain layer's own weight, or a CUDA 4-bit weight dequantised
        by one op (`Layout4bit.dense`). None: the base layer must run itself (4-bit on CPU, where
        bitsandbytes repacks the weight for its own kernel)."""
        weight = self.base.weight
        if getattr(weight, "quant_state", None) is None:
            return weight if isinstance(self.base, torch.nn.Linear) and weight.dtype == self.dtype else None
        layout = self._layout()
        return None if layout is None else layout.dense(weight.view(-1, 1))

    def _layout(self) -> Layout4bit | None:
        """This 4-bit weight's layout on its float32 scales (None: no scales decoded, the module runs)."""
        if self.absmax is None:
            return None
        state = self.base.weight.quant_state
        dtype = getattr(self.base, "compute_dtype", None) or self.dtype
        return Layout4bit(
            absmax=self.absmax, blocksize=state.blocksize, quant_type=state.quant_type, shape=list(state.shape),
            dtype=dtype, code=self.code,
        )  # fmt: skip

    @property
    def dequantises(self) -> bool:
        """Whether `dense()` hands out a fresh buffer (a 4-bit weight dequantised) rather than the layer's own
        weight: only a fresh buffer may take a LoRA merge in place."""
        return self._layout() is not None

    def mergeable(self, weight: torch.Tensor | None, adapter: str | None) -> bool:
        """Whether `merge` can give `weight` with `adapter` merged exactly as planned (a ready weight, and the
        adapter's fused compute-dtype copies where it has a LoRA here: else PEFT's float32 arithmetic is kept)."""
        return weight is not None and (adapter is None or adapter not in self.lora or adapter in self.fused)

    def merge(self, weight: torch.Tensor | None, adapter: str | None, *, in_place: bool) -> torch.Tensor | None:
        """`weight` (this projection's `dense()`, `mergeable`) with `adapter`'s fused LoRA delta added into it:
        W + B A, one small matmul per layer instead of two on every token. `in_place` (the caller needs the
        plain weight no more) adds into a dequantised buffer itself: `addmm` out of place first copies the whole
        weight (~5% of prefill GPU time). The layer's own weight is never written."""
        if adapter is None or adapter not in self.lora:
            return weight
        a, b = self.fused[adapter]
        return weight.addmm_(b, a) if in_place and self.dequantises else torch.addmm(weight, b, a)

    def __call__(self, x: torch.Tensor, masks: Masks, dense: torch.Tensor | None = None) -> torch.Tensor:
        if dense is None and (out := self._folded(x, masks)) is not None:
            return out
        return self.add_lora(self.base_out(x, dense), x, masks)

    def _folded(self, x: torch.Tensor, masks: Masks) -> torch.Tensor | None:
        """The 4-bit matmul with every adapter's fused LoRA folded in (`run_folded`), or None."""
        names = tuple(name for name, _ in masks if name in self.lora)
        bias = self.base.bias
        return run_folded(
            x, masks, self._layout(), self.base.weight.view(-1, 1), self.folds, names, self.fused, self.dtype,
            lambda: None if bias is None else bias.to(self.dtype),
        )  # fmt: skip

    def base_out(self, x: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        if dense is not None:
            bias = self.base.bias
            return linear(x.to(dense.dtype), dense, None if bias is None else bias.to(dense.dtype)).to(x.dtype)
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
                result = fused_delta(result, x, a, b, mask)
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


@dataclass(frozen=True)
class Fold:
    """Adapters' LoRA folded into a 4-bit matmul (`nf4`): their A matrices stacked, dequantised below the base
    weight as extra rows (one matmul gives the base output and every shrink `x A^T` side by side), and their B
    matrices side by side for the one expand."""

    a: torch.Tensor | None  # (R, in); None: no adapter (the base matmul alone)
    b: torch.Tensor | None  # (out, R), the scale folded in
    spans: tuple[tuple[str, int, int], ...]  # each adapter's columns of the shrink: (name, start, end)
    bias: torch.Tensor | None  # the base bias, R zeros appended (the shrink columns get none)

    @classmethod
    def of(cls, loras: list[tuple[str, torch.Tensor, torch.Tensor]], bias: torch.Tensor | None) -> Fold:
        if not loras:
            return cls(a=None, b=None, spans=(), bias=bias)
        spans: list[tuple[str, int, int]] = []
        start = 0
        for name, a, _ in loras:
            spans.append((name, start, start + a.shape[0]))
            start += a.shape[0]
        with torch.no_grad():
            a = loras[0][1] if len(loras) == 1 else torch.cat([a for _, a, _ in loras])
            b = loras[0][2] if len(loras) == 1 else torch.cat([b for _, _, b in loras], dim=1)
            if bias is not None:
                bias = torch.cat((bias, bias.new_zeros(start)))
        return cls(a=a, b=b, spans=tuple(spans), bias=bias)


def run_folded(
    x: torch.Tensor,
    masks: Masks,
    layout: Layout4bit | None,
    packed: torch.Tensor,
    folds: dict[tuple[str, ...], Fold],
    names: tuple[str, ...],
    loras: dict[str, tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    bias: Callable[[], torch.Tensor | None],
) -> torch.Tensor | None:
    """A projection's (or joint group's) 4-bit matmul with the LoRA of `names` (the adapters with a LoRA on it)
    folded in (`folded_matmul`), its `Fold` made once per adapters into `folds` from their compute-dtype copies
    `loras` and the base `bias`. None where it cannot run: no 4-bit layout our kernel serves, the compute dtype
    not the copies' `dtype`, or an adapter without copies (PEFT's float32 arithmetic kept)."""
    if layout is None or layout.dtype != dtype or not layout.folds() or any(n not in loras for n in names):
        return None
    fold = folds.get(names)
    if fold is None:
        fold = folds[names] = Fold.of([(n, *loras[n]) for n in names], bias())
    return folded_matmul(x, layout, packed, fold, masks)


def folded_matmul(
    x: torch.Tensor, layout: Layout4bit, packed: torch.Tensor, fold: Fold, masks: Masks
) -> torch.Tensor | None:
    """x W^T (+ bias) plus each adapter's LoRA delta (masked per row where `masks` say), W dequantised by our
    kernel with the adapters' A rows appended: one dequantise, one matmul, one expand (and a mask per adapter of
    a mixed batch) where bitsandbytes' path and the separate LoRA took two launches a projection more (`nf4`).
    None where the kernel failed (the caller's path runs). The result is a view of the joint output."""
    weight = layout.dense_with(packed, fold.a)
    if weight is None:
        return None
    return expand_folded(F.linear(x.to(weight.dtype), weight, fold.bias), x, layout.shape[0], fold, masks)


def expand_folded(out: torch.Tensor, x: torch.Tensor, n: int, fold: Fold, masks: Masks) -> torch.Tensor:
    """`folded_matmul`'s second half: `out` = x [W; A]^T (+ bias), its first `n` columns the base output, the rest
    each adapter's shrink; each shrink masked per row where `masks` say, all expanded by the stacked B into the
    base columns in place. The result is in `x`'s dtype: a view of `out` where that is its own."""
    if fold.b is None:
        return out.to(x.dtype)
    by_name = dict(masks)
    low = out[..., n:]
    for name, start, end in fold.spans:
        mask = by_name.get(name)
        if mask is not None:
            low[..., start:end].mul_(mask)
    flat = out.view(-1, out.shape[-1])
    flat[:, :n].addmm_(flat[:, n:], fold.b.t())
    return out[..., :n].to(x.dtype)


def fused_delta(
    result: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """result + mask * (x A^T) B^T in two kernels (`linear`, then `addmm` adding into the result). `result` is
    a projection's fresh output, nobody else's: where contiguous it takes the delta in place -- out of place,
    `addmm` first copies it whole (a prefill chunk's gate/up output is ~147 MiB, held twice at the peak)."""
    low = linear(x, a)
    if mask is not None:
        # In place where the product keeps low's dtype: a fresh output, whose storage keeps its padded rows'
        # room (`gemm.empty_rows`).
        low = low.mul_(mask) if torch.promote_types(low.dtype, mask.dtype) == low.dtype else low * mask
    low = low.reshape(-1, low.shape[-1])
    if result.is_contiguous():
        # Its rows past its own are its room only where it is a whole output, rows one after the other: a single
        # row of a member's slice of a joint output also counts as contiguous, and its "room" is the next members'.
        owns = result.dim() >= 2 and result.stride(-2) == result.shape[-1]
        add_matmul_(result.view(-1, result.shape[-1]), low, b.t(), owns_rows=owns)
        return result
    return torch.addmm(result.reshape(-1, result.shape[-1]), low, b.t()).view(result.shape)


class Group:
    """Projections of one input (q/k/v; gate/up) as one matmul: their weights concatenated along the output
    dimension. A decode step then launches one 4-bit dequantise-and-matmul where it launched three, and
    prefill dequantises once per group, not per projection; the outputs are views of the joint result.

    The members' own weights become views of the joint buffer (no second copy in memory), so PEFT's forward
    -- the fallback paths -- reads the same bytes. 4-bit weights join when they share block size, type and
    compute dtype: 4-bit blocks never straddle two matrices (each holds a multiple of 64 weights), so the
    joint dequantisation gives the members' values element for element. LoRA deltas join too where the loop
    fuses them (compute-dtype copies): A's stacked, B block-diagonal, so one `linear` + `addmm` per adapter
    serves the group; elsewhere each member adds PEFT's exact delta to its slice."""

    def __init__(self, projs: list[Proj], dtype: torch.dtype, *, join: bool = True) -> None:
        self.projs = projs
        self.sizes = [p.base.out_features for p in projs]
        # join=False: the members run one by one (to compare against the joint matmul).
        self.joint = join_bases(projs, dtype) if join and len(projs) > 1 else None
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.folds: dict[tuple[str, ...], Fold] = {}  # per adapters (the decode step's): their LoRA folded
        names = set(projs[0].fused)
        if self.joint is not None and names and all(set(p.fused) == names and not p.lora.keys() - names for p in projs):
            with torch.no_grad():
                for name in names:
                    self.lora[name] = (torch.cat([p.fused[name][0] for p in projs]), block_diagonal(
                        [p.fused[name][1] for p in projs]))  # fmt: skip
            for p in projs:
                p.fused = {}  # the joint copies replace them

    def dense(self) -> GroupDense:
        if self.joint is not None:
            return (self.joint.dense(),)
        return tuple(p.dense() for p in self.projs)

    def _touches(self, adapter: str | None) -> bool:
        """Whether `adapter` has a LoRA on any member (else merging it changes nothing here)."""
        return adapter is not None and any(adapter in p.lora for p in self.projs)

    def mergeable(self, dense: GroupDense, adapter: str | None) -> bool:
        """Whether `merge` can merge `adapter` into `dense` (this group's `dense()`): see `Proj.mergeable`."""
        if self.joint is None:
            return all(p.mergeable(d, adapter) for p, d in zip(self.projs, dense, strict=True))
        return not self._touches(adapter) or adapter in self.lora

    def merge(self, dense: GroupDense, adapter: str | None, *, in_place: bool) -> GroupDense:
        """`dense` (`mergeable`) with `adapter`'s LoRA merged into the weights (see `Proj.merge`)."""
        if self.joint is None:
            return tuple(p.merge(d, adapter, in_place=in_place) for p, d in zip(self.projs, dense, strict=True))
        (weight,) = dense
        if not self._touches(adapter):
            return dense
        a, b = self.lora[adapter]
        fresh = in_place and self.joint.quant is not None  # a dequantised buffer, not the members' own weights
        return (weight.addmm_(b, a) if fresh else torch.addmm(weight, b, a),)

    def merged(self, adapter: str | None) -> GroupDense | None:
        """`dense()` with `adapter`'s LoRA merged into the weights (into the fresh buffers themselves), or None."""
        dense = self.dense()
        return self.merge(dense, adapter, in_place=True) if self.mergeable(dense, adapter) else None

    def __call__(
        self, x: torch.Tensor, masks: Masks, dense: GroupDense = ()
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Each member's output, and the joint output they are views of (None: members ran separately)."""
        if self.joint is None:
            dense = dense or (None,) * len(self.projs)
            return [p(x, masks, d) for p, d in zip(self.projs, dense, strict=True)], None
        if not dense and (folded := self._folded(x, masks)) is not None:
            return list(folded.split(self.sizes, dim=-1)), folded
        joint = self.joint.base_out(x, dense[0] if dense else None)
        if self.lora:
            for name, mask in masks:
                if name in self.lora:  # else no member has this adapter's LoRA
                    a, b = self.lora[name]
                    joint = fused_delta(joint, x, a, b, mask)
            return list(joint.split(self.sizes, dim=-1)), joint
        parts = joint.split(self.sizes, dim=-1)
        return [p.add_lora(part, x, masks) for p, part in zip(self.projs, parts, strict=True)], None

    def _folded(self, x: torch.Tensor, masks: Masks) -> torch.Tensor | None:
        """The joint 4-bit matmul with every adapter's joint LoRA folded in (`run_folded`), or None."""
        joint = self.joint
        assert joint is not None
        names = tuple(name for name, _ in masks if self._touches(name))
        return run_folded(
            x, masks, joint.quant, joint.weight, self.folds, names, self.lora, self.projs[0].dtype, lambda: joint.bias
        )


def block_diagonal(blocks: list[torch.Tensor]) -> torch.Tensor:
    """(sum out, sum r) with each (out_i, r_i) block on the diagonal: the stacked low-rank inputs of one
    member only reach that member's outputs (the zeros add exactly nothing)."""
    out = blocks[0].new_zeros(sum(b.shape[0] for b in blocks), sum(b.shape[1] for b in blocks))
    row = col = 0
    for b in blocks:
        out[row : row + b.shape[0], col : col + b.shape[1]] = b
        row, col = row + b.shape[0], col + b.shape[1]
    return out


class JointBase:
    """The concatenated base weights of a `Group`, as a `_Proj` runs its base layer (4-bit or plain)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant: Layout4bit | None) -> None:
        self.weight, self.bias, self.quant = weight, bias, quant

    def dense(self) -> torch.Tensor:
        return self.weight if self.quant is None else self.quant.dense(self.weight)

    def base_out(self, x: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        if dense is None and self.quant is not None:
            return self.quant.matmul(x, self.weight, self.bias)
        weight = self.weight if dense is None else dense
        return linear(x.to(weight.dtype), weight, self.bias).to(x.dtype)


@torch.no_grad()
def join_bases(projs: list[Proj], dtype: torch.dtype) -> JointBase | None:
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
        rebind([b.weight for b in bases], weight)
        return JointBase(weight, joint_bias(bases, dtype), None)
    if any(s is None for s in states) or any(p.absmax is None for p in projs):
        return None
    compute = {getattr(b, "compute_dtype", None) or dtype for b in bases}
    layouts = {(s.blocksize, s.quant_type) for s in states}
    if len(compute) != 1 or len(layouts) != 1 or any(math.prod(s.shape) % s.blocksize for s in states):
        return None
    (blocksize, quant_type), (compute_dtype,) = layouts.pop(), compute
    weight = torch.cat([b.weight.data.reshape(-1) for b in bases]).view(-1, 1)
    rebind([b.weight for b in bases], weight)
    absmax = torch.cat([p.absmax for p in projs])
    for p, view in zip(projs, absmax.split([p.absmax.numel() for p in projs]), strict=True):
        if p.absmax is p.base.weight.quant_state.absmax:
            p.base.weight.quant_state.absmax = view  # plain (not nested) scales: bitsandbytes' own, shared
        p.absmax = view
    shape = [sum(s.shape[0] for s in states), states[0].shape[1]]
    layout = Layout4bit(
        absmax=absmax, blocksize=blocksize, quant_type=quant_type, shape=shape, dtype=compute_dtype, code=projs[0].code
    )
    return JointBase(weight, joint_bias(bases, compute_dtype), layout)


def four_bit_code(state: Any) -> torch.Tensor | None:
    """A 4-bit weight's code (its type's 16 values) as our kernel's lookup table on the weight's device (`nf4`)."""
    code = getattr(state, "code", None)
    if code is None or code.numel() != 16:
        return None
    return nf4.code_table(code.to(device=state.absmax.device))  # float32, a copy of our own


def joint_bias(bases: list[torch.nn.Module], dtype: torch.dtype) -> torch.Tensor | None:
    if all(b.bias is None for b in bases):
        return None
    return torch.cat([
        b.bias.to(dtype) if b.bias is not None else torch.zeros(b.out_features, dtype=dtype, device=b.weight.device)
        for b in bases
    ])  # fmt: skip


def rebind(params: list[torch.Tensor], joint: torch.Tensor) -> None:
    """Each parameter's data becomes its slice of `joint` (same shape): one copy of the weights in memory."""
    offset = 0
    for param in params:
        n = param.data.numel()
        param.data = joint.reshape(-1)[offset : offset + n].view(param.data.shape)
        offset += n


class Layer:
    def __init__(self, layer: torch.nn.Module, dtype: torch.dtype, fuse: bool, join: bool = True) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = norm_of(layer.input_layernorm), norm_of(layer.post_attention_layernorm)

        def group(module: torch.nn.Module, *names: str) -> Group:
            return Group([Proj(getattr(module, n), dtype, fuse=fuse) for n in names], dtype, join=join)

        self.qkv = group(attn, "q_proj", "k_proj", "v_proj")
        self.o = Proj(attn.o_proj, dtype, fuse=fuse)
        self.gate_up = group(mlp, "gate_proj", "up_proj")
        self.down = Proj(mlp.down_proj, dtype, fuse=fuse)
        self.act = mlp.act_fn
        self.scaling = float(attn.scaling)

    def dense(self) -> Dense:
        return (self.qkv.dense(), self.o.dense(), self.gate_up.dense(), self.down.dense())

    def mergeable(self, dense: Dense, adapter: str | None) -> bool:
        """Whether `merge` can merge `adapter` into `dense` (this layer's `dense()`) in every projection:
        checked before anything is written, so a merge in place never stops half-way."""
        qkv, o, gate_up, down = dense
        return (
            self.qkv.mergeable(qkv, adapter)
            and self.o.mergeable(o, adapter)
            and self.gate_up.mergeable(gate_up, adapter)
            and self.down.mergeable(down, adapter)
        )

    def merge(self, dense: Dense, adapter: str | None, *, in_place: bool) -> Dense:
        """`dense` (`mergeable`) with `adapter`'s LoRA merged in: its LoRA then costs nothing per token.
        `in_place`: into the dequantised buffers themselves, for a caller that needs the plain ones no more."""
        qkv, o, gate_up, down = dense
        return (
            self.qkv.merge(qkv, adapter, in_place=in_place),
            self.o.merge(o, adapter, in_place=in_place),
            self.gate_up.merge(gate_up, adapter, in_place=in_place),
            self.down.merge(down, adapter, in_place=in_place),
        )

    def merged(self, masks: Masks) -> Dense | None:
        """Ready weights with the one adapter of a single-adapter chunk merged in, or None: a mixed chunk, or a
        projection that cannot merge."""
        if is_mixed(masks):
            return None
        adapter = only_adapter(masks)
        dense = self.dense()
        return self.merge(dense, adapter, in_place=True) if self.mergeable(dense, adapter) else None


class Stack:
    """The model's decoder as the loop computes it: embedding, layers (weights joined, LoRA applied by the
    loop), final norm, rotary embedding and LM head, and the per-layer math every path shares."""

    def __init__(self, lm: Any, *, fuse_lora: bool, join_projections: bool, options: OpsOptions = DEFAULT_OPS) -> None:
        cfg = lm.config
        self.embed, self.norm, self.rotary = lm.model.embed_tokens, norm_of(lm.model.norm), lm.model.rotary_emb
        self.head = lm.lm_head
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        # Residual adds with the norms after them, rotary, SiLU x up: one compiled kernel each (bf16/fp16 on a GPU).
        on_gpu = self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
        compiled = options.compile_ops and on_gpu
        self.ops = Ops(compiled)
        # Prefill's rotary, SiLU x up and residual-add-and-norm by our Triton kernels wherever they run (bf16/fp16
        # on a GPU), unless the fused steps are off (eager everywhere, for comparisons); with `pointwise_kernels`
        # the decode step's rotary and SiLU x up too, and prefill's even then (see `Ops`). The two sets share one
        # switch: a kernel's failure switches ours off for both.
        available = pointwise.available(self.device, self.dtype)
        kernels = self.ops.with_kernels() if available else self.ops
        prefill = kernels.with_norm_kernel() if available else self.ops
        self.prefill_ops = prefill if options.compile_ops or options.pointwise_kernels else self.ops
        self.step_ops = kernels if options.pointwise_kernels else self.ops
        # fuse_lora=False keeps PEFT's float32 LoRA arithmetic in bf16/fp16 models too (slower; for comparisons).
        # join_projections=False runs q/k/v and gate/up as separate matmuls (for comparisons).
        layers = lm.model.layers[: cfg.num_hidden_layers]
        self.layers = [Layer(layer, self.dtype, fuse_lora, join_projections) for layer in layers]
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        # The most tokens the MLP runs at once (`_mlp_in_blocks`); what the planner sets aside per chunk for it.
        self.mlp_block_tokens = PREFILL_MLP_BLOCK_TOKENS

    @property
    def groups(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.heads // self.kv_heads

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head over `x`'s rows: a plain linear head over at most a row block as prefill runs its matmuls
        (`gemm.linear`: inside its row blocks, at counts rounded up to a step, which the warm-up met: at most a
        step of rows more, ~9 MiB of logits at Qwen's vocabulary, inside the chunk's set-aside, where the head
        runs after a group's layers); more rows, or any other head, as the module computes them (padded to a
        block, the logits' room would be up to a block of rows, ~74 MiB)."""
        head = self.head
        rows = x.numel() // max(1, x.shape[-1])
        if type(head) is torch.nn.Linear and head.weight.dtype == x.dtype and rows <= ROW_BLOCK:
            return linear(x, head.weight, head.bias)
        return head(x)

    def next_norm(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The norm after layer i: the next layer's input norm, or the model's final one."""
        return self.layers[i + 1].norm1 if i + 1 < len(self.layers) else self.norm

    def qkv(
        self,
        layer: Layer,
        x: torch.Tensor,
        masks: Masks,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dense: Dense = NO_DENSE,
        ops: Ops | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, heads, T, D) queries and (rows, kv_heads, T, D) keys/values of the normed input `x`, rotary
        applied as HF applies it (by `ops`, default the stack's own)."""
        rows, width = x.shape[:2]
        (q, k, v), joint = layer.qkv(x, masks, dense[0])
        v = v.reshape(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
        # Rotary on queries and keys together (half the kernels): adjacent in the joint output, they need no
        # concatenation.
        qk_width = (self.heads + self.kv_heads) * self.head_dim
        qk = joint[..., :qk_width] if joint is not None else torch.cat((q, k), dim=-1)
        qk = (ops or self.ops).rope(qk.view(rows, width, self.heads + self.kv_heads, self.head_dim), cos, sin)
        return qk[:, : self.heads], qk[:, self.heads :], v

    def rest(
        self,
        layer: Layer,
        h: torch.Tensor,
        attn: torch.Tensor,
        masks: Masks,
        next_norm: Callable[[torch.Tensor], torch.Tensor],
        dense: Dense = NO_DENSE,
        ops: Ops | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after attention -- output projection and residual, the MLP and its residual -- and the
        next norm's output (each residual add fused with the norm after it; by `ops`, default the stack's own)."""
        h, x = self.attn_out(layer, h, attn, masks, dense, ops)
        return self.mlp(layer, h, x, masks, next_norm, dense, ops)

    def attn_out(
        self,
        layer: Layer,
        h: torch.Tensor,
        attn: torch.Tensor,
        masks: Masks,
        dense: Dense = NO_DENSE,
        ops: Ops | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection, its residual, and the MLP's normed input (the first half of `rest`)."""
        return (ops or self.ops).add_norm(h, layer.o(attn, masks, dense[1]), layer.norm2)

    def mlp(
        self,
        layer: Layer,
        h: torch.Tensor,
        x: torch.Tensor,
        masks: Masks,
        next_norm: Callable[[torch.Tensor], torch.Tensor],
        dense: Dense = NO_DENSE,
        ops: Ops | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP, its residual, and the next norm's output (the second half of `rest`)."""
        ops = ops or self.ops
        down = self._mlp_in_blocks(layer, x, masks, dense, ops)
        # The next layer's input, held between prefill's layers: no room for padded rows (its matmul runs in two).
        return ops.add_norm(h, down, next_norm, room=False)

    def _mlp_in_blocks(self, layer: Layer, x: torch.Tensor, masks: Masks, dense: Dense, ops: Ops) -> torch.Tensor:
        """The MLP's output for `x` (rows, T, hidden): gate/up and SiLU x up in blocks of at most
        `mlp_block_tokens` tokens -- whole rows where a row fits a block (contiguous slices, each row's LoRA mask
        sliced with it; the blocks' rows evened out), a row longer than a block in spans of its own -- each
        block's product written into one buffer for the chunk, and the down projection over the whole chunk at
        once. Gate/up's output is 2x the product a token (~3.5x a chunk's other transients with it): run whole,
        an 8,192-token chunk asked for one 280 MiB block, which failed among held states under a 6 GiB budget on
        the H100 with ~1 GiB free in smaller pieces. In blocks of 4,096 tokens gate/up's output is 140 MiB, and
        the chunk's product (~140 MiB at 8,192 tokens) is the largest request. The down projection stays whole:
        its 1,536 outputs make few output tiles a row block, and at ~4,096 rows its matmul filled the H100's
        SMs in ~1.5 waves (blocks of 4,096 cost prefill 8-16% with the down projection blocked too, `bench
        prefill --mlp-blocks 4096,0`). Each row's result is the same as whole (rows are independent)."""
        rows, width = x.shape[0], x.shape[-2]
        block = self.mlp_block_tokens
        if x.dim() != 3 or rows * width <= block:
            return self._mlp_down(layer, x, masks, dense, ops)
        # The down projection's input, its width the MLP's inner one: room for its padded rows (`gemm.empty_rows`).
        product = empty_rows(rows, width, layer.down.base.in_features, dtype=x.dtype, device=x.device)
        for b in mlp_blocks(rows, width, block):
            rows_of, tokens_of = slice(b.row, b.row + b.rows), slice(b.token, b.token + b.span)
            part = [(name, None if m is None else m[rows_of]) for name, m in masks]
            (gate, up), _ = layer.gate_up(x[rows_of, tokens_of], part, dense[2])
            ops.act_mul(layer.act, gate, up, out=product[rows_of, tokens_of])
            del gate, up
        return layer.down(product, masks, dense[3])

    @staticmethod
    def _mlp_down(layer: Layer, x: torch.Tensor, masks: Masks, dense: Dense, ops: Ops) -> torch.Tensor:
        (gate, up), _ = layer.gate_up(x, masks, dense[2])
        return layer.down(ops.act_mul(layer.act, gate, up), masks, dense[3])


@dataclass(frozen=True)
class MlpBlock:
    """One block of a chunk's MLP gate/up (`Stack._mlp_in_blocks`): `rows` rows from row `row`, and of each the
    `span` tokens from token `token`."""

    row: int
    rows: int
    token: int
    span: int


def mlp_blocks(rows: int, width: int, block: int) -> list[MlpBlock]:
    """The blocks of at most `block` tokens that a chunk of `rows` rows of `width` tokens runs its MLP's gate/up
    in: whole rows where a row fits (as few blocks as hold them, their row counts at most one apart: 37 rows in
    blocks of 18 run as 13 + 12 + 12), else each row in spans of `block` tokens."""
    if width <= block:
        count = -(-rows // (block // width))
        sizes = [rows // count + (i < rows % count) for i in range(count)]
        starts = itertools.accumulate(sizes, initial=0)
        return [MlpBlock(row=r, rows=n, token=0, span=width) for r, n in zip(starts, sizes, strict=False)]
    spans = [(t, min(block, width - t)) for t in range(0, width, block)]
    return [MlpBlock(row=r, rows=1, token=t, span=n) for r in range(rows) for t, n in spans]
