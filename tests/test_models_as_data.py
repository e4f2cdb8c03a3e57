"""Models are data: a third model is a name in shared/models.py plus a table in the models config."""

from __future__ import annotations

import pytest
from redis import Redis

from producer.client import Client
from shared import models as known_models
from shared.models import ModelDefaults
from tests.fakes import FakeEngine
from tests.worker_helpers import assert_each_item_answered_once
from worker.config import config_from_toml
from worker.loop import BatchWorker
from worker.settings import WorkerSettings

THREE = """
[base]
path = "fake"

[models.kai]
escalates_to = "kev"
[models.kai.escalation]
threshold = 0.5

[models.laya]
escalates_to = "kai"
"""


@pytest.fixture
def three_models(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(known_models, "MODEL_NAMES", ("kev", "laya", "kai"))
    monkeypatch.setitem(known_models.MODEL_DEFAULTS, "kai", ModelDefaults(max_new_tokens=32, system="You are Kai."))


def test_a_third_model_is_served_and_escalates_as_configured(three_models: None, redis: Redis) -> None:
    with pytest.raises(Exception, match="escalates itself"):
        config_from_toml(THREE)  # laya -> kai -> kev is a chain: refused
    config = config_from_toml(THREE.replace('escalates_to = "kai"', 'escalates_to = "kev"'))
    assert config.names == ("kev", "laya", "kai")
    assert config.models["kai"].system == "You are Kai." and config.models["kai"].escalates_to == "kev"
    assert config.models["kev"].followup_template is not None  # it answers follow-ups
    client = Client(redis=redis)
    jobs = [
        {"custom_id": f"{m}{i}", "model": m, "prompt": "unsure" if i % 2 else "sure"}
        for m in ("kai", "laya", "kev")
        for i in range(4)
    ]
    handle = client.submit_batch(jobs)
    engine = FakeEngine(config=config)
    stats = BatchWorker(redis, engine, config, WorkerSettings(burst=True)).work()
    rows = {r["custom_id"]: r for r in assert_each_item_answered_once(client, redis, handle.id, 12)}
    for m in ("kai", "laya"):
        assert rows[f"{m}1"]["model"] == "kev" and rows[f"{m}1"]["chain"][0]["model"] == m  # unsure: escalated
        assert rows[f"{m}0"]["model"] == m  # sure: its own answer
    assert stats.escalations == 4
    assert any(set(call) & {"kai0", "kai2"} for call in engine.calls)
