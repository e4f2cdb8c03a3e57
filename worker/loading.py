"""Loading the base model(s) once, quantised, with Kev and Laya attached as named PEFT adapters.

Each distinct base in the config is loaded once (largest first, so the big allocation meets an empty
card); models that share a base become named adapters on it, which is what keeps the seed's
colliding LoRA keys apart. A model without an adapter is served by the base itself.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from shared.errors import ConfigError
from worker.config import BaseSpec, ModelsConfig
from worker.memory import ModelShape
from worker.versions import fingerprint

log = logging.getLogger("kevlaya.loading")
hf_logging.disable_progress_bar()
BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch


@dataclass
class LoadedBase:
    """One resident base and the adapters attached to it, by kevlaya model name."""

    spec: BaseSpec
    model: Any  # a PeftModel when any adapter is attached, else the plain causal LM
    tokenizer: PreTrainedTokenizerBase
    shape: ModelShape
    fingerprint: str
    adapters: dict[str, str | None] = field(default_factory=dict)  # model name -> adapter name (None = base)
    adapter_fingerprints: dict[str, str] = field(default_factory=dict)
    active_adapter: str | None = None  # what set_adapter last selected: switching costs ms, so only on change

    @property
    def has_peft(self) -> bool:
        return any(a is not None for a in self.adapters.values())


def torch_dtype(name: str) -> torch.dtype:
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def pick_device(text: str | None) -> torch.device:
    """`--device` (None: CUDA if there is one, else the CPU) as a torch device, checked here: torch's own errors for
    a misspelt name or a GPU this process cannot use are a traceback (or an AssertionError) from deep in its
    lazy CUDA init, not a line an operator can act on."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"--device {text!r}: not a device (use cpu, cuda or cuda:N)") from exc
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0 or (device.index is not None and device.index >= count):
        raise ConfigError(f"--device {text}: this process sees {count} CUDA device(s)")
    return device


def load_all(config: ModelsConfig, device: torch.device) -> dict[str, LoadedBase]:
    """Load every base the config uses, largest first, then attach each model's adapter by name."""
    used = {m.base for m in config.models.values()}
    order = sorted(used, key=lambda b: _checkpoint_bytes(config.bases[b].path), reverse=True)
    loaded: dict[str, LoadedBase] = {}
    for name in order:
        if loaded and device.type == "cuda":
            # Between two base loads only: returns the first load's transient buffers to the card so the
            # second base's large allocations are not split around them (the seed's fragmentation).
            gc.collect()
            torch.cuda.empty_cache()
        loaded[name] = load_base(config.bases[name], device)
        if config.stop_strings_set:
            check_stop_strings(loaded[name], config.stop_strings, config.path)
    for model in config.models.values():
        attach_adapter(loaded[model.base], model.name, model.adapter)
    return loaded


def load_base(spec: BaseSpec, device: torch.device) -> LoadedBase:
    dtype = torch_dtype(spec.compute_dtype)
    quant = None
    if spec.quantization != "none":
        # NF4/FP4 need no calibration data: each block of 64 weights is scaled by its own absmax.
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=spec.quantization,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=spec.double_quant,
        )
    log.info(
        "loading base %s from %s (%s, %s) on %s", spec.name, spec.path, spec.quantization, spec.compute_dtype, device
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(
            spec.path, quantization_config=quant, dtype=dtype, device_map={"": str(device)}, local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"base {spec.name!r} at {spec.path} could not be loaded: {exc}") from exc
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedBase(
        spec=spec,
        model=model,
        tokenizer=tokenizer,
        shape=ModelShape.from_config_file(spec.path),
        fingerprint=fingerprint(spec.path),
    )


def attach_adapter(base: LoadedBase, model_name: str, adapter: Path | None) -> None:
    """Attach `adapter` under the kevlaya model's own name; a clear ConfigError if it does not fit."""
    from peft import PeftModel  # imported here: a config without adapters never needs peft

    if adapter is None:
        base.adapters[model_name] = None
        return
    try:
        if isinstance(base.model, PeftModel):
            base.model.load_adapter(str(adapter), adapter_name=model_name, is_trainable=False)
        else:
            base.model = PeftModel.from_pretrained(
                base.model, str(adapter), adapter_name=model_name, is_trainable=False
            )
    except (RuntimeError, ValueError, KeyError, OSError) as exc:
        raise ConfigError(
            f"adapter for {model_name!r} at {adapter} does not fit base {base.spec.name!r}: {exc}"
        ) from exc
    base.model.eval()
    base.adapters[model_name] = model_name
    base.adapter_fingerprints[model_name] = fingerprint(adapter)


def stop_ids(base: LoadedBase, stop_strings: Sequence[str]) -> list[int]:
    """The token ids of the configured stop strings this tokenizer knows as single tokens (else its EOS)."""
    ids = [i for s in stop_strings if (i := _single_token(base.tokenizer, s)) is not None]
    return ids or [base.tokenizer.eos_token_id]


def _single_token(tok: Any, text: str) -> int | None:
    """The id of `text` as one token of this tokenizer, or None."""
    i = tok.convert_tokens_to_ids(text)
    # A text no token spells maps to the unknown token's id -- unless the text is that very token: a tokenizer
    # whose unknown token is one of its real ones (transformers 5 reports the tiny models' `<|endoftext|>`, also
    # their padding and a default stop string) would otherwise drop it from the stops, and refuse it configured.
    return i if isinstance(i, int) and (i != tok.unk_token_id or text == tok.unk_token) else None


def check_stop_strings(base: LoadedBase, stop_strings: Sequence[str], where: Path) -> None:
    """Configured stop strings must each be one token of this base's tokenizer: a row stops on a token, so any
    other string would be dropped without a word and generation would run past it."""
    for s in stop_strings:
        if _single_token(base.tokenizer, s) is None:
            raise ConfigError(
                f"{where}: stop_strings: {s!r} is not a single token of base {base.spec.name!r}'s tokenizer "
                "(only single tokens can stop a row)"
            )


@contextlib.contextmanager
def select_adapters(base: LoadedBase, rows: Sequence[str | None]) -> Iterator[dict[str, Any]]:
    """Select the adapter(s) for rows of these adapter names: one active adapter for a single-model batch,
    per-row names for a mixed one."""
    names = set(rows)
    if not base.has_peft:
        yield {}
    elif len(names) > 1:
        yield {"adapter_names": [name or BASE_ADAPTER for name in rows]}
    elif None in names:
        with base.model.disable_adapter():
            yield {}
    else:
        name = next(iter(names))
        if base.active_adapter != name:
            base.model.set_adapter(name)  # walks every LoRA layer (ms on a 28-layer model): only on change
            base.active_adapter = name
        yield {}


def _checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) if path.is_dir() else 0
