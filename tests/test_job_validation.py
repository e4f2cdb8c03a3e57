"""Every validation refusal names its field; valid jobs round-trip through JSON unchanged."""

from __future__ import annotations

import pytest

from shared.errors import ValidationError
from shared.job import Job, Limits

BASE = {"custom_id": "a", "model": "laya", "prompt": "Approve this loan?"}


@pytest.mark.parametrize(
    ("patch", "field", "fragment"),
    [
        ({"model": "gpt"}, "model", "allowed: kev, laya"),
        ({"model": None}, "model", "missing 'model'"),
        ({"prompt": None}, "prompt", "missing 'prompt'"),
        ({"prompt": 42}, "prompt", "must be a string"),
        ({"max_new_token": 5}, "max_new_token", "unknown field"),
        ({"max_new_tokens": 0}, "max_new_tokens", "from 1 to 4096"),
        ({"max_new_tokens": 99999}, "max_new_tokens", "from 1 to 4096"),
        ({"max_new_tokens": True}, "max_new_tokens", "integer"),
        ({"choices": []}, "choices", "non-empty list"),
        ({"choices": ["yes", "yes"]}, "choices", "duplicate choice"),
        ({"choices": [str(i) for i in range(33)]}, "choices", "limit is 32"),
        ({"choices": ["yes", ""]}, "choices", "non-empty string"),
        ({"prompt": "x" * (64 * 1024 + 1)}, "prompt", "limit is 65536 bytes"),
        ({"custom_id": ""}, "custom_id", "non-empty string"),
        ({"escalate": 1.5}, "escalate", "threshold"),
        ({"temperature": -1}, "temperature", "from 0 to 5"),
        ({"top_p": 0}, "top_p", "in (0, 1]"),
        ({"top_p": 1.5}, "top_p", "in (0, 1]"),
        ({"top_k": -1}, "top_k", "from 0"),
        ({"top_k": 2.5}, "top_k", "from 0"),
        ({"logprobs": 1}, "logprobs", "true or false"),
        ({"logprobs": True, "top_logprobs": 6}, "top_logprobs", "from 0 to 5"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "from 0 to 5"),
        ({"logprobs": True, "top_logprobs": 2.0}, "top_logprobs", "from 0 to 5"),
        ({"top_logprobs": 3}, "top_logprobs", 'needs "logprobs": true'),
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs", 'needs "logprobs": true'),
        ({"logprobs": True, "choices": ["yes", "no"]}, "logprobs", "generated answers"),
        ({"v": 2}, "v", "unsupported schema version"),
        ({"parent": {"job_id": "x"}}, "parent", "unknown field"),
    ],
)
def test_each_refusal_names_its_field(patch: dict, field: str, fragment: str) -> None:
    obj = {**BASE, **patch}
    obj = {k: v for k, v in obj.items() if v is not None}
    with pytest.raises(ValidationError) as info:
        Job.from_dict(obj)
    assert info.value.field == field
    assert fragment in str(info.value)


def test_prompt_limit_is_configurable() -> None:
    with pytest.raises(ValidationError, match="limit is 10 bytes"):
        Job.from_dict({**BASE, "prompt": "x" * 11}, limits=Limits(max_prompt_bytes=10))


def test_default_model_fills_missing_model() -> None:
    job = Job.from_dict({"custom_id": "a", "prompt": "p"}, default_model="kev")
    assert job.model == "kev"


def test_round_trip_through_json() -> None:
    job = Job.from_dict({**BASE, "choices": ["approve", "reject"], "max_new_tokens": 8, "meta": {"k": [1, 2]}})
    again = Job.from_json(job.to_json())
    assert again == job
    assert again.choices == ("approve", "reject")


def test_sampling_fields_round_trip_and_defaults_stay_out_of_the_payload() -> None:
    job = Job.from_dict({**BASE, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7})
    assert Job.from_json(job.to_json()) == job
    assert (job.top_p, job.top_k) == (0.9, 40)
    plain = Job.from_dict(BASE)
    assert "top_p" not in plain.to_dict() and "top_k" not in plain.to_dict()


def test_logprobs_fields_round_trip_and_defaults_stay_out_of_the_payload() -> None:
    job = Job.from_dict({**BASE, "logprobs": True, "top_logprobs": 5})
    assert (job.logprobs, job.top_logprobs) == (True, 5)
    assert Job.from_json(job.to_json()) == job
    only = Job.from_dict({**BASE, "logprobs": True})
    assert only.top_logprobs == 0 and "top_logprobs" not in only.to_dict()
    assert "logprobs" not in Job.from_dict(BASE).to_dict()


def test_input_fields_instead_of_prompt() -> None:
    job = Job.from_dict({"custom_id": "a", "model": "kev", "input": {"applicant": "Ann", "amount": "5000"}})
    assert job.prompt is None and job.input == {"applicant": "Ann", "amount": "5000"}
    with pytest.raises(ValidationError, match=r"'input\.amount' must be a string"):
        Job.from_dict({"custom_id": "a", "model": "kev", "input": {"amount": 5000}})


def test_system_fields_refused_from_users_but_accepted_from_the_queue() -> None:
    with pytest.raises(ValidationError, match="unknown field"):
        Job.from_dict({**BASE, "batch": "b1"})
    assert Job.from_dict({**BASE, "batch": "b1"}, allow_system=True).batch == "b1"


HUGE = "9" * 1_000_000


@pytest.mark.parametrize(
    "patch",
    [
        {"temperature": HUGE},
        {"model": HUGE},
        {"lane": HUGE},
        {"seed": [HUGE]},
        {"v": HUGE},
        {HUGE: 1},
        {"choices": ["y" * 500, "y" * 500]},
    ],
)
def test_a_huge_value_is_named_by_its_length_not_echoed_whole(patch: dict) -> None:
    with pytest.raises(ValidationError) as exc:
        Job.from_dict({**BASE, **patch})
    message = str(exc.value)
    assert len(message) < 400 and "characters)" in message


def test_an_openai_line_echoes_a_huge_value_by_its_length() -> None:
    from producer.openai_format import from_openai

    with pytest.raises(ValidationError) as exc:
        from_openai({"custom_id": "a", "url": HUGE, "body": {}})
    assert len(str(exc.value)) < 400 and "characters)" in str(exc.value)
