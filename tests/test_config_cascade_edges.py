"""Edges of the models config and the escalation cascade a review found, each a failing test before its fix.

Config: every bad value is one ConfigError line naming the file, table and key -- never a traceback, never a
silently different value. Cascade: the worker escalates exactly what `kevlaya eval` counts as escalating."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis import Redis

from shared.errors import ConfigError
from worker.config import EscalationRule, config_from_toml, load_config

BASE = '[base]\npath = "b"\n'


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "models.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# ---- (a) the models config ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ('temperature = "abc"', "temperature"),  # was: ValueError traceback
        ('temperature = "2.0"', "temperature"),  # was: silently 2.0 (a string where a number belongs)
        ("temperature = true", "temperature"),  # was: silently 1.0
        ('choices_temperature = "x"', "choices_temperature"),
        ('ece_before = "x"', "ece_before"),  # was: ValueError traceback
        ("fitted_on = [1, 2]", "fitted_on"),  # was: silently '[1, 2]'
        ("method = 'isotonic'\nisotonic = 5", "isotonic"),  # was: TypeError traceback
        ("method = 'isotonic'\nisotonic = 'ab'", "isotonic"),  # was: ValueError traceback
        ("method = 'isotonic'\nisotonic = [[0.1]]", "isotonic"),  # was: ValueError traceback
        ("method = 'isotonic'\nisotonic = [[0.1, 0.2, 0.3]]", "isotonic"),
        ("method = 'isotonic'\nisotonic = [['a', 'b']]", "isotonic"),
        ("method = 'isotonic'\nisotonic = [[true, false]]", "isotonic"),  # was: silently (1.0, 0.0)
        # Out of [0, 1]: served confidences of 5.0 or -2.0 (was: accepted).
        ("method = 'isotonic'\nisotonic = [[0.1, 0.5], [0.9, 5.0]]", "isotonic"),
        ("method = 'isotonic'\nisotonic = [[-1.0, 0.5], [2.0, 0.9]]", "isotonic"),
        ("method = 'isotonic'\nisotonic = [[nan, 0.5], [0.9, 0.9]]", "isotonic"),
        # Decreasing: a surer raw answer served as less sure, escalation inverted (was: accepted).
        ("method = 'isotonic'\nisotonic = [[0.1, 0.9], [0.9, 0.1]]", "isotonic"),
    ],
)
def test_a_bad_calibration_value_is_one_config_error_naming_the_key(tmp_path: Path, table: str, fragment: str) -> None:
    path = write(tmp_path, f"{BASE}[models.laya.calibration]\n{table}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, check_paths=False)
    message = str(info.value)
    assert str(path) in message and "[models.laya.calibration]" in message and fragment in message
    assert "\n" not in message


def test_a_calibration_table_calibrate_writes_still_loads() -> None:
    text = (
        f"{BASE}[models.laya.calibration]\nmethod = 'isotonic'\ntemperature = 2\nchoices_temperature = 1.4\n"
        "isotonic = [[0.1, 0.2], [0.5, 0.5], [0.5, 0.6], [0.9, 0.6]]\nece_before = 0.1\nece_after = 0\n"
        "fitted_on = 'heldout.jsonl'\n"
    )
    cal = config_from_toml(text).models["laya"].calibration
    assert cal is not None and cal.temperature == 2.0 and cal.isotonic[-1] == (0.9, 0.6) and cal.ece_after == 0.0


def test_a_config_file_that_is_not_utf8_is_one_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, b'[base]\npath = "b"\n# caf\xe9\n')  # Latin-1, as an editor might save it
    with pytest.raises(ConfigError, match="UTF-8") as info:  # was: UnicodeDecodeError, a traceback in the CLI
        load_config(path, check_paths=False)
    assert str(path) in str(info.value)


def test_base_and_bases_default_together_are_refused() -> None:
    text = f'{BASE}[bases.default]\npath = "other"\n'
    with pytest.raises(ConfigError, match=r"\[bases.default\]"):  # was: [bases.default] silently dropped
        config_from_toml(text)


def test_several_bases_and_a_model_that_names_none_is_refused() -> None:
    text = '[bases.big]\npath = "big"\n[bases.small]\npath = "small"\n[models.kev]\nbase = "big"\n'
    # laya names no base: it was put on [bases.big], the first table in the file, without a word.
    with pytest.raises(ConfigError, match=r"\[models.laya\].*base"):
        config_from_toml(text)
    named = text + '[models.laya]\nbase = "small"\n'
    assert config_from_toml(named).models["laya"].base == "small"
    assert config_from_toml('[bases.only]\npath = "b"\n').models["laya"].base == "only"  # one base: no doubt


def test_an_empty_unsure_phrase_is_refused() -> None:
    # "" is in every text: every Laya answer would escalate, whatever its confidence.
    with pytest.raises(ConfigError, match=r"\[models.laya.escalation.phrases\] 1 = ''"):
        config_from_toml(f'{BASE}[models.laya.escalation]\nphrases = ["not sure", ""]\n')


def test_an_empty_adapter_path_is_refused() -> None:
    # adapter = "" (an unset variable in a templated config) served the bare base under Kev's name.
    with pytest.raises(ConfigError, match=r"\[models.kev\] adapter"):
        config_from_toml(f'{BASE}[models.kev]\nadapter = ""\n')


def test_max_new_tokens_above_what_a_job_may_ask_is_refused() -> None:
    # The job contract caps max_new_tokens at 4096; a config of 10**8 was accepted, and the static loop then
    # failed to allocate its KV pool and the engine fell back to HF generate for good.
    with pytest.raises(ConfigError, match=r"\[models.kev\] max_new_tokens = 100000000"):
        config_from_toml(f"{BASE}[models.kev]\nmax_new_tokens = 100000000\n")
    assert config_from_toml(f"{BASE}[models.kev]\nmax_new_tokens = 4096\n").models["kev"].max_new_tokens == 4096


@pytest.mark.parametrize("stops", ['[""]', '["\\n\\n"]'])
def test_a_stop_string_the_tokenizer_cannot_stop_on_is_refused(tiny_models: Path, tmp_path: Path, stops: str) -> None:
    from worker.engine import Engine

    text = (
        f"stop_strings = {stops}\n"
        f'[base]\npath = "{tiny_models / "base"}"\nquantization = "none"\ncompute_dtype = "float32"\n'
    )
    # Was: dropped without a word (only single tokens stop a row), so generation ran past "\n\n".
    with pytest.raises(ConfigError, match="stop_strings"):
        Engine(load_config(write(tmp_path, text)), device="cpu", decode="eager")


# ---- (b) the cascade ------------------------------------------------------------------------------
def test_an_empty_laya_answer_escalates_as_eval_counts_it() -> None:
    """A row that stops at once has no decision and no confidence; `kevlaya eval` counts it as confidence 0 (it
    escalates under any threshold), the worker never escalated it: the item's final answer was Laya's empty one."""
    import torch

    from worker.escalation import escalation_reason
    from worker.outputs import generated_output
    from worker.tools import cascade

    class Row:
        ids, max_new = [1, 2, 3], 8

    out = generated_output(
        Row(), torch.tensor([7, 0]), torch.tensor([-0.01, 0.0]), bad=False, stops={7}, cut_short=False,
        decode=lambda ids, skip_special_tokens=False: "".join(map(str, ids)), decision_prefix="Decision:",
    )  # fmt: skip
    assert (out.text, out.decision, out.confidence) == ("", None, None)
    rule = EscalationRule(threshold=0.7)
    served = out.confidence or 0.0  # what worker.tools.evaluate makes of it
    item = cascade.Item(gold="a", screen=None, confidence=served, raw_confidence=0.0, text="", expert="a")
    assert cascade.at(cascade.with_rule([item], rule), rule.threshold).escalation_rate == 1.0
    worker = escalation_reason(rule, text=out.text, confidence=out.confidence, job_setting=None, batch_off=False)
    assert worker is not None
    # Threshold 0 (never by confidence) stays never, in both.
    never = EscalationRule(threshold=0.0)
    assert escalation_reason(never, text="", confidence=None, job_setting=None, batch_off=False) is None
    assert cascade.at(cascade.with_rule([item], rule), 0.0).escalation_rate == 0.0


def test_an_empty_laya_answer_ends_with_kevs_answer(redis: Redis) -> None:
    from producer.client import Client
    from shared.job import Job
    from tests.fakes import FakeEngine
    from tests.worker_helpers import assert_each_item_answered_once, drain
    from worker.outputs import RowOutput

    class Silent(FakeEngine):
        @staticmethod
        def _answer(job: Job) -> RowOutput:
            if job.parent is None and job.model == "laya":
                return RowOutput(text="", decision=None, confidence=None, prompt_tokens=3, completion_tokens=1)
            return RowOutput(text="Decision: approve", decision="approve", confidence=0.9, prompt_tokens=3)

    client = Client(redis=redis)
    handle = client.submit_batch([{"custom_id": "a", "model": "laya", "prompt": "case"}])
    drain(redis, Silent())
    (row,) = assert_each_item_answered_once(client, redis, handle.id, 1)
    assert row["model"] == "kev" and row["decision"] == "approve"
    assert row["chain"][0]["model"] == "laya" and row["chain"][0]["text"] == ""
