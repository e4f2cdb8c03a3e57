"""Rendering a model's prompt template into literal and user segments.

Literal segments are ours and may contain control tokens (`<|im_start|>`); user segments are tokenised
with special-token parsing off, so a user who writes `<|im_end|>` gets those characters, not the token.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.errors import INVALID_JOB, JobFailure
from shared.job import Job
from worker.outputs import per_tokenizer

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Segment:
    text: str
    user: bool


def render(template: str, job: Job, *, system: str, job_may_set_system: bool = False) -> list[Segment]:
    """Fill `{prompt}`, `{system}`, `input` fields and `{laya_*}` (follow-ups); `{{`/`}}` escape braces.

    Only our own system text is a literal segment. Everything that came with the job -- `prompt`, every
    `input` field, an `input.system` (refused unless the model allows it), a parent's answer -- is user text,
    tokenised as text, so no field can open or close a template turn."""
    values, trusted = _values(job, system, job_may_set_system=job_may_set_system)
    segments: list[Segment] = []
    pos = 0
    for match in _PLACEHOLDER.finditer(template):
        _append(segments, template[pos : match.start()], user=False)
        token = match.group(0)
        if token in ("{{", "}}"):
            _append(segments, token[0], user=False)
        else:
            name = match.group(1)
            if name not in values:
                raise JobFailure(INVALID_JOB, f"the template needs field {name!r}, which this job does not give")
            _append(segments, values[name], user=name not in trusted)
        pos = match.end()
    _append(segments, template[pos:], user=False)
    return segments


# Template fields the job cannot give through `input`: they are ours, or the parent's answer.
_RESERVED = frozenset({"laya_answer", "laya_decision", "laya_confidence"})


def _values(job: Job, system: str, *, job_may_set_system: bool) -> tuple[dict[str, str], set[str]]:
    """(field -> text, the fields that are our own literal text)."""
    values, trusted = {"system": system}, {"system"}
    if job.prompt is not None:
        values["prompt"] = job.prompt
    if job.input:
        for name, text in job.input.items():
            if name in _RESERVED:
                raise JobFailure(INVALID_JOB, f"input field {name!r} is reserved for escalation follow-ups")
            if name == "system":
                if not job_may_set_system:
                    raise JobFailure(
                        INVALID_JOB,
                        "input field 'system': this model does not let a job replace its system prompt "
                        "(models config: job_may_set_system = true)",
                    )
                trusted.discard("system")
            values[name] = text
        values.setdefault("prompt", "\n".join(f"{k}: {v}" for k, v in job.input.items()))
    if job.parent is not None:
        values["laya_answer"] = job.parent.text
        values["laya_decision"] = job.parent.decision or ""
        conf = job.parent.confidence
        values["laya_confidence"] = "unknown" if conf is None else f"{conf:.2f}"
    return values, trusted


def _append(segments: list[Segment], text: str, *, user: bool) -> None:
    if not text:
        return
    if segments and segments[-1].user == user:
        segments[-1] = Segment(segments[-1].text + text, user)
    else:
        segments.append(Segment(text, user))


Pieces = list[tuple[list[int], bool]]


def prompt_pieces(tokenizer: Any, spec: Any, job: Job) -> Pieces:
    """The model's prompt for a job as (token ids, is_user_text) pieces -- the one path used for both
    inference and training, so an adapter is trained on exactly the prompts it will serve."""
    (pieces,) = prompt_pieces_many(tokenizer, [(spec, job)])
    if isinstance(pieces, JobFailure):
        raise pieces
    return pieces


def prompt_pieces_many(tokenizer: Any, requests: list[tuple[Any, Job]]) -> list[Pieces | JobFailure]:
    """`prompt_pieces` for many (spec, job) pairs of one tokenizer, index-aligned; a job whose template cannot
    be filled gets its JobFailure in its place. The user texts of all jobs go to the tokenizer in one call:
    a fast tokenizer encodes a list on all cores, and each call costs ~0.1 ms of Python besides."""
    rendered: list[list[Segment] | JobFailure] = []
    for spec, job in requests:
        template = spec.followup_template if (job.parent is not None and spec.followup_template) else spec.template
        try:
            rendered.append(render(template, job, system=spec.system, job_may_set_system=spec.job_may_set_system))
        except JobFailure as failure:
            rendered.append(failure)
    user_texts = [seg.text for segs in rendered if isinstance(segs, list) for seg in segs if seg.user]
    user_ids = iter(_user_ids(tokenizer, user_texts))
    return [
        segs
        if isinstance(segs, JobFailure)
        else [(next(user_ids) if seg.user else _literal_ids(tokenizer, seg.text), seg.user) for seg in segs]
        for segs in rendered
    ]


def _user_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return user_text_encoder(tokenizer)(texts)


UserEncode = Callable[[list[str]], list[list[int]]]
_USER_ENCODERS: weakref.WeakKeyDictionary[Any, UserEncode] = weakref.WeakKeyDictionary()
# Texts a backend encoder is checked on before it replaces the tokenizer's own call: plain words, spaces and
# line breaks, multi-byte characters, and every special token written out (user text: encoded as text).
_PROBE_TEXTS = ("", " ", "Case 7: loan  income\n\ndebt ratio", "naïve café \u4e2d\u6587 \U0001f600", "a\tb\r\nc")


def user_text_encoder(tokenizer: Any) -> UserEncode:
    """`texts -> token ids` of user text (no special tokens added, special-token strings encoded as text), made once
    per tokenizer.

    transformers' fast tokenizers turn every encoding into Python dicts (ids, masks, offsets) after the Rust
    backend made it: ~0.1 ms a text on the CPU, more than the encoding itself (a 256-row take: ~25 ms of the
    worker's time between takes on the H200 machine, the GPU idle). A fast tokenizer's backend gives the same ids
    directly, without offsets. Used only where the backend neither truncates nor pads and gives the tokenizer's own
    ids on a probe of texts; elsewhere the tokenizer's own call."""
    return per_tokenizer(_USER_ENCODERS, tokenizer, lambda t: _backend_encoder(t) or _hf_encoder(t))


def _hf_encoder(tokenizer: Any) -> UserEncode:
    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=False, split_special_tokens=True).input_ids

    return encode


