"""OpenAI Batch lines both ways: input lines (`{"custom_id", "method", "url", "body"}`) become kevlaya jobs,
and results become OpenAI batch output and error lines.

Every body field is honoured or refused with a message naming it (the caller adds the line number); a
`model` name maps to kev/laya through a model map (`--model-map gpt-4o-mini=laya`). A chat line's `logprobs` /
`top_logprobs` come back as the output's `choices[0].logprobs.content` (per generated token, OpenAI's shape).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from shared import models as known_models
from shared.errors import ValidationError, shown
from shared.keys import job_id as item_job_id

ENVELOPE = frozenset({"custom_id", "method", "url", "body"})
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

# Body fields taken as they are, or mapped; anything else is refused.
_DIRECT = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "metadata": "meta"}
_LIMITS = ("max_completion_tokens", "max_tokens")
# Chat lines: per-token logprobs (returned as `choices[0].logprobs.content`); validated as job fields.
_CHAT_LOGPROBS = ("logprobs", "top_logprobs")
# Fields whose neutral value changes nothing, so accepting it is honest; any other value is refused.
# null is OpenAI's "unset": the default, which these are.
_NEUTRAL = {
    "n": (1, None),
    "stream": (False, None),
    "logprobs": (False, None),
    "stop": (None, [], ""),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
}
# kevlaya's own job fields may ride along in the body (choices, escalate, truncate).
_KEVLAYA = ("choices", "escalate", "truncate")


def is_openai_line(obj: Any) -> bool:
    return isinstance(obj, dict) and "body" in obj and set(obj) <= ENVELOPE


def parse_model_map(text: str | None) -> dict[str, str]:
    """`gpt-4o-mini=laya,gpt-4o=kev` -> {"gpt-4o-mini": "laya", "gpt-4o": "kev"}. Refused here, once and before any
    line is read: an entry not NAME=MODEL, a MODEL kevlaya does not have (it was refused on every line using it, and
    not at all when none did), and a NAME mapped to two models (the last one silently won)."""
    out: dict[str, str] = {}
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        name, sep, model = (part.strip() for part in pair.partition("="))
        if not sep or not name or not model:
            raise ValidationError(f"model map entry {shown(pair)} is not NAME=MODEL", field="model")
        if model not in known_models.MODEL_NAMES:
            allowed = ", ".join(known_models.MODEL_NAMES)
            raise ValidationError(
                f"model map entry {shown(pair)}: unknown model {shown(model)}; allowed: {allowed}", field="model"
            )
        if out.setdefault(name, model) != model:
            twice = f"model map: {shown(name)} is mapped twice, to {out[name]} and {model}"
            raise ValidationError(twice, field="model")
    return out


def from_openai(line: dict[str, Any], *, model_map: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A kevlaya job dict from an OpenAI Batch line; ValidationError naming the field for anything it
    cannot honour."""
    method, url = line.get("method", "POST"), line.get("url", CHAT_URL)
    if method != "POST":
        raise ValidationError(f"'method' must be POST, got {shown(method)}", field="method")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValidationError(f"'url' must be {CHAT_URL} or {COMPLETIONS_URL}, got {shown(url)}", field="url")
    body = line.get("body")
    if not isinstance(body, dict):
        raise ValidationError("'body' must be an object", field="body")
    job: dict[str, Any] = {"custom_id": line.get("custom_id")}
    if "model" in body:
        name = body["model"]
        job["model"] = (model_map or {}).get(name, name) if isinstance(name, str) else name
    if url == CHAT_URL:
        job |= _from_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ValidationError("'body.prompt' must be a string (one prompt per line)", field="body.prompt")
        job["prompt"] = prompt
    for key, value in body.items():
        if key in ("model", "messages", "prompt"):
            continue
        if key in _LIMITS:
            if value is None:
                continue  # unset, as OpenAI reads it: the other limit (or the model's) applies
            if "max_new_tokens" in job and job["max_new_tokens"] != value:
                given = ", ".join(f"'body.{k}' = {shown(body[k])}" for k in _LIMITS)
                raise ValidationError(f"{given}: give one token limit, or the same", field=f"body.{key}")
            job["max_new_tokens"] = value
        elif key in _DIRECT:
            if value is not None:  # unset, as OpenAI reads it: kevlaya's default, as when the field is left out
                job[_DIRECT[key]] = value
        elif key in _KEVLAYA:
            job[key] = value
        elif key in _CHAT_LOGPROBS and url == CHAT_URL:
            if value is not None:
                job[key] = value
        elif _neutral(key, value):
            continue
        else:
            raise ValidationError(
                f"'body.{key}' = {shown(value)} is not supported by kevlaya (refused rather than ignored)",
                field=f"body.{key}",
            )
    return job


