"""The greedy token choice of a decode step as two Triton kernels over the LM head's own (bf16/fp16) logits.

Torch's way (`sampling.token_choice`) converts the logits to float32 a chunk of rows at a time and runs the
finiteness check, the argmax, the log-softmax and a gather over each chunk: ~7 kernels a chunk, each a pass over
the chunk's float32 copy (at 256 rows of a 152k vocabulary: ~56 launches and ~1 GB of traffic a step, ~0.5 ms
of a decode step on the H200). Here each row's vocabulary is cut into `SPLITS` slices; a program a slice reads it
twice (78 MB a step at 256 rows in all) -- once for its maximum, that maximum's first index and whether every
logit is finite, once for its sum of exp(x - its maximum) -- and a program a row combines the slices.

Same answer as torch's: the argmax of the float32 logits is the argmax of the half-precision ones (the
conversion is exact and monotone), the first index among equal maxima as torch's; the log-probability of the
chosen token, `-log(sum(exp(x - max)))`, sums float32 exponentials (IEEE exp) in another order and rescaled per
slice, so it may differ from torch's in the last bits. A row with a non-finite logit chooses `end_id`, as
`token_choice` does.
"""

from __future__ import annotations

import torch

from worker.fastpath import pointwise
from worker.fastpath.ops import KernelSwitch
from worker.fastpath.pointwise import INTERPRETED, Launcher, cdiv, triton

# Logits a program reads per iteration (bf16: 8 KiB), and programs a row: each row's vocabulary is cut into
# SPLITS slices, each reduced by a program of its own (one program a row ran at ~0.5 TB/s on the H200: 256
# programs cannot keep the GPU's memory busy), then one program a row combines its slices.
BLOCK = 2048
SPLITS = 16

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    # The vocabulary is a compile-time constant and the row stride specialised (one model's: one compile, in the
    # engine's warm-up; a stride that is a multiple of 16 lets Triton vectorise the loads).
    @triton.jit
    def _greedy_slices(logits, part_max, part_at, part_sum, part_bad, s_row, V: tl.constexpr, SLICE: tl.constexpr,
                       BLOCK: tl.constexpr, SPLITS: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        piece = tl.program_id(1)
        base = logits + row.to(tl.int64) * s_row
        first = piece * SLICE
        cols = tl.arange(0, BLOCK)
        best = tl.full((), float("-inf"), tl.float32)
        best_at = tl.full((), 0, tl.int32)
        bad = tl.full((), 0, tl.int32)
        for start in range(0, SLICE, BLOCK):  # pass 1: the slice's maximum, its first index, finiteness
            at = first + start + cols
            inside = (at < V) & (start + cols < SLICE)
            x = tl.load(base + at, mask=inside, other=float("-inf")).to(tl.float32)
            bad += tl.sum(((x != x) | (x == float("inf")) | ((x == float("-inf")) & inside)).to(tl.int32), axis=0)
            top = tl.max(x, axis=0)
            where = tl.argmax(x, axis=0, tie_break_left=True)
            best_at = tl.where(top > best, first + start + where, best_at)  # strictly: the first block keeps it
            best = tl.maximum(best, top)
        total = tl.full((), 0.0, tl.float32)
        for start in range(0, SLICE, BLOCK):  # pass 2: the slice's sum of exp(x - its maximum)
            at = first + start + cols
            inside = (at < V) & (start + cols < SLICE)
            x = tl.load(base + at, mask=inside, other=float("-inf")).to(tl.float32)
            if LIBDEVICE:
                total += tl.sum(tl.where(inside, libdevice.exp(x - best), 0.0), axis=0)
            else:  # the interpreter (numpy's exp is IEEE already)
                total += tl.sum(tl.where(inside, tl.exp(x - best), 0.0), axis=0)
        out = row * SPLITS + piece
        tl.store(part_max + out, best)
        tl.store(part_at + out, best_at)
        tl.store(part_sum + out, total)
        tl.store(part_bad + out, bad)

    @triton.jit(do_not_specialize=["end_id"])
    def _greedy_combine(part_max, part_at, part_sum, part_bad, token_out, logprob_out, finite_out, end_id,
                        SPLITS: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        pieces = row * SPLITS + tl.arange(0, SPLITS)
        m = tl.load(part_max + pieces)
        best = tl.max(m, axis=0)
        first = tl.argmax(m, axis=0, tie_break_left=True)  # the first slice holding the maximum: its first index
        at = tl.load(part_at + row * SPLITS + first)
        if LIBDEVICE:
            scaled = tl.load(part_sum + pieces) * libdevice.exp(m - best)
        else:
            scaled = tl.load(part_sum + pieces) * tl.exp(m - best)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, scaled), axis=0)
        finite = tl.sum(tl.load(part_bad + pieces), axis=0) == 0
        if LIBDEVICE:  # noqa: SIM108 (a static branch on a constexpr)
            logprob = -libdevice.log(total)
        else:
            logprob = -tl.log(total)
        tl.store(token_out + row, tl.where(finite, at.to(tl.int64), end_id))
        tl.store(logprob_out + row, logprob)
        tl.store(finite_out + row, finite)

    SLICES = Launcher(_greedy_slices, outputs=(1, 2, 3, 4))
    COMBINE = Launcher(_greedy_combine, outputs=(4, 5, 6))


class GreedyKernel:
    """The fused greedy choice where it runs (bf16/fp16 logits on CUDA; the CPU under Triton's interpreter), off
    for good once it failed (logged once; `sampling.greedy_choice`'s torch path computes the same from then on)."""

    def __init__(self) -> None:
        self.switch = KernelSwitch(on=True)

    def serves(self, logits: torch.Tensor) -> bool:
        return (
            self.switch.on
            and logits.dim() == 2
            and logits.stride(-1) == 1
            and pointwise.available(logits.device, logits.dtype)
            and logits.dtype in (torch.bfloat16, torch.float16, *((torch.float32,) if INTERPRETED else ()))
        )

    def __call__(self, logits: torch.Tensor, end_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Each row's token, its log-probability (float32) and whether its logits were all finite; None where the
        kernel failed (the caller's torch path then runs)."""
        rows, vocab = logits.shape
        device = logits.device
        part_max = torch.empty(rows, SPLITS, dtype=torch.float32, device=device)
        part_at = torch.empty(rows, SPLITS, dtype=torch.int32, device=device)
        part_sum = torch.empty(rows, SPLITS, dtype=torch.float32, device=device)
        part_bad = torch.empty(rows, SPLITS, dtype=torch.int32, device=device)
        token = torch.empty(rows, dtype=torch.long, device=device)
        logprob = torch.empty(rows, dtype=torch.float32, device=device)
        finite = torch.empty(rows, dtype=torch.bool, device=device)
        piece = cdiv(cdiv(vocab, SPLITS), BLOCK) * BLOCK
        libdevice_on = not INTERPRETED

        def launch() -> None:
            SLICES(
                (rows, SPLITS), logits, part_max, part_at, part_sum, part_bad, logits.stride(0), V=vocab,
                SLICE=piece, BLOCK=BLOCK, SPLITS=SPLITS, LIBDEVICE=libdevice_on,
            )  # fmt: skip
            COMBINE(
                (rows, 1), part_max, part_at, part_sum, part_bad, token, logprob, finite, end_id, SPLITS=SPLITS,
                LIBDEVICE=libdevice_on,
            )  # fmt: skip

        if not pointwise.launched(launch, logits.device, "greedy-choice"):
            self.switch.on = False
            return None
        return token, logprob, finite


KERNEL = GreedyKernel()
