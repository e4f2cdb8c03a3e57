"""Jobs and results encode field by field (`shared.records`), not by `dataclasses.asdict`: the same JSON-ready
dicts as `asdict` gives, for records with every field set, nested records included."""

from __future__ import annotations

from dataclasses import asdict, replace

from shared.job import Job, Parent
from shared.result import ErrorInfo, Result, TokenLogprob, TopLogprob


def test_a_full_result_encodes_as_asdict_did() -> None:
    top = [TopLogprob(token="a", logprob=-0.1, bytes=[97]), TopLogprob(token="b", logprob=-2.5)]
    result = Result(
        custom_id="c", model="laya", job_id="b-c", batch="b", text="approve", decision="approve", confidence=0.9,
        raw_confidence=0.8, choices={"approve": 0.9, "deny": 0.1},
        logprobs=[TokenLogprob(token="a", logprob=-0.1, bytes=[97], top_logprobs=top)],
        usage={"prompt_tokens": 3, "completion_tokens": 1}, max_new_tokens=8, escalated_to="kev",
        escalated_from=None, final=False, not_escalated="cancelled", timing={"engine_s": 0.1},
        model_version={"base": "x"}, meta={"k": [1, {"z": 2}]}, error=ErrorInfo(type="internal", message="m"),
    )  # fmt: skip
    want = {k: v for k, v in asdict(result).items() if v is not None}
    assert result.to_dict() == want
    assert Result.from_json(result.to_json()) == result
    bare = Result(custom_id="c", model="laya", job_id="b-c")
    assert bare.to_dict() == {k: v for k, v in asdict(bare).items() if v is not None}


def test_a_full_job_encodes_as_asdict_did() -> None:
    job = Job.from_dict(
        {"custom_id": "a", "model": "laya", "input": {"income": "1"}, "meta": {"k": [1]}, "truncate": True,
         "temperature": 0.7, "seed": 3, "escalate": 0.5, "max_new_tokens": 9, "lane": "bulk"}
    )  # fmt: skip
    follow = replace(job, choices=("a", "b"), parent=Parent(job_id="j", model="laya", text="t", decision=None,
                                                            confidence=0.4))  # fmt: skip
    payload = follow.to_dict()
    assert payload["parent"] == asdict(follow.parent) and payload["choices"] == ["a", "b"]
    assert {k: v for k, v in asdict(follow).items() if k not in payload} == {
        "prompt": None,
        "top_p": 1.0,
        "top_k": 0,
        "logprobs": False,
        "top_logprobs": 0,
        "batch": None,
    }  # the fields left out are exactly those at their empty defaults
