"""The GPU side: engine, batching policy, RQ batch worker, escalation, memory planning.

The only package that imports torch, transformers, peft and bitsandbytes.
"""

import os

# Expandable segments let the KV cache grow step by step without fragmenting a capped card (measured on an
# H200 capped at 6 GiB: without it, large batches thrash the allocator near the cap). Set before CUDA starts.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
