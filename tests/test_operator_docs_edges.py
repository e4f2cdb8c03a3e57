"""The operator's surface: `kevlaya worker` options refuse hostile values in one line before anything loads,
a stop while Redis is down at start is prompt, the metrics say what the README says they say."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import redis.exceptions
from prometheus_client.parser import text_string_to_metric_families

from producer.cli import main
from shared.errors import EXIT_USAGE, ConfigError
from tests.conftest import tiny_config
from worker.presence import Presence
from worker.settings import WorkerSettings


class EngineReached(Exception):
    """The option was accepted: the command went on to build the engine."""


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`kevlaya ARGS` in this process: its exit code and stderr. Any exception but SystemExit (a traceback for the
    operator) fails the test."""
    monkeypatch.setattr(sys, "argv", ["kevlaya", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    return int(exited.value.code or 0), capsys.readouterr().err


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kevlaya worker` stops where it would load the models: an option that gets that far was accepted."""
    import worker.config
    import worker.engine

    def engine(*args: object, **kwargs: object) -> None:
        raise EngineReached

    monkeypatch.setattr(worker.config, "load_config", lambda path: object())
    monkeypatch.setattr(worker.engine, "Engine", engine)


HOSTILE_WORKER_OPTIONS = [
    # '' was read as "no budget given" (the GPU's total), 0 as no limit at all (the planner's `or` fallback).
    ("--memory-budget", ""),
    ("--memory-budget", "0"),
    ("--memory-budget", "0GiB"),
    # A negative wait counted every other queue's job as starving: a model switch at every take.
    ("--max-wait-ms", "-1"),
    # 0 or less: bulk was always due, so interactive work no longer went first.
    ("--bulk-every-takes", "0"),
    ("--bulk-every-takes", "-5"),
    # NaN never ran out (no row ever timed out); 0 or less timed out every generated row at once.
    ("--batch-time-limit-s", "nan"),
    ("--batch-time-limit-s", "0"),
    ("--batch-time-limit-s", "-1"),
    # NaN / inf: a traceback (int() of them); 0 or less: a heartbeat thread spinning or failing.
    ("--job-heartbeat-ttl-s", "nan"),
    ("--job-heartbeat-ttl-s", "inf"),
    ("--job-heartbeat-ttl-s", "0"),
    ("--job-heartbeat-ttl-s", "-1"),
    # A traceback from bind() after the models had loaded.
    ("--metrics-port", "-1"),
    ("--metrics-port", "70000"),
    # Silently logged at INFO.
    ("--log-level", "bogus"),
]


@pytest.mark.parametrize(("option", "value"), HOSTILE_WORKER_OPTIONS)
def test_worker_refuses_a_hostile_option_in_one_line_before_loading(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_engine: None, option: str, value: str
) -> None:
    code, err = run_main(monkeypatch, capsys, "worker", "--config", "models.toml", option, value)
    assert code == EXIT_USAGE
    assert option in err and "Traceback" not in err


DOCUMENTED_WORKER_OPTIONS = [
    ("--memory-budget", "6GiB"),
    ("--memory-budget", "6gib"),
    ("--memory-budget", "6GB"),
    ("--max-wait-ms", "0"),
    ("--metrics-port", "0"),
    ("--log-level", "DEBUG"),
    ("--batch-time-limit-s", "0.5"),
]


@pytest.mark.parametrize(("option", "value"), DOCUMENTED_WORKER_OPTIONS)
def test_worker_still_takes_the_documented_values(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_engine: None, option: str, value: str
) -> None:
    monkeypatch.setattr(sys, "argv", ["kevlaya", "worker", "--config", "models.toml", option, value])
    with pytest.raises(EngineReached):
        main()


@pytest.mark.parametrize("budget", ["", "0"])
def test_memory_refuses_an_empty_or_zero_budget(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], budget: str
) -> None:
    import worker.tools.memory_report

    def table(*args: object, **kwargs: object) -> str:
        raise EngineReached

    monkeypatch.setattr(worker.tools.memory_report, "memory_table", table)
    code, err = run_main(monkeypatch, capsys, "memory", "--config", "models.toml", "--memory-budget", budget)
    assert code == EXIT_USAGE and "--memory-budget" in err


@pytest.mark.parametrize("device", ["bogus", "cuda:x", ""])
def test_a_device_torch_cannot_parse_is_a_config_error(device: str) -> None:
    from worker.loading import pick_device

    with pytest.raises(ConfigError, match="--device"):
        pick_device(device)


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_cuda_device_this_process_cannot_see_is_a_config_error(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    import torch

    from worker.loading import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ConfigError, match=f"--device cuda:1: this process sees {gpus} CUDA device"):
        pick_device("cuda:1")
    assert pick_device("cpu").type == "cpu"
    assert pick_device(None).type == ("cuda" if gpus else "cpu")
    if gpus:
        assert pick_device("cuda:0") == torch.device("cuda", 0)  # seen: taken as given
    else:
        with pytest.raises(ConfigError, match="--device cuda: this process sees 0"):
            pick_device("cuda")


def test_worker_with_a_bad_device_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], nf4_config: Path
) -> None:
    """Before: a RuntimeError traceback from torch.device (or an AssertionError from torch's CUDA init)."""
    code, err = run_main(monkeypatch, capsys, "worker", "--config", str(nf4_config), "--device", "bogus")
    assert code == EXIT_USAGE and "--device" in err and "Traceback" not in err


def test_a_metrics_port_in_use_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: an OSError traceback after the models had loaded."""
    import socket

    from worker.metrics import HealthServer

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--metrics-port {port}"):
            HealthServer(object(), port)


def test_a_stop_while_redis_is_down_at_start_ends_the_wait_at_once() -> None:
    """A worker started against a Redis that is down retries with backoff (0.5, 1, 2 ... 10 s). SIGTERM then must
    not wait out the backoff (up to 10 s: `docker stop`'s whole grace period) nor try Redis once more."""
    stop = threading.Event()
    presence = Presence(None, None, None, WorkerSettings(), stop=stop, in_flight=list)  # type: ignore[arg-type]
    tries: list[float] = []

    def down() -> None:
        tries.append(time.monotonic())
        raise redis.exceptions.ConnectionError("Connection refused.")

    timer = threading.Timer(2.0, stop.set)  # inside the third wait (1.5 s - 3.5 s)
    timer.start()
    started = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError):
        presence.wait_for_redis(down)
    timer.join()
    assert time.monotonic() - started < 2.8
    assert len(tries) == 3


def test_model_load_seconds_metric_is_measured(tiny_models: Path) -> None:
    """The README lists kevlaya_model_load_seconds; the engine never recorded it, so it read 0 for every worker."""
    from worker.engine import Engine
    from worker.metrics import WorkerCollector
    from worker.stats import WorkerStats

    engine = Engine(tiny_config(tiny_models, "none"), device="cpu", decode="eager")
    assert engine.load_s > 0 and engine.warmup_s == 0.0  # no warm-up on a CPU

    class Bridge:
        def queue_facts(self, move_aside: bool) -> dict:
            raise redis.exceptions.ConnectionError("not needed here")

    class Worker:
        stats = WorkerStats()
        bridge = Bridge()

    Worker.engine = engine  # type: ignore[attr-defined]
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(WorkerCollector(Worker()))
    text = generate_latest(registry).decode()
    values = {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if len(f.samples) == 1}
    assert values["kevlaya_model_load_seconds"] == pytest.approx(engine.load_s)


@pytest.mark.parametrize("option", ["--target-escalation", "--target-accuracy"])
@pytest.mark.parametrize("value", ["nan", "-0.1", "1.5", "x"])
def test_eval_refuses_a_target_outside_0_to_1_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], option: str, value: str
) -> None:
    code, err = run_main(monkeypatch, capsys, "eval", "--config", "models.toml", option, value)
    assert code == EXIT_USAGE and option in err and "Traceback" not in err  # named, before the config is read
