"""Decision spans (what the confidence is computed over) and the escalation rule, table-driven."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from worker.config import EscalationRule
from worker.escalation import escalation_reason
from worker.outputs import decision_span

# A fake tokeniser: each "token" is a string; decoding is concatenation.
VOCAB = ["Step", " 1", ":", " check", "\n", "Decision", ":", " approve", "\n", "done", " re", "ject"]


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


@pytest.mark.parametrize(
    ("tokens", "prefix", "decision", "span"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], "Decision:", "approve", (7, 8)),
        ([5, 6, 10, 11], "Decision:", "reject", (2, 4)),
        ([7, 8, 9], "Decision:", "approve", (0, 1)),  # no prefix: the first line
        ([10, 11], None, "reject", (0, 2)),
        ([], "Decision:", None, (0, 0)),
    ],
)
def test_decision_span(tokens: list[int], prefix: str | None, decision: str | None, span: tuple[int, int]) -> None:
    got, start, stop = decision_span(tokens, decode, prefix)
    assert (got, (start, stop)) == (decision, span)


RULE = EscalationRule(threshold=0.7, max_chars=40)


@pytest.mark.parametrize(
    ("text", "confidence", "job", "batch_off", "escalates"),
    [
        ("approve", 0.9, None, False, False),
        ("approve", 0.5, None, False, True),
        ("approve", 0.5, False, False, False),  # switched off per job
        ("approve", 0.5, None, True, False),  # switched off per batch
        ("approve", 0.85, 0.9, False, True),  # the job's own threshold
        ("approve", 0.6, 0.5, False, False),
        ("I am not sure", 0.99, None, False, True),
        ("可能需要更多信息", 0.99, None, False, True),
        ("x" * 41, 0.99, None, False, True),
    ],
)
def test_escalation_rule(text: str, confidence: float, job, batch_off: bool, escalates: bool) -> None:
    reason = escalation_reason(RULE, text=text, confidence=confidence, job_setting=job, batch_off=batch_off)
    assert (reason is not None) == escalates


def test_kev_never_escalates() -> None:
    assert escalation_reason(None, text="not sure", confidence=0.0, job_setting=None, batch_off=False) is None


def test_a_follow_up_keeps_the_items_logprobs_request() -> None:
    """The final answer of an escalated item is Kev's: it carries the logprobs the item asked for."""
    from shared.job import Job
    from shared.result import Result
    from worker.followups import follow_up

    job = Job(custom_id="a", model="laya", prompt="p", logprobs=True, top_logprobs=2)
    entry = follow_up(job, Result(custom_id="a", model="laya", job_id="j1", text="not sure"), "kev")
    assert (entry.job.model, entry.job.logprobs, entry.job.top_logprobs) == ("kev", True, 2)


def _scanned_span(ids: list[int], decode: Any, prefix: str | None) -> tuple[str | None, int, int]:
    """The decision span found by scanning token by token (what `decision_span` bisects): the reference."""
    if not ids:
        return None, 0, 0
    text = decode(ids)
    start = 0
    if prefix and prefix in text:
        k = len(ids) - 1
        while k > 0 and prefix not in decode(ids[k:]):
            k -= 1
        start = k
        while start < len(ids) and prefix not in decode(ids[k : start + 1]):
            start += 1
        start += 1
    while start < len(ids) and not decode(ids[start : start + 1]).strip():
        start += 1
    stop = start
    while stop < len(ids) and "\n" not in decode(ids[start : stop + 1]):
        stop += 1
    return decode(ids[start:stop]).strip() or None, start, stop


