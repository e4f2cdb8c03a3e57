"""OpenAI Batch lines in and out: every body field honoured or refused by line, output the openai types parse."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner
from openai.types import Completion
from openai.types.chat import ChatCompletion
from redis import Redis

from producer.cli import cli
from producer.client import Client
from producer.jsonl import parse_lines
from shared.errors import SubmissionError
from tests.fakes import FAKE_CONFIG, FakeEngine
from worker.loop import BatchWorker
from worker.settings import WorkerSettings


def line(body: dict, custom_id: str = "r1", url: str = "/v1/chat/completions") -> bytes:
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + b"\n"


def one(body: dict, **kw) -> object:
    (job,) = parse_lines([line(body)], **kw)
    return job


def test_system_message_is_the_system_turn_and_text_parts_join() -> None:
    job = one(
        {
            "model": "laya",
            "messages": [
                {"role": "system", "content": "Be strict."},
                {"role": "user", "content": [{"type": "text", "text": "Approve "}, {"type": "text", "text": "it?"}]},
            ],
            "max_completion_tokens": 9,
            "temperature": 0.5,
            "seed": 3,
            "metadata": {"k": "v"},
            "n": 1,
            "top_p": 0.9,
            "response_format": {"type": "text"},
        }
    )
    assert job.input == {"system": "Be strict.", "prompt": "Approve it?"} and job.prompt is None
    assert (job.max_new_tokens, job.temperature, job.seed, job.meta, job.top_p) == (9, 0.5, 3, {"k": "v"}, 0.9)


def test_model_names_map_through_the_model_map() -> None:
    job = one(
        {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}, model_map={"gpt-4o-mini": "laya"}
    )
    assert job.model == "laya"
    with pytest.raises(SubmissionError) as info:
        one({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]})
    assert "unknown model 'gpt-4o-mini'" in str(info.value.errors[0])


def test_chat_logprobs_become_job_fields_and_completions_lines_still_refuse_them() -> None:
    body = {"model": "laya", "messages": [{"role": "user", "content": "x"}]}
    job = one(body | {"logprobs": True, "top_logprobs": 3})
    assert (job.logprobs, job.top_logprobs) == (True, 3)
    assert not one(body | {"logprobs": False, "top_logprobs": None}).logprobs
    for extra, fragment in (({"logprobs": 2}, "'body.logprobs'"), ({"top_logprobs": 1}, "'body.top_logprobs'")):
        with pytest.raises(SubmissionError) as info:
            parse_lines([line({"model": "laya", "prompt": "x"} | extra, url="/v1/completions")])
        assert fragment in str(info.value.errors[0])


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"n": 2}, "'body.n' = 2"),
        ({"stop": ["\n"]}, "'body.stop'"),
        ({"logprobs": True, "top_logprobs": 6}, "'top_logprobs' must be an integer from 0 to 5"),
        ({"top_logprobs": 2}, "'top_logprobs' needs \"logprobs\": true"),
        ({"top_p": 1.5}, "top_p"),
        ({"response_format": {"type": "json_object"}}, "'body.response_format'"),
        ({"tools": []}, "'body.tools'"),
        (
            {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]},
            "role' = 'assistant'",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "'image_url' part"),
    ],
)
def test_unsupported_fields_are_refused_with_the_line(body: dict, fragment: str) -> None:
    full = {"model": "laya", "messages": [{"role": "user", "content": "x"}]} | body
    with pytest.raises(SubmissionError) as info:
        parse_lines([b"\n", line(full)])
    (err,) = info.value.errors
    assert str(err).startswith("line 2: ") and fragment in str(err)


@pytest.mark.parametrize(
    "key", ["temperature", "top_p", "seed", "metadata", "n", "stream", "presence_penalty", "frequency_penalty"]
)
def test_a_null_field_is_unset_as_openai_reads_it(key: str) -> None:
    base = {"model": "laya", "messages": [{"role": "user", "content": "x"}]}
    assert one(base | {key: None}) == one(base)


@pytest.mark.parametrize(("key", "value"), [("presence_penalty", 0.5), ("frequency_penalty", -1), ("n", 0)])
def test_a_non_neutral_penalty_or_count_is_still_refused(key: str, value: object) -> None:
    with pytest.raises(SubmissionError) as info:
        one({"model": "laya", "messages": [{"role": "user", "content": "x"}], key: value})
    (err,) = info.value.errors
    assert f"'body.{key}' = {value!r} is not supported" in str(err)


def test_output_lines_parse_with_the_openai_types(client: Client, redis: Redis, redis_url: str, tmp_path: Path) -> None:
    inp = b"".join(
        [
            line({"model": "laya", "messages": [{"role": "user", "content": "ok"}]}, "good"),
            line({"model": "laya", "messages": [{"role": "user", "content": "POISON? no: fails"}]}, "bad"),
            line({"model": "laya", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, "lp"),
        ]
    )
    runner = CliRunner()
    batch = runner.invoke(cli, ["--redis-url", redis_url, "submit", "-"], input=inp).stdout.strip()

    class FailsBad(FakeEngine):
        def run(self, jobs, *, time_limit_s=None):
            from dataclasses import replace

            from shared.result import TokenLogprob, TopLogprob
            from worker.outputs import RowOutput

            entry = TokenLogprob(
                token="ans", logprob=-0.25, bytes=list(b"ans"), top_logprobs=[TopLogprob(token="ans", logprob=-0.25)]
            )
            return [
                RowOutput.failed("internal", "boom")
                if j.custom_id == "bad"
                else replace(self._answer(j), logprobs=[entry] if j.logprobs else None)
                for j in jobs
            ]

    BatchWorker(redis, FailsBad(), FAKE_CONFIG, WorkerSettings(burst=True)).work()
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    args = ["--redis-url", redis_url, "results", batch, "--format", "openai", "-o", str(out), "--errors", str(err)]
    assert runner.invoke(cli, args).exit_code == 0
    good, lp = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    (bad,) = [orjson.loads(x) for x in err.read_bytes().splitlines()]
    assert good["custom_id"] == "good" and good["error"] is None and good["response"]["status_code"] == 200
    completion = ChatCompletion.model_validate(good["response"]["body"])
    assert completion.choices[0].message.content == "answer to good"
    assert completion.choices[0].logprobs is None
    assert completion.usage is not None and completion.usage.total_tokens == 5
    content = ChatCompletion.model_validate(lp["response"]["body"]).choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [("ans", -0.25, list(b"ans"))]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("ans", -0.25)]
    assert bad["custom_id"] == "bad" and bad["response"] is None and bad["error"]["code"] == "internal"
    args[5] = "openai-completions"
    assert runner.invoke(cli, args).exit_code == 0
    good, _ = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert Completion.model_validate(good["response"]["body"]).choices[0].text == "answer to good"
