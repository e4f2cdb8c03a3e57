"""Shared bench plumbing: model sets per shape (built locally, cached), hardware labels, result files."""

from __future__ import annotations

import gc
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from worker.tools.tinymodel import SHAPES, build_model_set

CACHE = Path(__file__).resolve().parent.parent / ".kevlaya" / "bench-models"
RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def model_dir(shape: str, *, device: str) -> Path:
    """Random-weight base + Kev/Laya adapters of `shape` (bf16 on CUDA), built once per machine."""
    root = CACHE / shape
    marker = root / ".built"
    if not marker.is_file():
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        build_device = device if device.startswith("cuda") else "cpu"
        start = time.time()
        build_model_set(root, shape=SHAPES[shape], device=build_device, dtype=dtype, adapter_scale=0.02)
        marker.write_text(f"built in {time.time() - start:.1f} s\n")
        if build_device.startswith("cuda"):
            gc.collect()  # PEFT wrappers hold cycles: free the build's weights before measuring anything
            torch.cuda.empty_cache()
    return root


def write_config(
    root: Path,
    *,
    device: str,
    quantization: str = "nf4",
    kev_new: int = 128,
    laya_new: int = 32,
    max_input_tokens: int = 1024,
    separate_bases: bool = False,
    name: str = "models.toml",
    adapters: tuple[str, str] = ("adapter-kev", "adapter-laya"),
) -> Path:
    """A models.toml over a model set: one shared base (kevlaya's layout) or two copies (the seed's)."""
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    base = f'path = "base"\nquantization = "{quantization}"\ncompute_dtype = "{dtype}"\n'
    if separate_bases:
        head = f"[bases.kev]\n{base}\n[bases.laya]\n{base}\n"
        kev_base, laya_base = 'base = "kev"\n', 'base = "laya"\n'
    else:
        head, kev_base, laya_base = f"[base]\n{base}\n", "", ""
    limits = f"max_input_tokens = {max_input_tokens}\nmax_new_tokens = {{}}\n"
    text = (
        f'{head}[models.kev]\n{kev_base}adapter = "{adapters[0]}"\n{limits.format(kev_new)}\n'
        f'[models.laya]\n{laya_base}adapter = "{adapters[1]}"\n{limits.format(laya_new)}'
    )
    path = root / name
    path.write_text(text)
    return path


def hardware(device: str, budget_bytes: int | None) -> str:
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device)).replace("NVIDIA ", "")
        cap = f" capped {budget_bytes / 2**30:.0f} GiB" if budget_bytes else ""
        return f"{name}{cap}"
    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def save_json(out_dir: Path, name: str, data: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def append_results(row: str, out_dir: Path | None = None) -> None:
    """Append a markdown row to bench/RESULTS.md (and a copy under out_dir, for runs on another machine)."""
    with RESULTS_MD.open("a") as fh:
        fh.write(row.rstrip() + "\n")
    if out_dir is not None:
        with (out_dir / "RESULTS-rows.md").open("a") as fh:
            fh.write(row.rstrip() + "\n")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
