"""Hostile and unusual submission input, found by a review of the producer side: each case misbehaved on the code
before its fix (a traceback, a value silently changed, a limit bypassed, memory without bound)."""

from __future__ import annotations

import errno
import io
import subprocess
import sys
from collections.abc import Iterator

import orjson
import pytest
from click.testing import CliRunner
from redis import Redis

from producer import cli as cli_module
from producer.client import Client
from producer.jsonl import parse_lines, read_lines
from producer.openai_format import parse_model_map
from shared.errors import SubmissionError, ValidationError
from shared.job import Job, Limits, Parent

BASE = {"custom_id": "a", "model": "laya", "prompt": "p"}
OK_LINE = orjson.dumps(BASE) + b"\n"
CHAT = {"model": "laya", "messages": [{"role": "user", "content": "hi"}]}


def kevlaya(redis_url: str, *args: str, input: bytes | None = OK_LINE, shell_tail: str = "") -> tuple[int, str, str]:
    """The real entry point, as a user runs it (through sh, so a test can close stdin: `<&-`)."""
    argv = " ".join(["exec", sys.executable, "-c", "'from producer.cli import main; main()'", "--redis-url", redis_url])
    quoted = " ".join(f"'{a}'" for a in args)
    proc = subprocess.run(["sh", "-c", f"{argv} {quoted} {shell_tail}"], input=input, capture_output=True, timeout=120)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode("utf-8", "replace")


def refused(lines: list[bytes], **kw: object) -> list[str]:
    with pytest.raises(SubmissionError) as info:
        parse_lines(lines, **kw)  # type: ignore[arg-type]
    return [str(e) for e in info.value.errors]


# ---- integers past 64 bits: orjson reads them as floats ------------------------------------------
def test_an_integer_past_64_bits_in_meta_is_refused_not_rounded() -> None:
    # orjson reads 123456789012345678901234567890 as 1.2345678901234568e+29: meta, echoed back "opaque", came back
    # as another number, while the same value from Python is refused ("Integer exceeds 64-bit range").
    line = b'{"custom_id": "a", "model": "laya", "prompt": "p", "meta": {"id": 123456789012345678901234567890}}'
    (error,) = refused([line])
    assert error.startswith("line 1: 'meta.id' is an integer of 30 digits")


@pytest.mark.parametrize("field", ["max_new_tokens", "seed", "top_k", "temperature", "escalate"])
def test_an_integer_past_64_bits_is_named_as_written_not_as_a_float(field: str) -> None:
    line = b'{"custom_id": "a", "model": "laya", "prompt": "p", "%s": 99999999999999999999999999}' % field.encode()
    (error,) = refused([line])
    assert f"'{field}' is an integer of 26 digits" in error and "e+" not in error


def test_integers_within_64_bits_and_long_digit_runs_in_strings_pass() -> None:
    meta = {"u64": 2**64 - 1, "i64": -(2**63), "s": "1" * 40}
    line = orjson.dumps({**BASE, "prompt": "9" * 30, "meta": meta, "seed": 2**63 - 1})
    (job,) = parse_lines([line])
    assert job.meta == meta and job.seed == 2**63 - 1


def test_an_integer_past_64_bits_inside_an_openai_body_names_the_body_field() -> None:
    line = orjson.dumps({"custom_id": "a", "body": {**CHAT, "metadata": {"n": 1}}}).replace(b"1}", b"1" * 25 + b"}")
    (error,) = refused([line])
    assert "'body.metadata.n' is an integer of 25 digits" in error


# ---- booleans where numbers are expected --------------------------------------------------------
@pytest.mark.parametrize("version", [True, 1.0])
def test_the_schema_version_must_be_the_integer(version: object) -> None:
    # True == 1 == SCHEMA_VERSION in Python: `"v": true` was accepted (and silently written back as 1).
    with pytest.raises(ValidationError) as info:
        Job.from_dict({**BASE, "v": version})
    assert info.value.field == "v"