def _neutral(key: str, value: Any) -> bool:
    """Whether `value` is the field's neutral value, type included: by `==` alone, `"n": true` and `"stream": 0`
    passed, and a completions line's `"logprobs": 0` (an integer there: the sampled tokens' log-probabilities,
    asked for) was dropped as if it were `false`."""
    if key == "response_format":
        return value in ({"type": "text"}, None)
    return any(type(value) is type(neutral) and value == neutral for neutral in _NEUTRAL.get(key, ()))


def _from_messages(messages: Any) -> dict[str, Any]:
    """System (or developer) messages become the system turn; user messages the prompt. A conversation with
    assistant turns is refused: each line is one decision."""
    if not isinstance(messages, list) or not messages:
        raise ValidationError("'body.messages' must be a non-empty list", field="body.messages")
    system: list[str] = []
    user: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValidationError(f"'body.messages[{i}]' must be an object", field="body.messages")
        role = msg.get("role")
        text = _content(msg.get("content"), i)
        if role in ("system", "developer"):
            system.append(text)
        elif role == "user":
            user.append(text)
        else:
            raise ValidationError(
                f"'body.messages[{i}].role' = {shown(role)}: only system, developer and user messages are supported",
                field="body.messages",
            )
    if not user:
        raise ValidationError("'body.messages' has no user message", field="body.messages")
    prompt = "\n\n".join(user)
    if not system:
        return {"prompt": prompt}
    # The system message is the model's system turn: the model's config must allow it (job_may_set_system).
    return {"input": {"system": "\n\n".join(system), "prompt": prompt}}


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or an array of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValidationError(
                    f"'body.messages[{i}].content' has a {shown(kind)} part; only text parts are supported",
                    field="body.messages",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ValidationError(f"'body.messages[{i}].content' must be a string or text parts", field="body.messages")


# ---- output ------------------------------------------------------------------------------------
def to_openai(row: dict[str, Any], *, url: str = CHAT_URL, batch: str | None = None) -> tuple[dict[str, Any], bool]:
    """(an OpenAI batch output line for one exported row, whether it is an error line). A pending row has no
    job id yet: its item's own (`batch` given) keeps its line's id unique and the one it will have when answered."""
    job_id = row.get("job_id") or (item_job_id(batch, row["custom_id"]) if batch else row["custom_id"])
    base = {"id": f"batch_req_{job_id}", "custom_id": row["custom_id"]}
    error = row.get("error")
    if row.get("pending"):
        return base | {"response": None, "error": {"code": "pending", "message": "not answered yet"}}, True
    if error:
        return base | {"response": None, "error": {"code": error["type"], "message": error["message"]}}, True
    # An escalated item cost every step's tokens (Laya's, then Kev's), and this format shows no `chain`: its usage
    # is their sum, so a batch's token total counts the steps that escalated too.
    steps = [row, *(step for step in row.get("chain") or () if isinstance(step, dict))]
    usages = [step.get("usage") or {} for step in steps]
    prompt_tokens = sum(u.get("prompt_tokens", 0) for u in usages)
    completion_tokens = sum(u.get("completion_tokens", 0) for u in usages)
    text = row.get("text")
    if text is None and row.get("decision") is not None:
        text = row["decision"]  # a choices job: the chosen label
    created = int(time.time())
    finish = "length" if row.get("truncated") else "stop"
    logprobs = row.get("logprobs")
    if url == COMPLETIONS_URL:
        body: dict[str, Any] = {
            "id": f"cmpl-{job_id}",
            "object": "text_completion",
            "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}],
        }
    else:
        body = {
            "id": f"chatcmpl-{job_id}",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text or ""},
                    "finish_reason": finish,
                    "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                }
            ],
        }
    body |= {
        "created": created,
        "model": row.get("model", ""),
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "system_fingerprint": "-".join(str(v) for v in (row.get("model_version") or {}).values()) or None,
    }
    response = {"status_code": 200, "request_id": job_id, "body": body}
    return base | {"response": response, "error": None}, False
