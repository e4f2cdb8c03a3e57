"""The `kevlaya` CLI: batch id alone on stdout, line-numbered errors, stdin, status JSON, export."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner
from redis import Redis

from producer.cli import cli
from tests.helpers import answer


@pytest.fixture
def run(redis_url: str, redis: Redis):
    runner = CliRunner()

    def invoke(*args: str, input: bytes | None = None):
        return runner.invoke(cli, ["--redis-url", redis_url, *args], input=input, catch_exceptions=False)

    return invoke


def jsonl(*objs: dict) -> bytes:
    return b"".join(orjson.dumps(o) + b"\n" for o in objs)


def test_submit_prints_only_the_batch_id_on_stdout(run, tmp_path: Path, redis: Redis) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(*({"custom_id": str(i), "prompt": "p"} for i in range(3))))
    res = run("submit", str(path), "--model", "laya")
    assert res.exit_code == 0
    batch = res.stdout.strip()
    assert batch and "\n" not in batch
    assert "3 enqueued" in res.stderr
    status = orjson.loads(run("status", batch, "--json").stdout)
    assert status["counts"]["total"] == 3 and status["counts"]["queued"] == 3


def test_submit_reports_every_bad_line_and_enqueues_nothing(run, redis: Redis) -> None:
    data = jsonl({"custom_id": "a", "model": "laya", "prompt": "ok"}) + b"nope\n" + jsonl({"model": "kev"})
    res = run("submit", "-", input=data)
    assert res.exit_code == 1
    assert "line 2: invalid JSON" in res.stderr
    assert "line 3: missing 'prompt'" in res.stderr
    assert res.stdout == ""
    assert redis.dbsize() == 0


def test_results_exports_in_input_order(run, redis: Redis, tmp_path: Path) -> None:
    batch = run(
        "submit", "-", "--model", "kev", input=jsonl(*({"custom_id": f"x{i}", "prompt": "p"} for i in range(3)))
    ).stdout.strip()
    for i in (2, 0, 1):
        answer(redis, batch, f"x{i}", model="kev", text=f"t{i}")
    out = tmp_path / "out.jsonl"
    assert run("results", batch, "-o", str(out)).exit_code == 0
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert [(r["custom_id"], r["text"]) for r in rows] == [("x0", "t0"), ("x1", "t1"), ("x2", "t2")]


def test_cancel_and_status_without_batch(run) -> None:
    batch = run("submit", "-", "--model", "laya", input=jsonl({"custom_id": "a", "prompt": "p"})).stdout.strip()
    assert run("cancel", batch).exit_code == 0
    status = orjson.loads(run("status", batch, "--json").stdout)
    assert status["counts"]["cancelled"] == 1 and status["complete"]
    overview = orjson.loads(run("status", "--json").stdout)
    empty = {"queued": 0, "oldest_wait_s": None}
    assert overview["queues"] == {m: {"interactive": empty, "bulk": empty} for m in ("kev", "laya")}


def test_submit_lane_option_and_status_per_lane(run, redis: Redis) -> None:
    data = jsonl({"custom_id": "a", "prompt": "p"})
    assert run("submit", "-", "--model", "laya", input=data).exit_code == 0
    assert run("submit", "-", "--model", "kev", "--lane", "interactive", input=data).exit_code == 0
    assert redis.llen("rq:queue:kevlaya:laya") == 1 and redis.llen("rq:queue:kevlaya:kev:interactive") == 1
    lines = run("status").stdout.splitlines()
    assert "queue kev/bulk: 0 queued" in lines and "queue laya/interactive: 0 queued" in lines
    assert any(line.startswith("queue kev/interactive: 1 queued, oldest waited ") for line in lines)
    assert run("submit", "-", "--lane", "urgent", input=data).exit_code == 2


def test_unknown_batch_exits_nonzero_with_message(redis_url: str, redis: Redis) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from producer.cli import main; main()", "--redis-url", redis_url, "status", "zzz"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "no batch 'zzz'" in proc.stderr


@pytest.mark.parametrize("data", [b"", b"\n\n", b"  \n\t\n"])
def test_an_empty_submission_is_refused_in_one_line_and_makes_no_batch(
    redis_url: str, redis: Redis, data: bytes
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from producer.cli import main; main()", "--redis-url", redis_url, "submit", "-"],
        input=data,
        capture_output=True,
    )
    assert proc.returncode == 1 and proc.stdout == b""
    assert proc.stderr.decode().splitlines() == [
        "error: nothing to submit: no jobs given (an empty file, or blank lines only)"
    ]
    assert redis.dbsize() == 0


def test_producer_does_not_import_torch() -> None:
    code = "import sys, producer, shared, producer.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_worker_help_names_the_fast_path_switches() -> None:
    from worker.cli import worker_command

    out = CliRunner().invoke(worker_command, ["--help"]).output
    assert "--decode" in out and "--no-compile" in out and "--pointwise-kernels" in out


def test_worker_commands_come_from_entry_points_and_hide_without_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    import producer.cli as pcli

    runner = CliRunner()
    listed = runner.invoke(cli, ["--help"]).output
    assert all(f"  {name} " in listed for name in ("worker", "train", "eval", "submit"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(pcli.importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real_find_spec(n, *a))
    listed = runner.invoke(cli, ["--help"]).output
    assert "  worker " not in listed and "  submit " in listed
    out = runner.invoke(cli, ["worker", "--config", "x.toml"])
    assert out.exit_code != 0 and "needs the worker extra: pip install 'kevlaya[worker]'" in out.output


def test_own_commands_resolve_without_reading_entry_points(run, monkeypatch: pytest.MonkeyPatch) -> None:
    """`submit` and `status` run on every call from scripts: they must not scan every installed distribution."""
    import producer.cli as pcli

    def scanned() -> dict:
        raise AssertionError("entry points read for a producer command")

    monkeypatch.setattr(pcli, "_entry_points", scanned)
    res = run("submit", "-", "--model", "laya", input=jsonl({"custom_id": "a", "prompt": "p"}))
    assert res.exit_code == 0
    assert run("status", res.stdout.strip(), "--json").exit_code == 0


def test_worker_ops_flags_reach_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`kevlaya worker --pointwise-kernels` / `--no-compile` build the engine with those ops options (the
    defaults without them)."""
    import worker.config
    import worker.engine
    from worker.cli import worker_command
    from worker.fastpath import DEFAULT_OPS, OpsOptions

    seen: list[OpsOptions] = []

    class Stop(Exception):
        pass

    def engine(*args: object, ops: OpsOptions = DEFAULT_OPS, **kwargs: object) -> None:
        seen.append(ops)
        raise Stop

    monkeypatch.setattr(worker.config, "load_config", lambda path: object())
    monkeypatch.setattr(worker.engine, "Engine", engine)
    cases = (
        (["--pointwise-kernels"], OpsOptions(pointwise_kernels=True)),
        (["--no-compile"], OpsOptions(compile_ops=False)),
        ([], DEFAULT_OPS),
    )
    for args, want in cases:
        result = CliRunner().invoke(worker_command, ["--config", str(tmp_path / "models.toml"), *args])
        assert isinstance(result.exception, Stop), result.output
        assert seen.pop() == want


