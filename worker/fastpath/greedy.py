"""The greedy token choice of a decode step as one Triton kernel over the LM head's own (bf16/fp16) logits.

Torch's way (`sampling.token_choice`) converts the logits to float32 a chunk of rows at a time and runs the
finiteness check, the argmax, the log-softmax and a gather over each chunk: ~7 kernels a chunk, each a pass over
the chunk's float32 copy (at 256 rows of a 152k vocabulary: ~56 launches and ~1 GB of traffic a step, ~0.5 ms
of a decode step on the H200). Here one program a row reads its logits twice (78 MB a step at 256 rows): once
for the maximum, its first index and whether every logit is finite, once for the sum of exp(x - max).

Same answer as torch's: the argmax of the float32 logits is the argmax of the half-precision ones (the
conversion is exact and monotone), the first index among equal maxima as torch's; the log-probability of the
chosen token, `-log(sum(exp(x - max)))`, adds the same float32 terms as torch's log-softmax (IEEE exp) in another
order, so it may differ from torch's in the last bits. A row with a non-finite logit chooses `end_id`, as
`token_choice` does.
"""

from __future__ import annotations

import torch

from worker.fastpath import pointwise
from worker.fastpath.pointwise import INTERPRETED, Launcher, triton

# Logits a program reads per iteration (bf16: 8 KiB).
BLOCK = 4096

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    # The vocabulary is a compile-time constant (one model's: one compile, in the engine's warm-up).
    @triton.jit(do_not_specialize=["s_row", "end_id"])
    def _greedy_kernel(logits, token_out, logprob_out, finite_out, s_row, end_id, V: tl.constexpr,
                       BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        base = logits + row.to(tl.int64) * s_row
        cols = tl.arange(0, BLOCK)
        best = tl.full((), float("-inf"), tl.float32)
        best_at = tl.full((), 0, tl.int64)
        bad = tl.full((), 0, tl.int32)
        for start in range(0, V, BLOCK):
            at = start + cols
            x = tl.load(base + at, mask=at < V, other=float("-inf")).to(tl.float32)
            bad += tl.sum(((x != x) | (x == float("inf")) | ((x == float("-inf")) & (at < V))).to(tl.int32), axis=0)
            top = tl.max(x, axis=0)
            where = tl.argmax(x, axis=0, tie_break_left=True)
            better = top > best  # strictly: the first block holding the maximum keeps it
            best_at = tl.where(better, (start + where).to(tl.int64), best_at)
            best = tl.maximum(best, top)
        total = tl.full((), 0.0, tl.float32)
        for start in range(0, V, BLOCK):
            at = start + cols
            x = tl.load(base + at, mask=at < V, other=float("-inf")).to(tl.float32)
            if LIBDEVICE:
                total += tl.sum(libdevice.exp(x - best), axis=0)
            else:  # the interpreter (numpy's exp is IEEE already)
                total += tl.sum(tl.exp(x - best), axis=0)
        finite = bad == 0
        if LIBDEVICE:  # noqa: SIM108 (a static branch on a constexpr)
            logprob = -libdevice.log(total)
        else:
            logprob = -tl.log(total)
        tl.store(token_out + row, tl.where(finite, best_at, end_id))
        tl.store(logprob_out + row, logprob)
        tl.store(finite_out + row, finite)

    GREEDY = Launcher(_greedy_kernel, outputs=(1, 2, 3))


class GreedyKernel:
    """The fused greedy choice where it runs (bf16/fp16 logits on CUDA; the CPU under Triton's interpreter), off
    for good once it failed (logged once; `sampling.greedy_choice`'s torch path computes the same from then on)."""

    def __init__(self) -> None:
        self.on = True

    def serves(self, logits: torch.Tensor) -> bool:
        return (
            self.on
            and logits.dim() == 2
            and logits.stride(-1) == 1
            and pointwise.available(logits.device, logits.dtype)
            and logits.dtype in (torch.bfloat16, torch.float16, *((torch.float32,) if INTERPRETED else ()))
        )

    def __call__(self, logits: torch.Tensor, end_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Each row's token, its log-probability (float32) and whether its logits were all finite; None where the
        kernel failed (the caller's torch path then runs)."""
        rows, vocab = logits.shape
        token = torch.empty(rows, dtype=torch.long, device=logits.device)
        logprob = torch.empty(rows, dtype=torch.float32, device=logits.device)
        finite = torch.empty(rows, dtype=torch.bool, device=logits.device)

        def launch() -> None:
            GREEDY(
                (rows, 1), logits, token, logprob, finite, logits.stride(0), end_id, V=vocab, BLOCK=BLOCK,
                LIBDEVICE=not INTERPRETED,
            )  # fmt: skip

        if not pointwise.launched(launch, logits.device, "greedy-choice"):
            self.on = False
            return None
        return token, logprob, finite


KERNEL = GreedyKernel()
