"""The fast decode path: a static KV cache, the loop's own prefill, and CUDA-graph-captured decode steps.

Rooms: `quant4` (the only caller of bitsandbytes' ops), `ops` (fused elementwise steps), `pointwise` (our Triton
kernels for rotary and SiLU x up: prefill's by default, the decode step's opt-in), `gemm` (prefill's matmuls in
row blocks, so cuBLAS meets few row counts), `weights` (projections, LoRA, joined q/k/v and gate/up, the layer
stack's math), `graphs` (the state each graph owns, the KV pool, the graph cache), `prefill` (prompts into the
cache), `staging` (host tensors to the GPU through a pinned ring), `sampling` (per-row seeded draws in the step),
`scoring` (choices against the cached prompt), `decoder` (the step and the batch loop). See `decoder` for how a
batch runs.
"""

from worker.fastpath.decoder import ARCHITECTURES, Decoded, DecodeRow, StaticDecoder, unsupported_reason
from worker.fastpath.graphs import LENGTH_QUANTUM, ROW_BUCKETS, length_bucket, row_bucket
from worker.fastpath.ops import DEFAULT_OPS, OpsOptions
from worker.fastpath.prefill import left_pad, to_device
from worker.fastpath.sampling import Sampling
from worker.fastpath.scoring import Scored, ScoreRow

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_OPS",
    "LENGTH_QUANTUM",
    "ROW_BUCKETS",
    "DecodeRow",
    "Decoded",
    "OpsOptions",
    "Sampling",
    "ScoreRow",
    "Scored",
    "StaticDecoder",
    "left_pad",
    "length_bucket",
    "row_bucket",
    "to_device",
    "unsupported_reason",
]