def test_worker_take_ahead_follows_the_engines_device_unless_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`kevlaya worker --take-ahead auto` (the default) takes ahead where the engine runs on a GPU and not on a CPU;
    `on` / `off` set it whatever the device."""
    import torch

    import worker.config
    import worker.engine
    import worker.loop
    from worker.cli import worker_command

    seen: list[bool] = []

    class Stop(Exception):
        pass

    class Engine:
        def __init__(self, *args: object, device: str | None = None, **kwargs: object) -> None:
            self.device = torch.device(device or "cpu")

    class Worker:
        def __init__(self, redis: object, engine: object, config: object, settings: Any) -> None:
            seen.append(settings.take_ahead)
            raise Stop

    monkeypatch.setattr(worker.config, "load_config", lambda path: object())
    monkeypatch.setattr(worker.engine, "Engine", Engine)
    monkeypatch.setattr(worker.loop, "BatchWorker", Worker)
    cases = (([], False), (["--device", "cuda"], True), (["--take-ahead", "on"], True))
    cases += ((["--device", "cuda", "--take-ahead", "off"], False),)
    for args, want in cases:
        result = CliRunner().invoke(worker_command, ["--config", str(tmp_path / "models.toml"), *args])
        assert isinstance(result.exception, Stop), result.output
        assert seen.pop() is want
