"""The GPU side: engine, batching policy, RQ batch worker, escalation, memory planning.

The only package that imports torch, transformers, peft and bitsandbytes.
"""

import logging

# bitsandbytes warns on every CPU import that an optional `kernels` package is missing, then uses its
# own CPU path (the one our CPU tests exercise): keep that noise out of every `kevlaya` command.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
