"""`python -m bench timeline [bench mixed's options]`: `bench mixed` with the worker's and the CLI's host steps timed.

The worker process and every `kevlaya` CLI process it starts run with wrappers around the steps a take's host time
goes to (the loop's step, take and writes, the memory look, encoding, scoring and its prefill groups, the
submit's enqueue transactions, the CLI's imports and exit): one line per call to `<out>/timeline.log`. After the
run, each workload's lines are printed from its first `kevlaya submit` on, in milliseconds from the start of that
submit's imports (the figures a take's wall time is made of: where the GPU waits for the host, and how long).
A wrapper costs about a microsecond a call; the rows `bench mixed` appends are those of a timed worker.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

LOG_ENV = "KEVLAYA_TIMELINE_LOG"


@dataclass(frozen=True)
class Span:
    """A function timed: `owner` (a class in `module`, or '' for the module itself) and its `name`; `sized`: the
    position (self included) of the argument whose length the line records (its rows, a group's chunks)."""

    module: str
    owner: str
    name: str
    label: str
    sized: int | None = None


WORKER_SPANS = (
    Span("worker.loop", "BatchWorker", "_step", "step"),
    Span("worker.loop", "BatchWorker", "_take", "take"),
    Span("worker.loop", "BatchWorker", "_take_ahead", "take_ahead"),
    Span("worker.engine", "Engine", "prepare", "prepare", sized=1),
    Span("worker.loop", "BatchWorker", "_write", "write", sized=1),
    Span("worker.rqcompat.bridge", "RQBridge", "queue_facts", "queue_facts"),
    Span("worker.planner", "MemoryBudget", "refresh", "memory_look"),
    Span("worker.engine", "Engine", "capacity", "capacity"),
    Span("worker.engine", "Engine", "run", "engine_run", sized=1),
    Span("worker.prompts", "Encoder", "encode_many", "encode", sized=1),
    Span("worker.settle", "Settler", "triage", "triage", sized=1),
    Span("worker.settle", "Settler", "results", "results", sized=2),
    Span("worker.engine", "", "score_static", "score", sized=2),
    Span("worker.engine", "", "generate_static", "generate", sized=2),
    Span("worker.fastpath.prefill", "Prefill", "_group", "prefill_group", sized=4),
    Span("worker.fastpath.prefill", "Prefill", "_chunk", "prefill_chunk", sized=2),
)
CLI_SPANS = (Span("producer.client", "Client", "_enqueue_chunk", "enqueue_chunk", sized=2),)


@dataclass(frozen=True)
class Line:
    label: str
    start_s: float  # epoch seconds
    ms: float
    note: str = ""


def install(spans: tuple[Span, ...], log: TextIO) -> None:
    """Wrap every span's function: each call writes one line (label, start, milliseconds, and the length of its
    `sized` argument)."""
    for span in spans:
        module = importlib.import_module(span.module)
        owner: Any = getattr(module, span.owner) if span.owner else module
        original = getattr(owner, span.name)
        setattr(owner, span.name, _timed(original, span, log))


def _timed(fn: Callable[..., Any], span: Span, log: TextIO) -> Callable[..., Any]:
    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start, began = time.time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sized = len(args[span.sized]) if span.sized is not None and len(args) > span.sized else ""
            # The helper thread's calls (worker.ahead) run beside the loop's: marked so.
            label = span.label if threading.current_thread() is threading.main_thread() else f"{span.label}@ahead"
            log.write(f"{label} {start:.4f} {(time.perf_counter() - began) * 1000:.2f} {sized}\n")

    return timed


def child(role: str) -> None:
    """A timed `kevlaya` process (`role`: worker or cli), its log from `LOG_ENV`."""
    started = time.time()
    log = open(os.environ[LOG_ENV], "a", buffering=1)  # noqa: SIM115 -- open for the process's whole life
    sys.argv = ["kevlaya", *sys.argv[1:]]
    from producer.cli import cli, main

    command = sys.argv[3] if len(sys.argv) > 3 else ""
    if role == "worker":
        from worker.cli import worker_command

        cli.add_command(worker_command)
        install(WORKER_SPANS, log)
    else:
        install(CLI_SPANS, log)
        log.write(f"cli_imports {started:.4f} {(time.time() - started) * 1000:.2f} {command}\n")
        import atexit

        atexit.register(lambda: log.write(f"cli_exit {time.time():.4f} 0 {command}\n"))
    main()


def read(path: Path) -> list[Line]:
    out = []
    for raw in path.read_text().splitlines():
        parts = raw.split()
        if len(parts) >= 3:
            out.append(Line(parts[0], float(parts[1]), float(parts[2]), parts[3] if len(parts) > 3 else ""))
    return sorted(out, key=lambda line: line.start_s)


def workload_lines(lines: list[Line], marks: dict[str, tuple[float, float]]) -> Iterator[tuple[str, list[Line]]]:
    """Each workload's lines, from its first submit's imports to the end of its run, the idle loop's waiting
    steps (a poll interval each) left out."""
    for name, (begin, end) in marks.items():
        submits = [x.start_s for x in lines if x.label == "cli_imports" and x.note == "submit" and x.start_s >= begin]
        origin = min(submits, default=begin)
        yield (
            name,
            [
                Line(x.label, (x.start_s - origin) * 1000, x.ms, x.note)
                for x in lines
                if begin <= x.start_s <= end and not (x.label == "step" and x.ms >= 50)
            ],
        )


def main(argv: list[str] | None = None) -> None:
    import bench.mixed as mixed

    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__.strip(), end="\n\nbench mixed's options, which it takes:\n\n")
    out = Path(args[args.index("--out") + 1] if "--out" in args else "bench/out")
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "timeline.log"
    log_path.unlink(missing_ok=True)
    os.environ[LOG_ENV] = str(log_path)
    mixed.WORKER_CMD = [sys.executable, "-c", "from bench.timeline import child; child('worker')"]
    mixed.KEVLAYA = [sys.executable, "-c", "from bench.timeline import child; child('cli')"]
    marks: dict[str, tuple[float, float]] = {}
    run = mixed.run_workload

    def marked(name: str, jobs: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        begin = time.time()
        try:
            return run(name, jobs, **kwargs)
        finally:
            marks[name] = (begin, time.time())

    mixed.run_workload = marked
    mixed.main(args)
    for name, lines in workload_lines(read(log_path), marks):
        print(f"== {name}: ms from the submit's start, label, ms, rows")
        for x in lines:
            print(f"{x.start_s:9.1f} {x.label:16s} {x.ms:9.2f} {x.note}")


if __name__ == "__main__":
    main()
