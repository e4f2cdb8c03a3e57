"""Parsing a submission: every bad line reported with its number; OpenAI-style lines mapped."""

from __future__ import annotations

import json

import orjson
import pytest

from producer.jsonl import parse_lines
from shared.errors import SubmissionError


def lines(*objs: object) -> list[bytes]:
    return [o if isinstance(o, bytes) else orjson.dumps(o) + b"\n" for o in objs]


def test_all_bad_lines_reported_with_numbers() -> None:
    raw = lines(
        {"custom_id": "1", "model": "laya", "prompt": "ok"},
        b"{not json}\n",
        b"\xff\xfe bad utf8\n",
        b"\n",
        {"custom_id": "1", "model": "laya", "prompt": "dup"},
        {"custom_id": "5", "model": "nope", "prompt": "x"},
    )
    with pytest.raises(SubmissionError) as info:
        parse_lines(raw)
    messages = [str(e) for e in info.value.errors]
    assert messages[0].startswith("line 2: invalid JSON")
    assert messages[1].startswith("line 3: invalid UTF-8")
    assert messages[2].startswith("line 5: duplicate custom_id '1' (first on line 1)")
    assert messages[3].startswith("line 6: unknown model 'nope'")
    assert len(messages) == 4


def test_blank_lines_skipped_and_missing_ids_named_by_line() -> None:
    jobs = parse_lines(lines({"model": "kev", "prompt": "a"}, b"   \n", {"model": "kev", "prompt": "b"}))
    assert [j.custom_id for j in jobs] == ["line-1", "line-3"]


def test_openai_batch_lines_are_mapped() -> None:
    line = {
        "custom_id": "req-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "laya", "messages": [{"role": "user", "content": "Approve?"}], "max_tokens": 16},
    }
    (job,) = parse_lines(lines(line))
    assert (job.custom_id, job.model, job.prompt, job.max_new_tokens) == ("req-1", "laya", "Approve?", 16)


def test_no_escalate_applies_to_every_item() -> None:
    jobs = parse_lines(lines({"custom_id": "a", "model": "laya", "prompt": "p"}), escalate=False)
    assert jobs[0].escalate is False


@pytest.mark.parametrize(
    ("line", "key"),
    [
        (b'{"custom_id": "a", "model": "laya", "prompt": "x", "model": "kev"}', "model"),
        (b'{"custom_id": "a", "model": "laya", "prompt": "x", "\\u006dodel": "kev"}', "model"),
        (b'{"custom_id": "a", "model": "laya", "prompt": "x", "meta": {"a/b": 1, "a\\/b": 2}}', "a/b"),
        (b'{"custom_id": "a", "model": "laya", "prompt": "x", "meta": {"k": [{"z": 1, "z": 1}]}}', "z"),
        (
            b'{"custom_id": "a", "body": {"model": "laya", "messages": [{"role": "user", "content": "x"}],'
            b' "model": "kev"}}',
            "model",
        ),
        (
            b'{"custom_id": "a", "body": {"model": "laya", "messages": [{"role": "user", "content": "x",'
            b' "role": "system"}]}}',
            "role",
        ),
    ],
)
def test_a_key_given_twice_in_one_object_is_refused_not_settled_silently(line: bytes, key: str) -> None:
    with pytest.raises(SubmissionError) as info:
        parse_lines([line])
    (error,) = info.value.errors
    assert str(error) == f"line 1: key {key!r} is given twice in one object"


@pytest.mark.parametrize(
    "obj",
    [
        {"custom_id": "model", "model": "laya", "prompt": "model"},  # a key's name as values: the exact check passes
        {"custom_id": "a", "model": "laya", "prompt": 'say "model" and \u00e9 \\u0041'},
        {"custom_id": "a", "model": "laya", "prompt": "x", "meta": {"model": {"model": 1}, "m": [{"k": 1}, {"k": 2}]}},
    ],
)
def test_repeated_names_in_different_objects_or_values_are_accepted(obj: dict) -> None:
    for raw in (orjson.dumps(obj), json.dumps(obj).encode()):  # literal UTF-8, and \\u escapes
        (job,) = parse_lines([raw])
        assert job.custom_id == obj["custom_id"] and job.prompt == obj["prompt"]


def test_a_byte_order_mark_starting_the_file_is_read_past_and_only_there() -> None:
    job = {"custom_id": "a", "model": "laya", "prompt": "x"}
    (parsed,) = parse_lines([b"\xef\xbb\xbf" + orjson.dumps(job) + b"\r\n"])
    assert parsed.custom_id == "a"
    with pytest.raises(SubmissionError) as info:
        parse_lines(lines(job, b"\xef\xbb\xbf" + orjson.dumps({**job, "custom_id": "b"})))
    (error,) = info.value.errors
    assert str(error).startswith("line 2: invalid JSON")
