"""What the engine answers for one row: a plain value, index-aligned with the jobs it was given; and how a row's
generated tokens become one (where it stopped, its text, the decision span and the confidence).

Confidence of a generated answer (documented in the README): the probability the model gave the *decision span*
it emitted -- the tokens after the model's `decision_prefix` ("Decision:") up to the end of that line, or the
first line when there is no prefix -- i.e. exp(sum of those tokens' log-probabilities) under the distribution it
decoded from.
"""

from __future__ import annotations

import bisect
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from shared.errors import NON_FINITE_LOGITS, TIMEOUT
from shared.result import ErrorInfo, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    import torch

    from worker.fastpath.logprobs import RowLogprobs
    from worker.rows import Item


@dataclass(frozen=True, kw_only=True)
class RowOutput:
    text: str | None = None
    decision: str | None = None
    confidence: float | None = None
    raw_confidence: float | None = None  # the model's own, when `confidence` was calibrated (worker/calibration.py)
    choices: dict[str, float] | None = None
    logprobs: list[TokenLogprob] | None = None  # per generated token, for a job that asked (`logprobs`)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    truncated: bool = False  # generation ended at its new-token limit, not at a stop token
    error: ErrorInfo | None = None

    @classmethod
    def failed(cls, error_type: str, message: str, prompt_tokens: int = 0) -> RowOutput:
        return cls(error=ErrorInfo(type=error_type, message=message), prompt_tokens=prompt_tokens)


def as_label(out: RowOutput, labels: tuple[str, ...]) -> RowOutput:
    """A generated answer to a choice job (an escalated one's follow-up) with its decision read as one of the
    job's labels: the label it names, compared case-insensitively. A decision naming none stays as written."""
    if out.decision is None:
        return out
    wanted = out.decision.strip().strip(".").casefold()
    label = next((label for label in labels if label.casefold() == wanted), None)
    return out if label is None else replace(out, decision=label)


def generated_output(
    item: Item,
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    *,
    bad: bool,
    stops: set[int],
    cut_short: bool,
    decode: Callable[..., str],
    decision_prefix: str | None,
    reported: RowLogprobs | None = None,
    top_logprobs: int = 0,
    token_bytes: Callable[[int], bytes] | None = None,
) -> RowOutput:
    """One row's answer from its generated `tokens` (past its end: padding) and each token's log-probability;
    with `reported` (a job that asked for logprobs), each answer token's entry with `top_logprobs` alternatives."""
    if bad:
        return RowOutput.failed(NON_FINITE_LOGITS, "the model produced NaN/inf logits for this row", len(item.ids))
    all_ids = tokens.tolist()
    stop_at = next((i for i, t in enumerate(all_ids) if t in stops), None)
    stopped = stop_at is not None and stop_at < item.max_new
    if cut_short and not stopped and len(all_ids) < item.max_new:
        # Neither its stop token nor its own limit: the batch's deadline ended this row.
        return RowOutput.failed(TIMEOUT, "generation hit the batch's time limit", len(item.ids))
    end = min(len(all_ids) if stop_at is None else stop_at, item.max_new)
    used = end + 1 if stopped else end  # the stop token is generated too, so it counts
    ids, lps = all_ids[:end], logprobs[:end]
    text = decode(ids, skip_special_tokens=True)
    decision, start, stop = decision_span(ids, decode, decision_prefix)
    # No decision span (an answer cut off at its limit right after the prefix, or only whitespace): no confidence,
    # as for an empty answer -- not the probability of some other token, which let a decision-less answer pass
    # as sure. Escalation counts None as the least sure answer, and so does `kevlaya eval`.
    confidence = float(lps[start:stop].double().sum().exp()) if decision is not None else None
    entries = None
    if reported is not None and token_bytes is not None:
        entries = token_logprobs(reported, ids, top=top_logprobs, token_bytes=token_bytes)
    return RowOutput(
        text=text,
        decision=decision,
        confidence=confidence,
        logprobs=entries,
        prompt_tokens=len(item.ids),
        completion_tokens=used,
        truncated=not stopped and end >= item.max_new,
    )


def decision_span(
    ids: list[int], decode: Callable[[list[int]], str], prefix: str | None
) -> tuple[str | None, int, int]:
    """(decision text, first token, end token) of the decision: the line after the last `prefix`, else the
    first line. Token bounds are found by decoding spans, so multi-byte characters stay whole.

    Each bound is the first span length at which the decoded span holds the prefix (or a line break): once a
    span holds it, every longer span does (decoding more tokens only appends text), so each is found by
    bisection -- O(log n) decodes where a scan took O(n), ~0.4 ms a row on 32-128-token answers."""
    if not ids:
        return None, 0, 0
    n = len(ids)
    start = 0
    if prefix and prefix in decode(ids):
        # The last token whose suffix still holds the prefix (a scan from the end stopped at the first such).
        k = _first(1, n, lambda i: prefix not in decode(ids[i:])) - 1
        start = _first(k, n, lambda i: prefix in decode(ids[k : i + 1])) + 1
    while start < n and not decode(ids[start : start + 1]).strip():
        start += 1  # whitespace between the prefix and the label is not part of the decision
    # The token holding the line break (or n): the span is [start, stop).
    stop = _first(start, n, lambda i: "\n" in decode(ids[start : i + 1]))
    decision = decode(ids[start:stop]).strip() or None
    return decision, start, stop


