"""`kevlaya results`: edges of the export and of its OpenAI-shaped output a review found, each a failing test first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from click.testing import CliRunner
from openai.types.chat import ChatCompletion
from redis import Redis

from producer.cli import cli
from tests.fakes import FAKE_CONFIG, FakeEngine
from tests.helpers import answer
from worker.loop import BatchWorker
from worker.settings import WorkerSettings


def chat(cid: str, content: str, **body: object) -> bytes:
    line = {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "laya", "messages": [{"role": "user", "content": content}], **body},
    }
    return orjson.dumps(line) + b"\n"


def invoke(redis_url: str, *args: str, input: bytes | None = None):
    return CliRunner().invoke(cli, ["--redis-url", redis_url, *args], input=input)


def test_an_answer_cut_at_its_token_limit_has_finish_reason_length(redis: Redis, redis_url: str) -> None:
    """A generation that hit its max_tokens (no stop token) is `finish_reason: "length"`, as OpenAI reports it; one
    that stopped is "stop". The export read a `truncated` key no result ever had, so every answer said "stop"."""
    import torch

    from worker.outputs import generated_output

    STOP = 0

    class LimitEngine(FakeEngine):
        def run(self, jobs, *, time_limit_s=None):
            outs = []
            for job in jobs:
                item = SimpleNamespace(ids=[1, 2, 3], max_new=job.max_new_tokens or 4)
                # "long": 4 tokens and no stop token, its limit 4; "short": 2 tokens, then the stop token
                tokens = [5, 6, 7, 8] if job.custom_id == "long" else [5, 6, STOP, STOP]
                outs.append(
                    generated_output(
                        item,
                        torch.tensor(tokens),
                        torch.zeros(4),
                        bad=False,
                        stops={STOP},
                        cut_short=False,
                        decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)),
                        decision_prefix=None,
                    )
                )
            return outs

    inp = chat("long", "x", max_tokens=4, escalate=False) + chat("short", "y", max_tokens=4, escalate=False)
    batch = invoke(redis_url, "submit", "-", input=inp).stdout.strip()
    BatchWorker(redis, LimitEngine(), FAKE_CONFIG, WorkerSettings(burst=True)).work()
    res = invoke(redis_url, "results", batch, "--format", "openai")
    assert res.exit_code == 0, res.output
    long, short = (orjson.loads(x) for x in res.stdout.splitlines())
    long_body = ChatCompletion.model_validate(long["response"]["body"])
    short_body = ChatCompletion.model_validate(short["response"]["body"])
    assert long_body.usage is not None and long_body.usage.completion_tokens == 4
    assert short_body.choices[0].finish_reason == "stop"
    assert long_body.choices[0].finish_reason == "length"


def test_errors_file_is_rewritten_when_the_export_has_no_errors(redis: Redis, redis_url: str, tmp_path: Path) -> None:
    """`--errors FILE` holds this export's error lines: with none, an empty file. It was opened only on a first
    write, so a batch with no errors left FILE as it was: a previous export's error lines, or no file at all."""
    batch = invoke(redis_url, "submit", "-", input=chat("a", "x")).stdout.strip()
    answer(redis, batch, "a", text="ok")
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    err.write_bytes(b'{"custom_id": "a", "response": null, "error": {"code": "internal", "message": "old"}}\n')
    res = invoke(redis_url, "results", batch, "--format", "openai", "-o", str(out), "--errors", str(err))
    assert res.exit_code == 0, res.output
    assert [orjson.loads(x)["custom_id"] for x in out.read_bytes().splitlines()] == ["a"]
    assert err.read_bytes() == b""


def test_a_failed_export_leaves_no_half_output_file(
    redis: Redis, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export that fails part-way (Redis lost after the first rows) must not leave FILE holding those rows --
    nor destroy what FILE held before: a reader of `-o FILE` sees the whole export or none of it."""
    from redis import exceptions as redis_exceptions

    from producer.client import Client

    batch = invoke(redis_url, "submit", "-", input=chat("a", "x") + chat("b", "y")).stdout.strip()
    answer(redis, batch, "a")
    answer(redis, batch, "b")
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"previous complete export\n")
    real = Client.iter_results

    def dies_after_one(self, batch_id):
        rows = real(self, batch_id)
        yield next(rows)
        raise redis_exceptions.ConnectionError("connection lost")

    monkeypatch.setattr(Client, "iter_results", dies_after_one)
    res = invoke(redis_url, "results", batch, "-o", str(out))
    assert res.exit_code != 0
    assert out.read_bytes() == b"previous complete export\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary file left beside it


def test_a_pending_line_has_its_items_own_id(redis: Redis, redis_url: str) -> None:
    """Every `--format openai` line's `id` is unique in the export, and an item's id does not change when it is
    answered. A pending line's id was `batch_req_<custom_id>`: a custom_id spelling another item's job id gave two
    lines one id, and the id changed between an export while pending and the one after."""
    from shared.keys import job_id

    taken = job_id("B1", "a")  # a custom_id that spells item "a"'s job id
    inp = chat("a", "x", escalate=False) + chat(taken, "y", escalate=False) + chat("c", "z", escalate=False)
    assert invoke(redis_url, "submit", "-", "--batch-id", "B1", input=inp).exit_code == 0
    answer(redis, "B1", "a")
    res = invoke(redis_url, "results", "B1", "--format", "openai")
    assert res.exit_code == 4
    before = [orjson.loads(x) for x in res.stdout.splitlines()]
    ids = [x["id"] for x in before]
    assert len(set(ids)) == len(ids) == 3, ids
    answer(redis, "B1", "c")
    after = [orjson.loads(x) for x in invoke(redis_url, "results", "B1", "--format", "openai").stdout.splitlines()]
    assert before[2]["custom_id"] == after[2]["custom_id"] == "c" and before[2]["id"] == after[2]["id"]
