"""Hostile and unusual producer input: each case a review found misbehaving, reproduced against the code
before its fix (a traceback, a half-written batch, a value silently dropped or changed)."""

from __future__ import annotations

import math
import subprocess
import sys

import orjson
import pytest
from redis import Redis

from producer.client import Client
from producer.jsonl import parse_lines
from producer.schedule import ScheduleSpec
from shared.errors import EXIT_USAGE, BatchNotFoundError, SubmissionError, ValidationError
from shared.job import Job
from shared.keys import BATCH_ID_RE, JOB_ID_RE

OK_LINE = b'{"custom_id": "a", "model": "laya", "prompt": "p"}\n'


def kevlaya(redis_url: str, *args: str | bytes, input: bytes = OK_LINE) -> subprocess.CompletedProcess[bytes]:
    """The real entry point (`producer.cli:main`), as a user runs it: its stderr shows any traceback."""
    argv = [sys.executable.encode(), b"-c", b"from producer.cli import main; main()", b"--redis-url"]
    argv += [redis_url.encode(), *(a if isinstance(a, bytes) else a.encode() for a in args)]
    return subprocess.run(argv, input=input, capture_output=True, timeout=60)


def assert_one_line_error(proc: subprocess.CompletedProcess[bytes], fragment: str) -> None:
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1, err
    assert "Traceback" not in err, err
    assert fragment in err, err
    assert proc.stdout == b""


# ---- --batch-id with a trailing newline ---------------------------------------------------------
def test_batch_id_with_a_trailing_newline_is_refused_before_any_write(redis_url: str, redis: Redis) -> None:
    proc = kevlaya(redis_url, "submit", "-", "--batch-id", "ab\n")
    assert_one_line_error(proc, "batch id 'ab\\n' is not")
    assert redis.dbsize() == 0


def test_id_patterns_do_not_admit_a_trailing_newline(client: Client, redis: Redis) -> None:
    assert not BATCH_ID_RE.match("ab\n")
    assert not JOB_ID_RE.match("ab-0123\n")
    with pytest.raises(ValidationError, match="schedule name"):
        ScheduleSpec(name="nightly\n", every_s=60, inputs=("in.jsonl",), output="out.jsonl")
    with pytest.raises(ValidationError, match="batch id"):
        client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p"}], batch_id="ab\n")
    assert redis.dbsize() == 0


# ---- strings Redis and JSON cannot carry (lone surrogates) through the Python client ------------------
@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"prompt": "\ud800"}, "prompt"),
        ({"custom_id": "a\udc80"}, "custom_id"),
        ({"choices": ["\ud800", "no"]}, "choices"),
        ({"prompt": None, "input": {"name": "\ud800"}}, "input"),
        ({"prompt": None, "input": {"\ud800": "x"}}, "input"),
    ],
)
def test_lone_surrogates_are_refused_by_validation_before_any_write(
    client: Client, redis: Redis, patch: dict, field: str
) -> None:
    obj = {k: v for k, v in {"custom_id": "a", "model": "laya", "prompt": "p", **patch}.items() if v is not None}
    with pytest.raises(SubmissionError) as info:
        client.submit_batch([obj])
    (err,) = info.value.errors
    assert (err.line, err.field) == (1, field)
    assert "UTF-8" in str(err)
    assert redis.dbsize() == 0  # no batch left behind in `validating`


def test_non_finite_floats_in_meta_are_refused_not_echoed_as_null() -> None:
    with pytest.raises(ValidationError, match="meta") as info:
        Job.from_dict({"custom_id": "a", "model": "laya", "prompt": "p", "meta": {"score": math.nan}})
    assert info.value.field == "meta"


# ---- Job instances are validated like dicts ----------------------------------------------------------
@pytest.mark.parametrize(
    ("job", "field"),
    [
        (Job(custom_id="a", model="gpt-4", prompt="p"), "model"),
        (Job(custom_id="a", model="laya", prompt="p", lane="fast"), "lane"),
        (Job(custom_id="", model="laya", prompt="p"), "custom_id"),
        (Job(custom_id="a", model="laya"), "prompt"),
        (Job(custom_id="a", model="laya", prompt="p", max_new_tokens=-5), "max_new_tokens"),
        (Job(custom_id="a", model="laya", prompt="\ud800"), "prompt"),
    ],
)
def test_job_instances_are_validated_before_any_write(client: Client, redis: Redis, job: Job, field: str) -> None:
    with pytest.raises(SubmissionError) as info:
        client.submit_batch([job])
    (err,) = info.value.errors
    assert (err.line, err.field) == (1, field)
    assert redis.dbsize() == 0