@pytest.mark.parametrize(
    ("url", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "n": True}),
        ("/v1/chat/completions", {**CHAT, "stream": 0}),
        # A completions line's `logprobs` is an integer: 0 asks for the sampled tokens' log-probabilities.
        ("/v1/completions", {"model": "laya", "prompt": "p", "logprobs": 0}),
    ],
)
def test_openai_neutral_values_are_compared_with_their_type(url: str, body: dict) -> None:
    # `0 == False` and `True == 1`: a value that only compares equal to the neutral one was accepted as neutral.
    line = orjson.dumps({"custom_id": "a", "url": url, "body": body})
    (error,) = refused([line])
    assert "is not supported by kevlaya" in error


def test_openai_neutral_values_themselves_still_pass() -> None:
    body = {**CHAT, "n": 1, "stream": False, "stop": None}
    (job,) = parse_lines([orjson.dumps({"custom_id": "a", "body": body})])
    assert job.prompt == "hi"


# ---- input fields: names are prompt text too ----------------------------------------------------
@pytest.mark.parametrize(
    "fields", [{"k" * 100_000: "v"}, {f"field{i}": "" for i in range(20_000)}], ids=["long-name", "many-names"]
)
def test_input_field_names_count_towards_the_prompt_limit(fields: dict) -> None:
    # Only the values were counted: a 100 KB field name, or 20,000 empty fields, passed a 64 KiB limit, though the
    # names are rendered into the prompt ("name: value" lines) and stored in every payload.
    with pytest.raises(ValidationError) as info:
        Job.from_dict({"custom_id": "a", "model": "laya", "input": fields})
    assert info.value.field == "input" and "limit is 65536 bytes" in str(info.value)


def test_an_input_field_name_that_is_not_a_string_is_a_validation_error() -> None:
    # From Python (JSON keys are always strings): an AttributeError escaped the validator.
    with pytest.raises(ValidationError) as info:
        Job.from_dict({"custom_id": "a", "model": "laya", "input": {1: "x"}})
    assert info.value.field == "input"


def test_an_escalate_integer_too_large_for_a_float_is_a_validation_error() -> None:
    # From Python: float(10**400) raised OverflowError instead of the field's refusal.
    with pytest.raises(ValidationError) as info:
        Job.from_dict({**BASE, "escalate": 10**400})
    assert info.value.field == "escalate"


# ---- --model-map ---------------------------------------------------------------------------------
def test_a_model_map_naming_one_name_twice_differently_is_refused() -> None:
    # `gpt-4o=laya,gpt-4o=kev` silently sent every gpt-4o line to Kev (the last entry won).
    with pytest.raises(ValidationError, match="'gpt-4o' is mapped twice"):
        parse_model_map("gpt-4o=laya,gpt-4o=kev")
    assert parse_model_map("gpt-4o=laya,gpt-4o=laya") == {"gpt-4o": "laya"}


@pytest.mark.parametrize("text", ["gpt-4o=gpt", "gpt-4o=laya=kev", "gpt-4o=LAYA"])
def test_a_model_map_to_an_unknown_model_is_refused_once_up_front(text: str) -> None:
    # It was reported as "unknown model" on every line using it (thousands of lines), and not at all when no line did.
    with pytest.raises(ValidationError, match="allowed: kev, laya"):
        parse_model_map(text)


def test_a_bad_model_map_is_one_line_before_any_write(redis_url: str, redis: Redis) -> None:
    line = orjson.dumps({"custom_id": "a", "body": {**CHAT, "model": "gpt-4o"}}) + b"\n"
    code, out, err = kevlaya(redis_url, "submit", "-", "--model-map", "gpt-4o=gtp", input=line * 3)
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "gpt-4o=gtp" in err
    assert redis.dbsize() == 0


# ---- stdin and the file itself ------------------------------------------------------------------
def test_a_closed_stdin_is_one_line_not_a_traceback(redis_url: str, redis: Redis) -> None:
    # click raised a bare RuntimeError ("Was not able to determine binary stream for sys.stdin").
    code, out, err = kevlaya(redis_url, "submit", "-", input=None, shell_tail="<&-")
    assert code == 1 and out == "" and "Traceback" not in err, err
    assert "stdin" in err
    assert redis.dbsize() == 0


