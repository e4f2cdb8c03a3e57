"""Tiny models of the real architecture, built locally (nothing can be downloaded): a byte-level BPE
tokenizer with Qwen's control tokens, a small Qwen2 base with random weights, and Kev/Laya LoRA adapters.

Used by the tests and, until trained ones replace them, the demo. Built in seconds on a CPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The seed's adapter shapes: Kev rank 16 / alpha 32, Laya rank 8 / alpha 16.
ADAPTER_SHAPES = {"kev": (16, 32), "laya": (8, 16)}

_CORPUS = [
    "Decision: approve",
    "Decision: reject",
    "Decision: review",
    "approve reject review escalate",
    "The applicant earns 52000 a year and asks for a loan of 12000.",
    "Income is stable, debt ratio is low, history is clean.",
    "Step 1: check income. Step 2: check debt. Step 3: decide.",
    "not sure, need more information",
    "不确定，可能需要更多信息",
    "You are Kev. Analyse the case step by step.",
    "You are Laya. Answer with the decision only.",
    "system user assistant",
    "0123456789 .,:;!?()-+%/\n",
]


@dataclass(frozen=True, kw_only=True)
class TinyShape:
    """Model shape. `vocab` sizes the tokenizer; `model_vocab` (if set) the embedding, e.g. Qwen's 151936
    for benchmarks of the real shape (ids past the tokenizer decode to nothing)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 512
    model_vocab: int | None = None


# Qwen2.5-1.5B's shape: 28 layers, 12 query heads and 2 KV heads of 128, MLP 8960, vocabulary 151936.
QWEN25_1_5B = TinyShape(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=512, model_vocab=151936)
SHAPES = {"tiny": TinyShape(), "qwen2.5-1.5b": QWEN25_1_5B}


def build_tokenizer(out: Path, *, vocab: int = 512, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any UTF-8 text round-trips) with Qwen's chat control tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((corpus or []) + _CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        padding_side="left",
    )
    fast.save_pretrained(out)
    return fast


def build_base(
    out: Path,
    *,
    shape: TinyShape = TinyShape(),
    seed: int = 0,
    corpus: list[str] | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Qwen2ForCausalLM:
    """Tokenizer + a randomly initialised Qwen2 causal LM, saved as a local checkpoint folder."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab=shape.vocab, corpus=corpus)
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=shape.model_vocab or len(tokenizer),
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype=dtype,
    )
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    return model


def build_adapter(base: Qwen2ForCausalLM, out: Path, *, name: str, seed: int, scale: float = 0.5) -> Path:
    """A LoRA adapter with random (non-zero) B on all 7 projections, so it visibly changes the outputs.
    The base is left as it was (the LoRA layers are unloaded again after saving)."""
    rank, alpha = ADAPTER_SHAPES.get(name, (8, 16))
    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGET_MODULES, lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "lora_B" in pname:
                param.normal_(0.0, scale)
    model.save_pretrained(out)
    model.unload()
    return out


def build_model_set(
    root: Path,
    *,
    shape: TinyShape = TinyShape(),
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    adapter_scale: float = 0.5,
) -> None:
    """Base + Kev and Laya adapters under `root` (base/, adapter-kev/, adapter-laya/)."""
    base = build_base(root / "base", shape=shape, seed=seed, device=device, dtype=dtype)
    for i, name in enumerate(("kev", "laya")):
        build_adapter(base, root / f"adapter-{name}", name=name, seed=seed + 1 + i, scale=adapter_scale)


def build_tiny_set(root: Path, *, quantization: str = "nf4", seed: int = 0, extra_toml: str = "") -> Path:
    """Base + both adapters + a models.toml under `root`; returns the TOML path. Cached by a marker."""
    toml = root / "models.toml"
    marker = root / ".built.json"
    want = {"seed": seed, "shape": TinyShape().__dict__, "v": 2}
    if not (marker.is_file() and json.loads(marker.read_text()) == want):
        build_model_set(root, seed=seed)
        marker.write_text(json.dumps(want))
    toml.write_text(tiny_toml(quantization=quantization) + extra_toml)
    return toml


def tiny_toml(*, quantization: str = "nf4", kev_new: int = 48, laya_new: int = 12) -> str:
    return f"""# Tiny random-weight models for tests and the demo (built by worker.tools.tinymodel).
[base]
path = "base"
quantization = "{quantization}"
compute_dtype = "float32"

[models.kev]
adapter = "adapter-kev"
max_input_tokens = 512
max_new_tokens = {kev_new}

[models.laya]
adapter = "adapter-laya"
max_input_tokens = 512
max_new_tokens = {laya_new}
"""
