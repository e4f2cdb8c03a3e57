"""The fast decode path: a static KV cache, the loop's own prefill, and CUDA-graph-captured decode steps.

Rooms: `quant4` (the only caller of bitsandbytes' ops), `ops` (fused elementwise steps), `weights` (projections,
LoRA, joined q/k/v and gate/up, the layer stack's math), `graphs` (the state each graph owns, the KV pool, the
graph cache), `prefill` (prompts into the cache), `decoder` (the step and the batch loop). See `decoder` for how
a batch runs.
"""

from worker.fastpath.decoder import ARCHITECTURES, Decoded, DecodeRow, StaticDecoder, unsupported_reason
from worker.fastpath.graphs import LENGTH_QUANTUM, ROW_BUCKETS, length_bucket, row_bucket
from worker.fastpath.prefill import left_pad, to_device

__all__ = [
    "ARCHITECTURES",
    "LENGTH_QUANTUM",
    "ROW_BUCKETS",
    "DecodeRow",
    "Decoded",
    "StaticDecoder",
    "left_pad",
    "length_bucket",
    "row_bucket",
    "to_device",
    "unsupported_reason",
]
