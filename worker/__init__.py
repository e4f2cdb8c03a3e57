"""The GPU side: engine, batching policy, RQ batch worker, escalation, memory planning.

The only package that imports torch, transformers, peft and bitsandbytes.
"""
