"""Training: the seed's lessons as features (rebalancing, overlong filter, non-finite guard, rollback)
and an adapter-only checkpoint that the engine loads and that changes its outputs."""

from __future__ import annotations

import math
import random
from pathlib import Path

import orjson
import pytest
import torch
from click.testing import CliRunner

from producer.cli import cli
from shared.job import Job
from tests.conftest import tiny_config
from worker.config import load_config
from worker.engine import Engine
from worker.tools.train import Sample, TrainReport, TrainSettings, _set_lr, encode, rebalance, train_adapter


def write_data(path: Path, n: int = 24, *, long_every: int = 0) -> Path:
    rows = []
    for i in range(n):
        prompt = f"Loan {i}: income {30000 + i}, debt ratio 0.{i % 9}."
        if long_every and i % long_every == 0:
            prompt += " padding" * 400
        label = ["approve", "reject", "review"][i % 3] if i % 4 else "approve"
        rows.append({"prompt": prompt, "kev": f"Step 1: check.\nDecision: {label}", "laya": label, "category": label})
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def quick(model: str = "laya", **kw: object) -> TrainSettings:
    base = {"lr": 5e-3, "batch_size": 4, "grad_accum": 1, "max_steps": 6, "log_every": 100, "max_length": 256}
    return TrainSettings.for_model(model, **{**base, **kw})


def test_seed_table_defaults() -> None:
    kev, laya = TrainSettings.for_model("kev"), TrainSettings.for_model("laya")
    assert (kev.rank, kev.alpha, kev.lr, laya.rank, laya.alpha, laya.lr) == (16, 32, 1e-4, 8, 16, 2e-4)
    assert (kev.batch_size, kev.grad_accum, kev.max_length, kev.epochs, kev.clip_norm) == (4, 2, 1024, 3.0, 1.0)
    assert kev.lora_init_std <= 0.02


def test_lr_decay_runs_linearly_from_the_full_rate_to_one_step_of_it() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1.0)
    rates = []
    for step in range(1, 5):
        _set_lr(optimizer, quick(lr=0.4, lr_decay=True), step, 4)
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([0.4, 0.3, 0.2, 0.1])
    _set_lr(optimizer, quick(lr=0.4), 4, 4)  # off (the default): the rate is left as it is
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [({"a": 30, "b": 6, "c": 12}, 16), ({"a": 5, "b": 5}, 5), ({"a": 1, "b": 99}, 50)],
)
def test_rebalance_brings_every_category_to_the_mean(sizes: dict[str, int], expected: int) -> None:
    samples = [Sample([1], [1], cat) for cat, n in sizes.items() for _ in range(n)]
    samples += [Sample([2], [2], None)] * 3
    out = rebalance(samples, random.Random(0))
    counts = {cat: sum(s.category == cat for s in out) for cat in sizes}
    assert counts == dict.fromkeys(sizes, expected)
    assert sum(s.category is None for s in out) == 3  # uncategorised samples are kept as they are


def test_overlong_samples_are_dropped_or_truncated(tiny_models: Path, tmp_path: Path) -> None:
    config = tiny_config(tiny_models, "none")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models / "base")
    rows = [orjson.loads(line) for line in write_data(tmp_path / "d.jsonl", 12, long_every=4).read_bytes().splitlines()]
    report = TrainReport(model="kev")
    kept = encode(rows, tok, config.models["kev"], quick("kev", max_length=200), report)
    assert (report.overlong_dropped, len(kept)) == (3, 9)
    report = TrainReport(model="kev")
    rows[0]["kev"] = "word " * 300  # a long target on a short prompt can be cut instead
    kept = encode(
        [*rows[1:2], rows[0] | {"prompt": "short"}],
        tok,
        config.models["kev"],
        quick("kev", max_length=200, overlong="truncate"),
        report,
    )
    assert report.overlong_truncated == 1 and all(len(s.ids) <= 200 for s in kept)