def _first(lo: int, hi: int, holds: Callable[[int], bool]) -> int:
    """The least i in [lo, hi) with `holds(i)`, for a `holds` false up to some i and true from there; hi when it
    never holds."""
    return bisect.bisect_left(range(lo, hi), True, key=holds) + lo


# ---- per-token logprobs (OpenAI's `logprobs.content`) ----------------------------------------------
def token_logprobs(
    reported: RowLogprobs, ids: list[int], *, top: int, token_bytes: Callable[[int], bytes]
) -> list[TokenLogprob]:
    """An entry per answer token (`ids`: the tokens before the stop), with its `top` most likely alternatives."""
    n = len(ids)
    chosen = reported.chosen[:n].tolist()
    top_ids = reported.top_ids[:n, :top].tolist()
    top_values = reported.top_logprobs[:n, :top].tolist()
    return [
        TokenLogprob(
            **_token(token_bytes(token)),
            logprob=logprob,
            top_logprobs=[
                TopLogprob(**_token(token_bytes(i)), logprob=v) for i, v in zip(alt_ids, alt_values, strict=True)
            ],
        )
        for token, logprob, alt_ids, alt_values in zip(ids, chosen, top_ids, top_values, strict=True)
    ]


def _token(raw: bytes) -> dict[str, Any]:
    # A token may hold part of a UTF-8 character: its text shows those bytes as \xNN escapes, `bytes` has them all.
    return {"token": raw.decode("utf-8", "backslashreplace"), "bytes": list(raw)}


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) printable stand-in character for each byte, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TokenBytes:
    """Each token id's bytes for one tokenizer: byte-level BPE pieces (Qwen, Llama 3, GPT-2) through the byte
    alphabet, so a token holding part of a character keeps its exact bytes; SentencePiece byte tokens as their
    byte; added tokens as their text; an id the tokenizer does not have as no bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.added = {i: t.content for i, t in added.items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        raw = self._cache.get(token_id)
        if raw is None:
            raw = self._bytes(token_id)
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = raw
        return raw

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""  # past the tokenizer's vocabulary (a model's padded embedding rows)
        if self.byte_level and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if "\u2581" in piece:  # SentencePiece's word-start mark is a space
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id]).encode("utf-8")


_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, TokenBytes] = weakref.WeakKeyDictionary()
T = TypeVar("T")


def per_tokenizer(cache: weakref.WeakKeyDictionary[Any, T], tokenizer: Any, make: Callable[[Any], T]) -> T:
    """`make(tokenizer)`, made once per tokenizer (kept while it lives); made each time for an object that takes
    no weak reference."""
    try:
        found = cache.get(tokenizer)
    except TypeError:
        return make(tokenizer)
    if found is None:
        found = cache[tokenizer] = make(tokenizer)
    return found


def token_bytes(tokenizer: Any) -> TokenBytes:
    """The tokenizer's TokenBytes, made once."""
    return per_tokenizer(_TOKEN_BYTES, tokenizer, TokenBytes)


Decode = Callable[..., str]
_DECODERS: weakref.WeakKeyDictionary[Any, Decode] = weakref.WeakKeyDictionary()
# Ids a decoder is checked on before it replaces the tokenizer's own: the first ids of the vocabulary, the
# special ones, and runs of them (multi-byte characters split across tokens decode only in a run).
_PROBE_IDS = 512


def text_decoder(tokenizer: Any) -> Decode:
    """`decode(ids, skip_special_tokens=False)` giving the tokenizer's own text, made once per tokenizer.

    transformers' `decode` walks the ids to convert them to Python objects on every call (a decision span
    decodes ~10 spans a row: on the CPU that walk was ~60% of the outputs' time, 0.8 s of 2,476 rows); a fast
    tokenizer's Rust backend decodes the same list directly. Used only where it is the whole of the tokenizer's
    decoding -- a fast tokenizer that cleans up no spaces -- and where it gives the tokenizer's own text on a
    probe of its vocabulary; elsewhere the tokenizer's `decode`."""
    return per_tokenizer(_DECODERS, tokenizer, lambda t: _backend_decoder(t) or t.decode)


def _backend_decoder(tokenizer: Any) -> Decode | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None

    def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)

    vocab = min(len(tokenizer), _PROBE_IDS)
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if isinstance(i, int)]
    probes = [[i] for i in range(vocab)] + [list(range(s, min(s + 16, vocab))) for s in range(0, vocab, 16)]
    probes.append(special + list(range(min(vocab, 32))) + special)
    for ids in probes:
        for skip in (False, True):
            if decode(ids, skip_special_tokens=skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                return None
    return decode
