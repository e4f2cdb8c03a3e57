"""`kevlaya train`: the seed's LoRA recipe as a command, with its lessons built in.

One linear path (nanoGPT style; steps 1-2, the data, in `worker/tools/train_data.py`):
1. read the JSONL (prompt or input fields + a target per model), render each prompt with the model's own
   template (the exact prompts the engine will serve), append the target and the end-of-answer token;
   only target tokens carry a loss;
2. drop or truncate samples over `max_length` (the seed's NaN at step 201 came from one overlong sample)
   and rebalance by `category` (its oscillating loss came from one dominant class);
3. load the base: 4-bit (QLoRA) on CUDA, plain weights on CPU; attach a fresh LoRA with A ~ N(0, 0.02)
   and B = 0 (the seed: a large A initialisation blows up early gradients);
4. AdamW over the LoRA weights only, gradient accumulation, clipping at 1.0; a non-finite loss or a
   gradient-norm spike skips the step, and repeated bad steps roll back to the last good checkpoint;
5. save the adapter only (PEFT format), the template and defaults beside it, a metrics JSON and a loss
   curve PNG. `all` trains Kev, frees everything, then Laya: never both at once (the seed: no room).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from shared.errors import ConfigError
from shared.models import defaults_for
from worker.config import ModelsConfig
from worker.loading import pick_device, torch_dtype
from worker.tools.plots import loss_png
from worker.tools.train_data import Sample, batches, counts, encode, read_rows, rebalance, stop_token_id

log = logging.getLogger("kevlaya.train")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LossHook = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class TrainSettings:
    rank: int
    alpha: int
    lr: float
    batch_size: int = 4
    grad_accum: int = 2
    max_length: int = 1024
    epochs: float = 3.0
    clip_norm: float = 1.0
    lora_init_std: float = 0.02
    lr_decay: bool = False  # decay the learning rate linearly to 0 over the run (the last steps settle, not jump)
    seed: int = 42
    overlong: str = "drop"  # drop | truncate
    rebalance: bool = True
    spike_factor: float = 10.0  # a gradient norm this many times the recent median is a spike ...
    spike_min_norm: float = 5.0  # ... if it is also above this (the seed's spike was 50; noise near zero is not)
    max_bad_steps: int = 3  # consecutive skipped steps before rolling back to the last good checkpoint
    checkpoint_every: int = 20
    max_steps: int | None = None
    log_every: int = 10

    @classmethod
    def for_model(cls, model: str, **overrides: Any) -> TrainSettings:
        """The model's training defaults (shared/models.py: the seed's table, Kev rank 16 / Laya rank 8),
        with any override given."""
        d = defaults_for(model)
        table = {"rank": d.lora_rank, "alpha": d.lora_alpha, "lr": d.learning_rate}
        return cls(**{**table, **{k: v for k, v in overrides.items() if v is not None}})


@dataclass
class TrainReport:
    model: str
    samples_in: int = 0
    overlong_dropped: int = 0
    overlong_truncated: int = 0
    categories_before: dict[str, int] = field(default_factory=dict)
    categories_after: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    skipped_steps: list[dict[str, Any]] = field(default_factory=list)
    rollbacks: list[int] = field(default_factory=list)
    seconds: float = 0.0
    device: str = "cpu"
    quantized: bool = False


# ---- model ---------------------------------------------------------------------------------------
def load_for_training(config: ModelsConfig, model: str, device: torch.device) -> tuple[Any, Any, bool]:
    """QLoRA on CUDA (the base in 4 bit, as the config says); plain float32 LoRA on CPU."""
    base = config.base_of(model)
    tokenizer = AutoTokenizer.from_pretrained(base.path, local_files_only=True)
    quantized = device.type == "cuda" and base.quantization != "none"
    kwargs: dict[str, Any] = {"local_files_only": True, "device_map": {"": str(device)}}
    if quantized:
        from peft import prepare_model_for_kbit_training

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=base.quantization,
            bnb_4bit_compute_dtype=torch_dtype(base.compute_dtype),
            bnb_4bit_use_double_quant=base.double_quant,
        )
        model_obj = prepare_model_for_kbit_training(AutoModelForCausalLM.from_pretrained(base.path, **kwargs))
    else:
        kwargs["dtype"] = torch.float32 if device.type == "cpu" else torch_dtype(base.compute_dtype)
        model_obj = AutoModelForCausalLM.from_pretrained(base.path, **kwargs)
    return model_obj, tokenizer, quantized


def attach_lora(model: Any, settings: TrainSettings) -> Any:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=TARGET_MODULES,
        lora_dropout=0.05,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.normal_(0.0, settings.lora_init_std)
            elif "lora_B" in name:
                param.zero_()
    return peft_model


# ---- the loop ------------------------------------------------------------------------------------
def train_adapter(
    config: ModelsConfig,
    model: str,
    data: Path,
    out: Path,
    settings: TrainSettings,
    *,
    device: str | None = None,
    loss_hook: LossHook | None = None,
) -> TrainReport:
    """Train one adapter; returns the report (also written as out/metrics.json)."""
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    dev = pick_device(device)
    report = TrainReport(model=model, device=str(dev))
    start = time.time()
    base_model, tokenizer, report.quantized = load_for_training(config, model, dev)
    spec = config.models[model]
    rows = read_rows(data, model)
    report.samples_in = len(rows)
    samples = encode(rows, tokenizer, spec, settings, report, stop=config.stop_strings[0])
    if tokenizer.pad_token_id is None:  # a base without one: padding must be a token it has (masked anyway)
        tokenizer.pad_token = config.stop_strings[0]
    if not samples:
        raise ConfigError(f"no sample of {data} fits max_length={settings.max_length}")
    report.categories_before = counts(samples)
    if settings.rebalance:
        samples = rebalance(samples, rng)
    report.categories_after = counts(samples)
    log.info(
        "%s: %d samples (%d overlong dropped, %d truncated); categories %s -> %s",
        model, len(samples), report.overlong_dropped, report.overlong_truncated,
        report.categories_before, report.categories_after,
    )  # fmt: skip
    peft_model = attach_lora(base_model, settings)
    peft_model.train()
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    _loop(peft_model, optimizer, params, samples, tokenizer.pad_token_id, dev, settings, report, loss_hook, rng)
    report.seconds = time.time() - start
    _save(peft_model, spec, settings, report, out)
    del peft_model, base_model, optimizer
    free_memory(dev)
    return report


def _loop(
    model: Any,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    samples: list[Sample],
    pad_id: int,
    device: torch.device,
    settings: TrainSettings,
    report: TrainReport,
    loss_hook: LossHook | None,
    rng: random.Random,
) -> None:
    micro_steps = math.ceil(settings.epochs * math.ceil(len(samples) / settings.batch_size))
    total_steps = math.ceil(micro_steps / settings.grad_accum)
    if settings.max_steps is not None:
        total_steps = min(total_steps, settings.max_steps)
    good = _snapshot(model, optimizer)
    norms: list[float] = []
    bad_in_a_row = 0
    epoch_batches: list[dict[str, torch.Tensor]] = []
    micro = 0
    for step in range(1, total_steps + 1):
        optimizer.zero_grad(set_to_none=True)
        step_loss, finite = 0.0, True
        for _ in range(settings.grad_accum):
            if not epoch_batches:
                rng.shuffle(samples)
                epoch_batches = batches(samples, settings.batch_size, pad_id, device)
            batch = epoch_batches.pop()
            micro += 1
            loss = model(**batch).loss
            if loss_hook is not None:
                loss = loss_hook(micro, loss)
            if not torch.isfinite(loss):
                finite = False  # never backpropagate a NaN: it would poison every LoRA weight
                break
            (loss / settings.grad_accum).backward()
            step_loss += loss.item() / settings.grad_accum
        norm = float(torch.nn.utils.clip_grad_norm_(params, settings.clip_norm)) if finite else float("nan")
        reason = _bad_step_reason(finite, norm, norms, settings)
        if reason is not None:
            optimizer.zero_grad(set_to_none=True)
            bad_in_a_row += 1
            report.skipped_steps.append({"step": step, "reason": reason})
            log.warning("step %d skipped: %s", step, reason)
            if bad_in_a_row >= settings.max_bad_steps:
                _restore(model, optimizer, good)
                report.rollbacks.append(step)
                log.warning(
                    "step %d: %d bad steps in a row; rolled back to the last good checkpoint", step, bad_in_a_row
                )
                bad_in_a_row = 0
            continue
        _set_lr(optimizer, settings, step, total_steps)
        optimizer.step()
        bad_in_a_row = 0
        norms.append(norm)
        report.losses.append(step_loss)
        report.steps = step
        if step % settings.checkpoint_every == 0:
            good = _snapshot(model, optimizer)
        if step % settings.log_every == 0 or step == total_steps:
            log.info("step %d/%d loss %.4f grad-norm %.3f", step, total_steps, step_loss, norm)


def _set_lr(optimizer: torch.optim.Optimizer, settings: TrainSettings, step: int, total_steps: int) -> None:
    """With lr_decay, step s of n runs at lr * (n - s + 1) / n: full at the first step, lr / n at the last."""
    if settings.lr_decay:
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * (total_steps - step + 1) / total_steps


def _bad_step_reason(finite: bool, norm: float, norms: list[float], settings: TrainSettings) -> str | None:
    if not finite:
        return "non-finite loss"
    if not math.isfinite(norm):
        return "non-finite gradient norm"
    recent = norms[-50:]
    if len(recent) >= 10 and norm > max(settings.spike_min_norm, settings.spike_factor * statistics.median(recent)):
        return f"gradient-norm spike {norm:.2f} > {settings.spike_factor} x median {statistics.median(recent):.2f}"
    return None


def _snapshot(model: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from peft import get_peft_model_state_dict

    lora = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return {"lora": lora, "optimizer": _clone(optimizer.state_dict())}


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _restore(model: Any, optimizer: torch.optim.Optimizer, snapshot: dict[str, Any]) -> None:
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, snapshot["lora"])
    optimizer.load_state_dict(_clone(snapshot["optimizer"]))


def _save(model: Any, spec: Any, settings: TrainSettings, report: TrainReport, out: Path) -> None:
    """Adapter weights only (PEFT format), with the template and defaults it was trained for."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    meta = {
        "model": spec.name,
        "template": spec.template,
        "system": spec.system,
        "max_new_tokens": spec.max_new_tokens,
        "decision_prefix": spec.decision_prefix,
        "settings": asdict(settings),
    }
    (out / "kevlaya.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False))
    (out / "metrics.json").write_text(json.dumps(asdict(report), indent=2))
    loss_png(report, out / "loss.png")


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def train_models(
    config: ModelsConfig, which: str, data: Path, out: Path, *, device: str | None = None, **overrides: Any
) -> dict[str, TrainReport]:
    """`kevlaya train {kev|laya|all}`: `all` trains Kev, frees it, then Laya -- serially, never both at once."""
    models = ["kev", "laya"] if which == "all" else [which]
    reports = {}
    for name in models:
        settings = TrainSettings.for_model(name, **overrides)
        target = out / name if which == "all" else out
        reports[name] = train_adapter(config, name, data, target, settings, device=device)
    return reports


__all__ = [
    "Sample",
    "TrainReport",
    "TrainSettings",
    "encode",
    "rebalance",
    "stop_token_id",
    "train_adapter",
    "train_models",
]
