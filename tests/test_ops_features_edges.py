"""Operator edges of `worker --gpus`, `schedule` and completion notices that the feature tests left open: GPU
lists CUDA cannot read, a signal while a child is being spawned, output templates and cadences that only
failed (with a traceback) once the scheduler ran, and a notify URL whose answer is not HTTP."""

from __future__ import annotations

import http.server
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from producer.cli import cli
from producer.schedule import Cadence, ScheduleSpec
from shared.errors import ConfigError, ValidationError
from worker.notices import _post
from worker.supervisor import ChildSpec, Supervisor, SupervisorSettings, parse_gpus


# ---- --gpus --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "visible"),
    [
        ("-1", None),  # CUDA_VISIBLE_DEVICES=-1 hides every GPU: the child crashed through its restarts
        ("a", None),  # not an index nor a GPU-/MIG- UUID: CUDA stops reading there, same crash loop
        ("all,0", None),
        ("0,-1", None),
        ("0,00", None),  # both are GPU 0: two workers on one card
        ("1,01", "4,6"),
        ("0,GPU-a", "GPU-a,GPU-b"),  # index 0 stands for GPU-a
    ],
)
def test_parse_gpus_refuses_what_cuda_cannot_read_or_names_twice(text: str, visible: str | None) -> None:
    with pytest.raises(ConfigError):
        parse_gpus(text, visible=visible, count=lambda: 2)


def test_parse_gpus_still_takes_uuids_and_canonical_indices() -> None:
    assert parse_gpus("GPU-5f2a,MIG-77,00", count=lambda: 0) == ["GPU-5f2a", "MIG-77", "0"]


SLEEPER = r"""
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    time.sleep(0.05)
"""


def test_a_signal_while_a_child_is_spawned_reaches_that_child_too(tmp_path: Path) -> None:
    """The forward went to the children already in `procs`; one being spawned at that moment never got it, and
    the parent waited on it forever."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    children = [ChildSpec(gpu=str(i), name=f"w{i}", argv=[sys.executable, str(script)]) for i in range(2)]
    started: list[subprocess.Popen[bytes]] = []

    def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        if len(started) == 1:
            sup.on_signal(15)  # SIGTERM arrives while the second child is being started
        started.append(subprocess.Popen(argv, **kwargs))
        return started[-1]

    sup = Supervisor(children, SupervisorSettings(poll_s=0.05), spawn=spawn)
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    runner.start()
    runner.join(timeout=10)
    for proc in started:
        proc.kill()
        proc.wait()
    assert result == [0]


# ---- schedule ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("output", ["out/{date.year}.jsonl", "out/{name.__class__}.jsonl", "{date!r}", "{slot[0]}"])
def test_an_output_template_with_attribute_index_or_conversion_is_refused(output: str) -> None:
    with pytest.raises(ValidationError):
        ScheduleSpec(name="n", every_s=60, inputs=("in/*.jsonl",), output=output)


@pytest.mark.parametrize(("cron", "every_s"), [("0 0 30 2 *", None), (None, 99999999 * 86400)])
def test_a_cadence_that_names_no_slot_is_refused(cron: str | None, every_s: int | None) -> None:
    with pytest.raises(ValidationError):
        Cadence(cron=cron, every_s=every_s)


@pytest.mark.parametrize(
    "args",
    [["--every", "1h", "--output", "o/{date.year}.jsonl"], ["--cron", "0 0 30 2 *", "--output", "o.jsonl"]],
)
def test_schedule_refuses_them_in_one_line(redis_url: str, args: list[str]) -> None:
    result = CliRunner().invoke(
        cli, ["--redis-url", redis_url, "schedule", "--input", "in/*.jsonl", "--name", "edge", *args]
    )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, (AttributeError, ValueError))


# ---- notices -------------------------------------------------------------------------------------------------
@pytest.fixture
def not_http() -> Iterator[str]:
    """An allowed endpoint that answers something that is not HTTP (a proxy mid-restart, a wrong port)."""

    class Garbage(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            self.rfile.readline()
            self.wfile.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()


@pytest.fixture
def many_headers() -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(200)
            for i in range(150):  # http.client refuses more than 100
                self.send_header(f"X-{i}", "x")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/hook"
    server.shutdown()
    server.server_close()


def test_an_answer_that_is_not_http_is_a_failed_try_not_a_dropped_notice(not_http: str, many_headers: str) -> None:
    """http.client's HTTPException is no OSError: it escaped _post, and the notice was dropped at once, without
    the documented five tries."""
    assert _post(not_http, b"{}") is False
    assert _post(many_headers, b"{}") is False