def test_bisected_decision_spans_equal_a_token_by_token_scan(tiny_models: Path) -> None:
    """With a real byte-level tokeniser (random tokens split multi-byte characters and leave stray bytes),
    prefixes (ASCII and not) anywhere, several of them, line breaks and blanks: the same span as a scan."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models / "base")
    rng = random.Random(7)
    pieces = [tok(s).input_ids for s in ("Decision: approve\n", "Décision : refuser\n", "\n", "  ", "é", "done")]
    for trial in range(400):
        ids = [rng.randrange(len(tok)) for _ in range(rng.choice((0, 1, 5, 32, 128)))]
        for _ in range(rng.randrange(3)):
            at = rng.randrange(len(ids) + 1)
            ids[at:at] = rng.choice(pieces)
        prefix = rng.choice(("Decision:", "Décision :", None))
        assert decision_span(ids, tok.decode, prefix) == _scanned_span(ids, tok.decode, prefix), (trial, ids)
    # Tokens that hold a line break beside text, and prefixes split across tokens or whole in one.
    vocab = ["Deci", "sion", ":", "Decision:", " ok", "ok\nno", "\n", " ", "x", "y\n"]

    def fake(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    for trial in range(400):
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randrange(12))]
        assert decision_span(ids, fake, "Decision:") == _scanned_span(ids, fake, "Decision:"), (trial, ids)


def test_the_backend_decoder_gives_the_tokenizers_own_text_or_is_not_used(tiny_models: Path) -> None:
    """`text_decoder`: a fast tokenizer's Rust backend, decoding without transformers' per-call walk over the
    ids, gives `tokenizer.decode`'s text for random ids (split multi-byte characters, special tokens, either
    `skip_special_tokens`); a tokenizer that cleans up spaces, has no backend, or whose backend disagrees keeps
    its own `decode`."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from worker.outputs import text_decoder

    tok = AutoTokenizer.from_pretrained(tiny_models / "base")
    decode = text_decoder(tok)
    assert decode is not tok.decode and text_decoder(tok) is decode  # the fast one, made once
    rng = random.Random(3)
    special = tok.all_special_ids
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.choice((0, 1, 7, 40)))] + rng.sample(special, 1)
        rng.shuffle(ids)
        for skip in (False, True):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), ids
    cleaning = AutoTokenizer.from_pretrained(tiny_models / "base", clean_up_tokenization_spaces=True)
    assert text_decoder(cleaning) == cleaning.decode
    slow = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "x")
    assert text_decoder(slow) == slow.decode

    class Disagreeing:
        backend_tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "?")
        all_special_ids = ()

        def __len__(self) -> int:
            return 8

        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(map(str, ids))

    odd = Disagreeing()
    assert text_decoder(odd) == odd.decode


def test_the_backend_encoder_gives_the_tokenizers_own_ids_or_is_not_used(tiny_models: Path) -> None:
    """`user_text_encoder`: a fast tokenizer's Rust backend, without transformers' conversion of every encoding
    into Python dicts, gives the tokenizer's own ids for user text (special-token strings encoded as text, multi-
    byte characters, blanks); a tokenizer without a backend, or whose backend disagrees, keeps its own call, and a
    backend that truncates or pads is handed back to the tokenizer's call, which applies its settings."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from worker.templates import user_text_encoder

    tok = AutoTokenizer.from_pretrained(tiny_models / "base")
    encode = user_text_encoder(tok)
    assert user_text_encoder(tok) is encode  # made once

    def own(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=False, split_special_tokens=True).input_ids

    rng = random.Random(5)
    words = ["loan", "é", "<|im_end|>", "<|endoftext|>", " ", "\n", "approve", "中", "😀", "Decision:"]
    texts = ["".join(rng.choice(words) for _ in range(rng.randrange(40))) for _ in range(300)]
    assert encode(texts) == own(texts)
    assert encode(["<|im_end|>"]) != tok(["<|im_end|>"], add_special_tokens=False).input_ids  # text, not the token
    tok.backend_tokenizer.enable_truncation(max_length=3)
    try:
        assert encode(texts[:20]) == own(texts[:20])  # transformers' call undoes the truncation, as before
    finally:
        tok.backend_tokenizer.no_truncation()

    calls: list[list[str]] = []

    class Slow:
        def __call__(self, texts: list[str], **kw: object) -> SimpleNamespace:
            calls.append(texts)
            return SimpleNamespace(input_ids=[[len(t)] for t in texts])

    assert user_text_encoder(Slow())(["ab", "c"]) == [[2], [1]] and calls == [["ab", "c"]]

    class Disagreeing(Slow):
        all_special_tokens = ()
        backend_tokenizer = SimpleNamespace(
            truncation=None,
            padding=None,
            encode_special_tokens=False,
            encode_batch_fast=lambda texts, add_special_tokens: [SimpleNamespace(ids=[0]) for _ in texts],
        )

    assert user_text_encoder(Disagreeing())(["abc"]) == [[3]]
