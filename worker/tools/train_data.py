"""`kevlaya train`'s data (steps 1-2 of worker/tools/train.py): the JSONL read, each sample's prompt rendered by the
model's own template (the exact prompts the engine serves) with its target and the serving stop token appended
(only target tokens carry a loss), overlong samples dropped or truncated, categories rebalanced, and the padded
batches the loop takes."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import torch

from shared.errors import ConfigError, ValidationError
from shared.job import Job
from worker.templates import prompt_pieces

if TYPE_CHECKING:
    from worker.tools.train import TrainReport, TrainSettings


@dataclass(frozen=True)
class Sample:
    ids: list[int]
    labels: list[int]
    category: str | None


def stop_token_id(tokenizer: Any, stop: str) -> int:
    """The single token the stop string is; ConfigError if the tokenizer does not have it as one token."""
    ids = tokenizer(stop, add_special_tokens=False).input_ids
    if len(ids) != 1:
        raise ConfigError(f"stop string {stop!r} is {len(ids)} tokens for this tokenizer; training needs one")
    return ids[0]


def read_rows(path: Path, model: str) -> list[dict[str, Any]]:
    """Lines with `prompt` (or `input`), and the target under the model's name or `target`."""
    rows = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ValidationError(f"invalid JSON: {exc}", line=number) from exc
        target = obj.get(model, obj.get("target")) if isinstance(obj, dict) else None
        if not isinstance(target, str) or not target:
            raise ValidationError(f"needs a string target under {model!r} or 'target'", field=model, line=number)
        if not isinstance(obj.get("prompt"), str) and not isinstance(obj.get("input"), dict):
            raise ValidationError("needs 'prompt' (or 'input' fields)", field="prompt", line=number)
        rows.append(obj)
    if not rows:
        raise ValidationError(f"{path}: no training samples")
    return rows


def encode(
    rows: list[dict[str, Any]],
    tokenizer: Any,
    spec: Any,
    settings: TrainSettings,
    report: TrainReport,
    *,
    stop: str = "<|im_end|>",
) -> list[Sample]:
    """Prompt (no loss) + target + stop token (loss); overlong samples dropped or truncated, and counted.
    The stop is the serving config's first stop string, so the adapter learns the end serving looks for."""
    end_id = stop_token_id(tokenizer, stop)
    samples = []
    for row in rows:
        job = Job(custom_id="t", model=spec.name, prompt=row.get("prompt"), input=row.get("input"))
        prompt = [t for ids, _ in prompt_pieces(tokenizer, spec, job) for t in ids]
        target = [*tokenizer(row.get(spec.name, row.get("target")), add_special_tokens=False).input_ids, end_id]
        if len(prompt) + len(target) > settings.max_length:
            if settings.overlong == "drop" or len(prompt) >= settings.max_length:
                report.overlong_dropped += 1
                continue
            target = target[: settings.max_length - len(prompt)]
            report.overlong_truncated += 1
        samples.append(Sample(prompt + target, [-100] * len(prompt) + target, row.get("category")))
    return samples


def rebalance(samples: list[Sample], rng: random.Random) -> list[Sample]:
    """Every category to the mean category size: minority classes over-sampled (with replacement),
    majority classes under-sampled. Samples without a category are kept as they are."""
    groups: dict[str | None, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.category, []).append(s)
    named = {k: v for k, v in groups.items() if k is not None}
    if len(named) < 2:
        return samples
    target = round(statistics.mean(len(v) for v in named.values()))
    out = list(groups.get(None, []))
    for group in named.values():
        out += rng.sample(group, target) if len(group) >= target else group + rng.choices(group, k=target - len(group))
    rng.shuffle(out)
    return out


def counts(samples: list[Sample]) -> dict[str, int]:
    return dict(sorted(Counter(str(s.category) for s in samples).items()))


def batches(samples: list[Sample], size: int, pad_id: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    out = []
    for start in range(0, len(samples), size):
        chunk = samples[start : start + size]
        width = max(len(s.ids) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, : len(s.ids)] = torch.tensor(s.ids)
            labels[i, : len(s.labels)] = torch.tensor(s.labels)
            mask[i, : len(s.ids)] = 1
        out.append({"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device)})
    return out
