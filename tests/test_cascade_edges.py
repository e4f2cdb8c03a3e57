"""The escalation cascade at its edges, and what a batch user reads back for escalated items (kevlaya and OpenAI
export): each test here failed on the code before its fix."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from redis import Redis

from producer.client import Client
from shared.job import Job
from shared.keys import Keys
from tests.fakes import FakeEngine, SimulatedCrash
from tests.worker_helpers import assert_each_item_answered_once, drain
from worker.config import EscalationRule
from worker.escalation import escalation_reason
from worker.loop import BatchWorker
from worker.outputs import RowOutput, generated_output
from worker.settings import WorkerSettings

K = Keys()
Answer = Callable[[Job], RowOutput]


def kev_answer(job: Job) -> RowOutput:
    return RowOutput(text="Steps.\nDecision: approve", decision="approve", confidence=0.9, prompt_tokens=40,
                     completion_tokens=12)  # fmt: skip


class Scripted(FakeEngine):
    """Laya answers with `laya`, a follow-up with `kev` (both functions of the job)."""

    def __init__(self, laya: Answer, kev: Answer = kev_answer) -> None:
        super().__init__()
        self.laya, self.kev = laya, kev

    def run(self, jobs, *, time_limit_s=None) -> list[RowOutput]:
        self.calls.append([j.custom_id for j in jobs])
        return [(self.kev if j.parent else self.laya)(j) for j in jobs]


def unsure(job: Job) -> RowOutput:
    return RowOutput(text="Decision: reject", decision="reject", confidence=0.2, prompt_tokens=7, completion_tokens=3)


def sure(job: Job) -> RowOutput:
    return RowOutput(text="Decision: reject", decision="reject", confidence=0.99, prompt_tokens=7, completion_tokens=3)


# ---- a Laya answer with no decision ---------------------------------------------------------------------
VOCAB = {1: "Because", 2: " reasons", 3: "\n", 4: "Decision:", 5: " ", 0: "<eos>"}


def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
    return "".join(VOCAB[i] for i in ids)


class Row:
    def __init__(self) -> None:
        self.ids, self.max_new = [9, 9], 4


@pytest.mark.parametrize(
    ("tokens", "truncated"),
    [([1, 2, 3, 4], True), ([3, 5, 3, 0], False)],
    ids=["cut at its limit right after the prefix", "whitespace only"],
)
def test_an_answer_with_no_decision_has_no_confidence_and_escalates(tokens: list[int], truncated: bool) -> None:
    """Was: the confidence of an answer with no decision span was its FIRST token's probability (0.99 here), so
    a Laya answer cut off at max_new_tokens right after "Decision:" stayed final with `decision: null`."""
    logprobs = torch.tensor([-0.01, -0.5, -0.1, -0.2])
    out = generated_output(Row(), torch.tensor(tokens), logprobs, bad=False, stops={0}, cut_short=False,
                           decode=decode, decision_prefix="Decision:")  # fmt: skip
    assert (out.decision, out.confidence, out.truncated) == (None, None, truncated)
    rule = EscalationRule(threshold=0.7)
    assert escalation_reason(rule, text=out.text or "", confidence=out.confidence, job_setting=None, batch_off=False)


def test_a_laya_answer_cut_off_before_its_decision_ends_with_kevs(redis: Redis) -> None:
    def cut(job: Job) -> RowOutput:
        tokens, logprobs = torch.tensor([1, 2, 3, 4]), torch.tensor([-0.01, -0.5, -0.1, -0.2])
        return generated_output(Row(), tokens, logprobs, bad=False, stops={0}, cut_short=False, decode=decode,
                                decision_prefix="Decision:")  # fmt: skip

    client = Client(redis=redis)
    batch = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "case"}]).id
    drain(redis, Scripted(cut))
    (row,) = assert_each_item_answered_once(client, redis, batch, 1)
    assert (row["model"], row["decision"]) == ("kev", "approve")
    assert row["chain"][0]["truncated"] is True and "decision" not in row["chain"][0]


# ---- a re-run Laya job whose follow-up already answered ------------------------------------------------
def test_a_rerun_that_would_not_escalate_still_records_the_step_its_follow_up_answered(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after enqueuing the follow-up, before writing its step; the follow-up answered; the Laya job runs
    again to record its step, but now answers sure (a calibration or threshold changed meanwhile, or an unseeded
    sampled answer). Was: the re-run's final answer was refused as a duplicate and no step was written, so the
    export lost its `chain` and `kevlaya status` counted 0 escalated with a follow-up done."""
    import worker.settle

    client = Client(redis=redis)
    batch = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "case"}]).id
    real = worker.settle.record_results

    def killed(*a, **kw):
        raise SimulatedCrash("killed before the step is written")

    monkeypatch.setattr(worker.settle, "record_results", killed)
    first = Scripted(unsure)
    with pytest.raises(SimulatedCrash):
        BatchWorker(redis, first, first.config, WorkerSettings(burst=True, name="w1", worker_ttl_s=1)).work()
    monkeypatch.setattr(worker.settle, "record_results", real)
    engine = Scripted(sure)  # the same Laya input now answered sure
    peer = BatchWorker(redis, engine, engine.config, WorkerSettings(burst=True, name="w2", worker_ttl_s=60))
    peer._step()  # the Kev follow-up answers first
    assert redis.hlen(K.batch_results(batch)) == 1
    drain(redis, engine, name="w3", worker_ttl_s=1)
    (row,) = assert_each_item_answered_once(client, redis, batch, 1)
    assert row["model"] == "kev" and [s["model"] for s in row.get("chain", [])] == ["laya"]
    assert row["chain"][0]["escalated_to"] == row["job_id"]
    counts = client.status(batch).counts
    assert (counts.finished, counts.escalated, counts.followups_done) == (1, 1, 1)
    assert int(redis.get(K.counter("duplicate_final_results")) or 0) == 0


# ---- the OpenAI-shaped export of an escalated item -------------------------------------------------------
def test_openai_usage_of_an_escalated_item_counts_both_steps(redis: Redis, redis_url: str) -> None:
    """An escalated item cost Laya's tokens and Kev's. Was: `--format openai` reported Kev's usage alone, and the
    Laya step is nowhere else in that format, so a batch's token total left out every escalated item's first step."""
    import orjson
    from click.testing import CliRunner

    from producer.cli import cli

    def line(cid: str, content: str) -> bytes:
        body = {"model": "laya", "messages": [{"role": "user", "content": content}]}
        return orjson.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}) + b"\n"

    runner = CliRunner()
    submitted = runner.invoke(cli, ["--redis-url", redis_url, "submit", "-"], input=line("up", "hard") + line("s", "x"))
    batch = submitted.stdout.strip()
    drain(redis, Scripted(lambda job: unsure(job) if job.prompt == "hard" else sure(job)))
    res = runner.invoke(cli, ["--redis-url", redis_url, "results", batch, "--format", "openai"])
    assert res.exit_code == 0, res.output
    up, plain = (orjson.loads(x) for x in res.stdout.splitlines())
    assert up["response"]["body"]["model"] == "kev"
    assert up["response"]["body"]["usage"] == {"prompt_tokens": 47, "completion_tokens": 15, "total_tokens": 62}
    assert plain["response"]["body"]["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
