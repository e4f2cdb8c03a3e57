"""`kevlaya demo-models`: real demo models, built here because nothing can be downloaded.

1. a synthetic loan-triage task (worker.tools.demo_data): train and held-out splits;
2. a byte-level BPE tokenizer with single-digit number tokens (numbers compare digit by digit);
3. a tiny Qwen2 base trained briefly on the task's plain text (no chat format: that is the adapters' job);
4. Kev and Laya adapters trained with `kevlaya train` (worker.tools.train) on the chat-formatted task;
5. DIR/models.toml, then Laya's calibration fitted on the held-out split (`kevlaya calibrate`) and the
   escalation threshold picked there for a 25% escalation budget (`kevlaya eval --target-escalation 0.25
   --write-threshold`: 5 points of margin under the 30% the demo promises), both confirmed on a second
   held-out split not used for either (Laya's ECE; Laya, Kev and the cascade at the written threshold);
   the figures go to DIR/cascade.json. Cached: a marker records what was built, so a second call returns
   at once.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import orjson
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from worker.config import load_config
from worker.engine import Engine
from worker.tools.config_write import set_key, write_table
from worker.tools.demo_data import training_rows
from worker.tools.evaluate import EXPERT, SCREEN, calibrate, evaluate, uncalibrated
from worker.tools.tinymodel import SPECIAL_TOKENS
from worker.tools.train import train_models

log = logging.getLogger("kevlaya.demo_models")
VERSION = 9
TRAIN_ROWS, HELDOUT_ROWS = 2000, 600
CHECK_ROWS = 600  # the second held-out split: the calibration and the threshold are confirmed on it
TARGET_ESCALATION = 0.25  # the demo's escalation budget; the threshold is picked from data to spend it
# The seed's learning rates are for a 1.5B model; a ~1M-parameter demo model needs far larger steps.
DEMO_TRAIN = {"batch_size": 8, "grad_accum": 1, "lr_decay": True}
# Every run decays its rate linearly to 0 (`lr_decay`): with a constant rate the run ended wherever its last
# noisy steps left it, and the same Laya recipe (2 epochs at 3e-3) scored 0.785 on one draw and 0.950 on
# another. Decayed, Laya learns much of the order too, and Kev cannot lead it by 5 points: 2 epochs at 3e-3
# 0.95-0.98, one epoch at 1e-3 0.947-0.952 (this mix); one epoch at 5e-4 learns the counts, 0.90-0.93, and
# ranks its answers by them. Kev: one epoch at 3e-3, 0.993-0.998 (README, "Calibration and thresholds").
DEMO_EPOCHS = {"kev": 1.0, "laya": 1.0}
DEMO_LR = {"kev": 3e-3, "laya": 5e-4}
# One CPU thread for the whole build: the demo model's matrices are 128 wide, and two threads on a machine
# where another process holds a core wait on each other at every op (measured on 2 cores beside another
# test run, load 4-5: 20 base-model steps in 110 s with two threads, 20 s with one; the earlier 28-minute
# builds were this). The whole build with one thread: 5 min 31 s at load 1.1-2.9 (version 9).
BUILD_THREADS = 1
# The shipped draw: data seeds (train, held-out, second held-out split), the base's and the adapters' seeds.
# `--seed N` adds N to each, so the same recipe can be rebuilt on other draws of data and initialisation.
DATA_SEEDS = {"train": 11, "heldout": 12, "check": 13}
BASE_SEED, ADAPTER_SEED = 0, 42
BASE_LR = 3e-3


def build_demo_models(
    out: Path,
    *,
    train_rows: int = TRAIN_ROWS,
    heldout_rows: int = HELDOUT_ROWS,
    check_rows: int = CHECK_ROWS,
    pretrain_steps: int = 400,
    seed: int = 0,
) -> Path:
    """Build (or reuse) the demo models under OUT; SEED 0 is the shipped draw, any other a different one."""
    out = out.resolve()
    marker = out / ".demo-models.json"
    want = {
        "v": VERSION,
        "train": train_rows,
        "heldout": heldout_rows,
        "check": check_rows,
        "pretrain_steps": pretrain_steps,
        "seed": seed,
    }
    if marker.is_file() and json.loads(marker.read_text()).get("want") == want and (out / "models.toml").is_file():
        return out / "models.toml"
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        return _build(out, marker, want, train_rows=train_rows, heldout_rows=heldout_rows, check_rows=check_rows)
    finally:
        torch.set_num_threads(threads)


def _build(out: Path, marker: Path, want: dict, *, train_rows: int, heldout_rows: int, check_rows: int) -> Path:
    start = time.time()
    toml = out / "models.toml"
    trained = out / ".trained.json"  # training done: a failed calibration step does not cost a retrain
    if trained.is_file() and json.loads(trained.read_text()).get("want") == want:
        summary = json.loads(trained.read_text())["adapters"]
        toml.write_text(_toml(adapters=True))
    else:
        summary = _train_all(out, want, train_rows=train_rows, heldout_rows=heldout_rows, check_rows=check_rows)
    trained_s = time.time() - start
    figures = calibrate_and_pick_threshold(toml)
    seconds = {"training": trained_s, "calibration_and_eval": time.time() - start - trained_s}
    marker.write_text(json.dumps({"want": want, "seconds": seconds, "adapters": summary}, indent=2))
    (out / "cascade.json").write_text(json.dumps({**figures, "build_seconds": seconds}, indent=2))
    log.info("demo models built in %.0f s: %s", time.time() - start, summary)
    return toml


def _train_all(out: Path, want: dict, *, train_rows: int, heldout_rows: int, check_rows: int) -> dict:
    """Data, tokenizer, base, both adapters; DIR/models.toml naming them."""
    out.mkdir(parents=True, exist_ok=True)
    seed = want["seed"]
    train = training_rows(train_rows, seed=DATA_SEEDS["train"] + seed)
    _write_jsonl(out / "train.jsonl", train)
    _write_jsonl(out / "heldout.jsonl", training_rows(heldout_rows, seed=DATA_SEEDS["heldout"] + seed))
    _write_jsonl(out / "heldout-check.jsonl", training_rows(check_rows, seed=DATA_SEEDS["check"] + seed))
    tokenizer = _tokenizer(out / "base", train)
    _pretrain_base(out / "base", tokenizer, train, steps=want["pretrain_steps"], seed=BASE_SEED + seed)
    toml = out / "models.toml"
    toml.write_text(_toml())
    config = load_config(toml, check_paths=False)
    summary = {}
    for name, epochs in DEMO_EPOCHS.items():
        settings = {**DEMO_TRAIN, "epochs": epochs, "lr": DEMO_LR[name], "seed": ADAPTER_SEED + seed}
        report = train_models(config, name, out / "train.jsonl", out / "adapters" / name, **settings)
        r = report[name]
        summary[name] = {"steps": r.steps, "final_loss": r.losses[-1] if r.losses else None, "seconds": r.seconds}
    toml.write_text(_toml(adapters=True))
    (out / ".trained.json").write_text(json.dumps({"want": want, "adapters": summary}, indent=2))
    return summary


def calibrate_and_pick_threshold(toml: Path) -> dict:
    """What a user does with their own adapters, on the demo's: fit Laya's calibration on heldout.jsonl and
    pick there the threshold that spends the escalation budget, write both into the config, then confirm
    both on heldout-check.jsonl, which neither was fitted on: Laya's ECE, and Laya, Kev and the cascade at
    the written threshold."""
    out = toml.parent
    raw_engine = Engine(uncalibrated(load_config(toml)), device="cpu")
    fitted, fit_summary = calibrate(raw_engine, SCREEN, out / "heldout.jsonl")
    del raw_engine
    write_table(toml, f"models.{SCREEN}.calibration", fitted.to_table(), comment="written by `kevlaya calibrate`")
    picked = evaluate(
        Engine(load_config(toml), device="cpu"),
        out / "heldout.jsonl",
        out / "eval",
        target_escalation=TARGET_ESCALATION,
    )
    set_key(toml, f"models.{SCREEN}.escalation", "threshold", picked["threshold"])
    confirmed = evaluate(Engine(load_config(toml), device="cpu"), out / "heldout-check.jsonl", out / "eval-check")
    ece = ("ece_before", "ece_after")
    return {
        **{k: picked[k] for k in ("items", SCREEN, EXPERT, "cascade", "threshold", "target")},
        "check": {k: confirmed[k] for k in ("items", SCREEN, EXPERT, "cascade")},
        "calibration": {
            "method": fitted.method,
            "temperature": fitted.temperature,
            "choices_temperature": fitted.choices_temperature,
            "fit": {"items": fit_summary["items"], **{k: fit_summary[k] for k in ece}},
            "check": {"items": confirmed["items"], **{k: confirmed["calibration"][k] for k in ece}},
        },
    }


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def _tokenizer(out: Path, rows: list[dict]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [r["prompt"] for r in rows] + [r["kev"] for r in rows] + ["You are Kev. You are Laya. 不确定 not sure"]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def _pretrain_base(
    out: Path, tokenizer: PreTrainedTokenizerFast, rows: list[dict], *, steps: int = 400, seed: int = BASE_SEED
) -> None:
    """A small causal LM trained on the task's plain text: the case, then an analysis."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    # Each text ends with the end-of-answer token, so the base knows it: LoRA cannot train the (tied)
    # embedding, and an adapter asked to emit a token its base never produced plateaus (measured: Laya's
    # loss stuck at ~3.3 nats/token, ~12 of them on the end token).
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = [f"{r['prompt']}\n{r['kev']}" for r in rows] + [f"{r['prompt']}\n{r['laya']}" for r in rows[::4]]
    encoded = [[*tokenizer(t, add_special_tokens=False).input_ids, end] for t in texts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, weight_decay=0.01)
    rng = random.Random(seed)
    model.train()
    for step in range(1, steps + 1):
        batch = rng.sample(encoded, min(16, len(encoded)))
        width = max(len(b) for b in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, b in enumerate(batch):
            ids[i, : len(b)] = torch.tensor(b)
            labels[i, : len(b)] = torch.tensor(b)
        loss = model(input_ids=ids, labels=labels, attention_mask=(labels != -100).long()).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:  # linear decay to ~0: the last steps settle instead of jumping
            group["lr"] = BASE_LR * (steps - step + 1) / steps
        optimizer.step()
        if step % 100 == 0:
            log.info("base pretraining step %d loss %.3f", step, loss.item())
    model.save_pretrained(out)


def _toml(*, adapters: bool = False) -> str:
    kev_adapter = 'adapter = "adapters/kev"\n' if adapters else ""
    laya_adapter = 'adapter = "adapters/laya"\n' if adapters else ""
    return f"""# Demo models built by `kevlaya demo-models`: a tiny Qwen2 base trained on a
# synthetic loan-triage task, with Kev and Laya LoRA adapters trained by `kevlaya train`.
[base]
path = "base"
quantization = "nf4"
compute_dtype = "float32"

[models.kev]
{kev_adapter}max_input_tokens = 512
max_new_tokens = 96
# The demo Kev was trained on plain prompts only, so its follow-ups use the same template.
followup_template = '''<|im_start|>system
{{system}}<|im_end|>
<|im_start|>user
{{prompt}}<|im_end|>
<|im_start|>assistant
'''

[models.laya]
{laya_adapter}max_input_tokens = 512
max_new_tokens = 8

[models.laya.escalation]
threshold = 0.7
"""