def test_a_valid_job_instance_still_goes_through(client: Client) -> None:
    job = Job.from_dict({"custom_id": "a", "model": "laya", "prompt": "p", "escalate": False, "meta": {"k": 1}})
    handle = client.submit_batch([job])
    assert (handle.enqueued, handle.skipped) == (1, 0)


# ---- --expires-in / completion_window_s -----------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_a_completion_window_that_is_not_a_positive_number_is_refused(
    client: Client, redis_url: str, redis: Redis, value: str
) -> None:
    proc = kevlaya(redis_url, "submit", "-", "--expires-in", value)
    err = proc.stderr.decode()
    assert proc.returncode == EXIT_USAGE and "Traceback" not in err, err  # a usage error, naming the option
    assert "--expires-in" in err and "positive number of seconds" in err, err
    with pytest.raises(ValidationError, match="completion window"):  # the Python client refuses it too
        client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "p"}], completion_window_s=float(value))
    assert redis.dbsize() == 0


@pytest.mark.parametrize("command", [("submit", "-", "--wait"), ("status", "b", "--wait")])
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_wait_timeout_that_is_not_a_number_of_seconds_is_refused(
    redis_url: str, command: tuple[str, ...], value: str
) -> None:
    """`--timeout nan` waited forever (no comparison with NaN is true)."""
    proc = kevlaya(redis_url, *command, "--timeout", value)
    err = proc.stderr.decode()
    assert proc.returncode == EXIT_USAGE and "Traceback" not in err, err
    assert "--timeout" in err and "non-negative number of seconds" in err, err


# ---- OpenAI lines: max_tokens and max_completion_tokens ---------------------------------------------
def _openai(body: dict) -> bytes:
    msgs = [{"role": "user", "content": "hi"}]
    line = {
        "custom_id": "r",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "laya", "messages": msgs},
    }
    line["body"].update(body)
    return orjson.dumps(line) + b"\n"


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 8, "max_completion_tokens": None},
        {"max_completion_tokens": None, "max_tokens": 8},
        {"max_completion_tokens": 8, "max_tokens": None},
        {"max_tokens": 8, "max_completion_tokens": 8},
    ],
)
def test_a_null_token_limit_does_not_drop_the_other_one(body: dict) -> None:
    (job,) = parse_lines([_openai(body)])
    assert job.max_new_tokens == 8


@pytest.mark.parametrize(
    "body", [{"max_tokens": 8, "max_completion_tokens": 16}, {"max_completion_tokens": 16, "max_tokens": 8}]
)
def test_conflicting_token_limits_are_refused_not_resolved_by_key_order(body: dict) -> None:
    with pytest.raises(SubmissionError) as info:
        parse_lines([_openai(body)])
    (err,) = info.value.errors
    assert err.line == 1 and "max_completion_tokens" in str(err) and "max_tokens" in str(err)


def test_an_openai_line_without_body_says_so(redis_url: str, redis: Redis) -> None:
    line = b'{"custom_id": "r", "method": "POST", "url": "/v1/chat/completions"}\n'
    proc = kevlaya(redis_url, "submit", "-", input=line)
    assert_one_line_error(proc, "line 1: an OpenAI Batch line needs a 'body'")
    assert redis.dbsize() == 0


# ---- read commands given a batch argument that is not UTF-8 ---------------------------------------
@pytest.mark.parametrize("command", ["status", "results", "cancel", "retry-failed"])
def test_a_batch_argument_that_is_not_utf8_is_an_unknown_batch(redis_url: str, redis: Redis, command: str) -> None:
    proc = kevlaya(redis_url, command, b"b\xff")
    assert_one_line_error(proc, "no batch")


def test_client_reads_of_an_impossible_batch_id_raise_batch_not_found(client: Client) -> None:
    with pytest.raises(BatchNotFoundError):
        client.status("b\udcff")
    with pytest.raises(BatchNotFoundError):
        list(client.iter_results("b\udcff"))


def test_a_job_validation_made_is_not_checked_again_but_a_replaced_one_is(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI hands `submit_batch` the Jobs its parser validated: taken as they are (a second check cost ~19 us a
    job); a Job changed with `dataclasses.replace` is checked again."""
    from dataclasses import replace

    (job,) = parse_lines([OK_LINE])
    assert job.validated_under(client.limits)
    assert not replace(job, escalate=False).validated_under(client.limits)
    checked: list[str] = []
    original = Job.from_dict.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(
        Job,
        "from_dict",
        classmethod(lambda cls, obj, **kw: checked.append(obj["custom_id"]) or original(cls, obj, **kw)),
    )
    client.submit_batch([job, replace(job, custom_id="b")])
    assert checked == ["b"]
