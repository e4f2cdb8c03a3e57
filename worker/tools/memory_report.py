"""`kevlaya memory`: the seed's memory table for a models config, measured on a GPU, estimated on CPU.

Rows: after the 4-bit base load, after both adapters, and peak while running one request of 512 and of
1024 tokens; then the batch plan the worker will use under the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from shared.job import Job
from worker.config import ModelsConfig, load_config
from worker.engine import Engine
from worker.loading import attach_adapter, load_base, pick_device
from worker.memory import DTYPE_BYTES, MIB, ModelShape, plan_batch


@dataclass(frozen=True)
class MemoryRow:
    stage: str
    bytes: int


def measure_gpu(config: ModelsConfig, device: torch.device) -> list[MemoryRow]:
    """Load for real and read torch's allocator after each stage (peak for the inference rows)."""
    rows = []
    bases = {}
    for name in {m.base for m in config.models.values()}:
        bases[name] = load_base(config.bases[name], device)
    torch.cuda.synchronize(device)
    rows.append(MemoryRow("after 4-bit load (bases)", torch.cuda.memory_allocated(device)))
    for model in config.models.values():
        attach_adapter(bases[model.base], model.name, model.adapter)
    rows.append(MemoryRow("after adapters (Kev + Laya)", torch.cuda.memory_allocated(device)))
    for tokens in (512, 1024):
        # One request of `tokens` prompt tokens through the real engine path (limits raised to allow it).
        models = {n: replace(m, max_input_tokens=max(m.max_input_tokens, tokens)) for n, m in config.models.items()}
        engine = Engine(replace(config, models=models), device=str(device), bases=bases)
        engine.memory.mark()  # the engine's takes each reset torch's peak: it keeps the most since the mark
        engine.run([Job(custom_id="m", model="kev", prompt="approve " * tokens, truncate=True, max_new_tokens=32)])
        peak = engine.memory.peak_since_mark()
        rows.append(MemoryRow(f"inference, 1 request of ~{tokens} tokens (peak)", peak))
    return rows


def estimate(config: ModelsConfig) -> list[MemoryRow]:
    """From the checkpoint shapes alone (no GPU): 4-bit weights, adapters, KV + activations."""
    weights = adapters = 0
    shapes = {}
    for name in {m.base for m in config.models.values()}:
        spec = config.bases[name]
        shape = ModelShape.from_config_file(spec.path)
        shapes[name] = shape
        weights += shape.weight_bytes(
            quantized=spec.quantization != "none",
            double_quant=spec.double_quant,
            dtype_bytes=DTYPE_BYTES[spec.compute_dtype],
        )
    for model in config.models.values():
        if model.adapter is not None:
            adapters += sum(p.stat().st_size for p in Path(model.adapter).glob("*.safetensors"))
    rows = [
        MemoryRow("after 4-bit load (bases)", weights),
        MemoryRow("after adapters (Kev + Laya)", weights + adapters),
    ]
    shape = shapes[config.models["kev"].base]
    for tokens in (512, 1024):
        extra = tokens * (shape.kv_bytes_per_token() + shape.prefill_bytes_per_token()) + shape.decode_bytes_per_row()
        rows.append(MemoryRow(f"inference, 1 request of ~{tokens} tokens (peak)", weights + adapters + extra))
    return rows


def memory_table(config_path: str | Path, *, budget_bytes: int, device: str | None = None) -> str:
    config = load_config(config_path)
    dev = pick_device(device)
    measured = dev.type == "cuda"
    rows = measure_gpu(config, dev) if measured else estimate(config)
    how = f"measured on {torch.cuda.get_device_name(dev)}" if measured else "estimated, CPU: no GPU here"
    lines = [f"memory for {config.path} ({how})"]
    lines += [f"  {r.stage:<44} {r.bytes / MIB:10.1f} MiB" for r in rows]
    resident = rows[1].bytes
    lines.append(f"batch plan under a {budget_bytes / 2**30:.2f} GiB budget (resident {resident / MIB:.0f} MiB):")
    for name, spec in config.models.items():
        shape = ModelShape.from_config_file(config.base_of(name).path)
        plan = plan_batch(
            shape,
            budget_bytes=budget_bytes,
            resident_bytes=resident,
            input_tokens=spec.max_input_tokens,
            new_tokens=spec.max_new_tokens,
            dtype_bytes=DTYPE_BYTES[config.base_of(name).compute_dtype],
        )
        lines.append(
            f"  {name:<5} {plan.max_rows:4d} rows of {spec.max_input_tokens}+{spec.max_new_tokens} tokens "
            f"(KV {plan.kv_bytes_per_token / 1024:.1f} KiB/token, {plan.bytes_per_row / MIB:.1f} MiB/row)"
        )
    return "\n".join(lines)