class _Reads(io.BytesIO):
    """Records the largest piece handed out, to see that a long line is never held whole."""

    largest = 0

    def readline(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        data = super().readline(size)
        self.largest = max(self.largest, len(data))
        return data


def test_an_overlong_line_is_refused_by_its_number_without_being_held_whole() -> None:
    # A 300 MB line (or a multi-GB file without newlines) was read whole, decoded and parsed: ~4x its size in RSS
    # before the one-line "too long" answer. Now it is skipped in pieces of the limit.
    source = _Reads(OK_LINE + b'{"prompt": "' + b"x" * 100_000 + b'"}\n' + b"nope\n")
    with pytest.raises(SubmissionError) as info:
        parse_lines(read_lines(source, max_line_bytes=1000))
    errors = [str(e) for e in info.value.errors]
    assert errors[0] == "line 2: the line is 100014 bytes; a line may have at most 1000 (no job is that long)"
    assert errors[1].startswith("line 3: invalid JSON")
    assert source.largest <= 1001


def test_the_default_line_limit_leaves_room_for_every_field_fully_escaped() -> None:
    limits = Limits()
    job = {
        **BASE,
        "prompt": "\x01" * limits.max_prompt_bytes,
        "choices": ["\x01" * (limits.max_choice_bytes - 2) + f"{i:02d}" for i in range(limits.max_choices)],
        "meta": {"m": "x" * (limits.max_meta_bytes - 20)},
    }
    line = orjson.dumps(job) + b"\n"
    (parsed,) = parse_lines(read_lines(io.BytesIO(line)))
    assert parsed.prompt == job["prompt"]


def test_submit_refuses_an_overlong_line_in_one_line(
    redis_url: str, redis: Redis, tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "long.jsonl"  # type: ignore[operator]
    path.write_bytes(OK_LINE + b'{"prompt": "' + b"x" * (20 * 1024 * 1024) + b'"}\n')
    code, out, err = kevlaya(redis_url, "submit", str(path), "--model", "laya")
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.startswith("line 2: the line is 20971534 bytes; a line may have at most ")
    assert redis.dbsize() == 0


def test_a_client_submission_with_a_huge_input_name_writes_nothing(client: Client, redis: Redis) -> None:
    with pytest.raises(SubmissionError):
        client.submit_batch([{"custom_id": "a", "model": "laya", "input": {"k" * 70_000: "v"}}])
    assert redis.dbsize() == 0


def test_a_read_error_part_way_through_the_file_is_one_line(
    redis_url: str, redis: Redis, tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An OSError while reading (EIO on a failing disk or network mount; `kevlaya submit /proc/self/mem` shows it)
    # ended in a traceback.
    path = tmp_path / "in.jsonl"  # type: ignore[operator]
    path.write_bytes(OK_LINE)

    def failing(fh: io.BufferedReader) -> Iterator[bytes]:
        yield fh.readline()
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cli_module, "read_lines", failing)
    res = CliRunner().invoke(cli_module.cli, ["--redis-url", redis_url, "submit", str(path)])
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.strip() == f"Error: cannot read {path}: Input/output error; nothing enqueued"
    assert redis.dbsize() == 0


@pytest.mark.parametrize("made_by", ["hand", "from_json"])
def test_a_job_instance_naming_a_parent_is_refused_like_a_dict(client: Client, redis: Redis, made_by: str) -> None:
    # `parent` is a system field: refused in a dict, but a Job instance carrying one went through, and its answer was
    # counted as a follow-up's (followups_done) and recorded as escalated from a job that never ran.
    parent = {"job_id": "b1-0123", "model": "laya", "text": "t", "decision": None, "confidence": 0.1}
    job = (
        Job(custom_id="a", model="kev", prompt="p", parent=Parent(**parent))
        if made_by == "hand"
        else Job.from_json(orjson.dumps({**BASE, "model": "kev", "parent": parent}))
    )
    with pytest.raises(SubmissionError) as info:
        client.submit_batch([job])
    assert info.value.errors[0].field == "parent"
    assert redis.dbsize() == 0