def test_non_finite_loss_is_skipped_and_repeated_bad_steps_roll_back(tiny_models: Path, tmp_path: Path) -> None:
    data = write_data(tmp_path / "d.jsonl")
    poisoned = {3, 6, 7, 8}  # one bad step, then three in a row

    def hook(micro: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if micro in poisoned else loss

    out = tmp_path / "adapter"
    settings = quick(max_steps=10, checkpoint_every=1, max_bad_steps=3)
    report = train_adapter(tiny_config(tiny_models, "none"), "laya", data, out, settings, device="cpu", loss_hook=hook)
    assert [s["step"] for s in report.skipped_steps] == [3, 6, 7, 8]
    assert all(s["reason"] == "non-finite loss" for s in report.skipped_steps)
    assert report.rollbacks == [8]
    assert len(report.losses) == 6 and all(math.isfinite(x) for x in report.losses)
    from safetensors.torch import load_file

    weights = load_file(out / "adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    metrics = orjson.loads((out / "metrics.json").read_bytes())
    assert metrics["rollbacks"] == [8] and (out / "loss.png").stat().st_size > 0


def test_adapter_only_checkpoint_loads_in_the_engine_and_changes_outputs(tiny_models: Path, tmp_path: Path) -> None:
    data = write_data(tmp_path / "d.jsonl")
    out = tmp_path / "trained-laya"
    train_adapter(tiny_config(tiny_models, "none"), "laya", data, out, quick(max_steps=8), device="cpu")
    files = sorted(p.name for p in out.iterdir())
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files
    assert "model.safetensors" not in files  # adapter only, never the base
    meta = orjson.loads((out / "kevlaya.json").read_bytes())
    assert meta["model"] == "laya" and "{prompt}" in meta["template"]
    base = tiny_models / "base"
    toml = tmp_path / "m.toml"
    toml.write_text(f'[base]\npath = "{base}"\nquantization = "none"\ncompute_dtype = "float32"\n')
    plain = Engine(load_config(toml), device="cpu")
    toml.write_text(toml.read_text() + f'[models.laya]\nadapter = "{out}"\n')
    tuned = Engine(load_config(toml), device="cpu")
    job = Job(
        custom_id="a", model="laya", prompt="Loan 3: income 30003, debt ratio 0.3.", choices=("approve", "reject")
    )
    assert plain.run([job])[0].choices != tuned.run([job])[0].choices


def test_train_cli_all_trains_kev_then_laya(tiny_models: Path, tmp_path: Path) -> None:
    tiny_config(tiny_models, "none")
    data = write_data(tmp_path / "d.jsonl")
    args = ["train", "all", "--data", str(data), "--config", str(tiny_models / "models-none.toml")]
    args += ["--out", str(tmp_path / "out"), "--max-steps", "2", "--batch-size", "4", "--device", "cpu"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for name in ("kev", "laya"):
        assert (tmp_path / "out" / name / "adapter_model.safetensors").is_file()
    assert "kev: 2 steps" in result.stderr and "laya: 2 steps" in result.stderr


def test_bad_training_data_names_the_line(tiny_models: Path, tmp_path: Path) -> None:
    tiny_config(tiny_models, "none")
    data = tmp_path / "bad.jsonl"
    data.write_bytes(b'{"prompt": "x", "laya": "approve"}\n{"prompt": "y"}\n')
    args = [
        "train",
        "laya",
        "--data",
        str(data),
        "--config",
        str(tiny_models / "models-none.toml"),
        "--out",
        str(tmp_path / "o"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code != 0 and "line 2" in result.output


def test_targets_end_with_the_serving_stop_and_a_pad_exists(tiny_models: Path) -> None:
    """Training ends every target with the config's first stop string (what serving stops on), not a
    hard-coded `<|im_end|>`; a stop that is not one token is refused."""
    from transformers import AutoTokenizer

    from shared.errors import ConfigError

    tok = AutoTokenizer.from_pretrained(tiny_models / "base")
    spec = tiny_config(tiny_models, "none").models["laya"]
    report = TrainReport(model="laya", device="cpu")
    for stop in ("<|endoftext|>", "<|im_end|>"):
        (sample,) = encode([{"prompt": "p", "laya": "approve"}], tok, spec, quick(), report, stop=stop)
        assert sample.ids[-1] == tok.convert_tokens_to_ids(stop) and sample.labels[-1] == sample.ids[-1]
    with pytest.raises(ConfigError, match="training needs one"):
        encode([{"prompt": "p", "laya": "approve"}], tok, spec, quick(), report, stop="END OF ANSWER")