def _backend_encoder(tokenizer: Any) -> UserEncode | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    hf = _hf_encoder(tokenizer)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return None
    hf(["probe"])  # transformers sets the backend's truncation and padding for an unpadded call first

    def encode(texts: list[str]) -> list[list[int]]:
        if backend.truncation is not None or backend.padding is not None:
            return hf(texts)  # someone changed the backend's settings since: its own call applies them
        backend.encode_special_tokens = True  # what transformers' call sets for split_special_tokens=True
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]

    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if isinstance(t, str)]
    probes = [*_PROBE_TEXTS, " ".join(specials), "x".join(specials) + " tail"]
    return encode if encode(probes) == hf(probes) else None


# Literal segments (template text and our system prompt) repeat in every job of a model: tokenised once per
# tokenizer. Each tokenizer call costs ~0.1 ms of Python, and a job has 2-4 literal segments: they were
# about half of the engine's encode time.
_LITERALS: weakref.WeakKeyDictionary[Any, dict[str, list[int]]] = weakref.WeakKeyDictionary()
_MAX_LITERALS = 1024  # per tokenizer; a template has a handful, so this only bounds a pathological config


def _literal_ids(tokenizer: Any, text: str) -> list[int]:
    cache = _LITERALS.setdefault(tokenizer, {})
    ids = cache.get(text)
    if ids is None:
        ids = tokenizer(text, add_special_tokens=False, split_special_tokens=False).input_ids
        if len(cache) < _MAX_LITERALS:
            cache[text] = ids
    return list(ids)  # a copy: callers may cut pieces when truncating
