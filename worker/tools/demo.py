"""`kevlaya demo`: the main job end to end on embedded defaults.

Redis (the one named by $REDIS_URL, else a private redis-server), the demo models (built once,
cached under .kevlaya/demo), ~1,000 bundled decisions submitted as one batch, the batch worker draining
it with a progress bar, a summary, and the results JSONL.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import click
import orjson
from redis import Redis
from tqdm import tqdm

from producer.client import Client
from producer.jsonl import parse_lines
from shared.conn import redacted
from shared.conn import redis_url as resolve_url
from worker.config import load_config
from worker.engine import Engine
from worker.loop import BatchWorker
from worker.settings import WorkerSettings, take_ahead_on
from worker.tools.demo_models import build_demo_models
from worker.tools.embedded_redis import EmbeddedRedis
from worker.tools.evaluate import EXPERT, SCREEN

DEMO_DATA = Path(__file__).resolve().parent.parent / "data" / "demo_decisions.jsonl"


def prepare_models(out: Path, *, seed: int = 0) -> Path:
    """The trained, calibrated demo models and a ready config at OUT/models.toml (cached: built once)."""
    return build_demo_models(out.resolve(), seed=seed)


@contextlib.contextmanager
def demo_redis(url: str | None) -> Iterator[str]:
    """The Redis named by --redis-url or REDIS_URL (it must answer); otherwise a private redis-server for the
    demo's lifetime, so the demo never writes into a Redis nobody named."""
    if url:
        if not _answers(resolve_url(url)):
            raise click.ClickException(f"no Redis answers at {redacted(url)}; unset REDIS_URL to use a private one")
        yield url
        return
    click.echo("starting a private redis-server for the demo (set REDIS_URL to use yours)", err=True)
    with EmbeddedRedis() as server:
        yield server.url


def _answers(url: str) -> bool:
    try:
        return bool(Redis.from_url(url, socket_connect_timeout=1).ping())
    except Exception:
        return False


def bundled_lines(items: int) -> list[bytes]:
    data = DEMO_DATA.read_bytes().splitlines()
    if items <= len(data):
        return data[:items]
    return [data[i % len(data)].replace(b'"loan-', f'"r{i // len(data)}-loan-'.encode()) for i in range(items)]


def run_demo(out: Path, *, items: int, redis_url: str | None) -> None:
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    click.echo("preparing demo models ...", err=True)
    config_path = prepare_models(out)
    with demo_redis(redis_url) as url:
        redis = Redis.from_url(url)
        engine = Engine(load_config(config_path))
        client = Client(redis=redis)
        handle = client.submit_batch(parse_lines(bundled_lines(items)))
        click.echo(f"submitted {handle.enqueued} decisions as batch {handle.id}", err=True)
        settings = WorkerSettings(name=f"demo-{handle.id}", take_ahead=take_ahead_on(engine.device.type))
        worker = BatchWorker(redis, engine, engine.config, settings)
        thread = threading.Thread(target=worker.work, daemon=True)
        t0 = time.time()
        thread.start()
        with tqdm(total=handle.enqueued, desc="decisions", unit="item", file=sys.stderr) as bar:
            record = client.wait(handle.id, poll_s=0.25, on_poll=lambda r: bar.update(r.counts.done - bar.n))
        elapsed = time.time() - t0
        worker.request_stop()
        thread.join(timeout=60)
        results_path = out / "results.jsonl"
        with results_path.open("wb") as fh:
            for row in client.iter_results(handle.id):
                fh.write(orjson.dumps(row) + b"\n")
    _summary(record, worker, elapsed, time.time() - started, results_path, config_path)


def cascade_rows(figures: dict) -> list[tuple[str, str]]:
    """The held-out figures of the build (DIR/cascade.json): three accuracies, escalation, calibration."""
    c, cal = figures["cascade"], figures["calibration"]
    fit, chk = cal["fit"], cal["check"]
    return [
        (f"{SCREEN} alone", f"{figures[SCREEN]['accuracy']:.3f} on {figures['items']} held-out cases"),
        (f"{EXPERT} alone", f"{figures[EXPERT]['accuracy']:.3f}"),
        (
            "cascade",
            f"{c['accuracy']:.3f}, escalating {c['escalation_rate']:.1%} "
            f"(threshold {c['threshold']}, picked for a {figures['target']['value']:.0%} budget)",
        ),
        *_check_rows(figures.get("check")),
        (
            f"{SCREEN} calibration",
            f"ECE {fit['ece_before']:.3f} -> {fit['ece_after']:.3f} on the fitting split, "
            f"{chk['ece_before']:.3f} -> {chk['ece_after']:.3f} on a second split ({chk['items']} cases, "
            f"not fitted on); {cal['method']}{_temperature(cal)}",
        ),
    ]


def _check_rows(check: dict | None) -> list[tuple[str, str]]:
    """The second held-out split at the same threshold (neither the calibration nor the threshold saw it)."""
    if not check:
        return []
    c = check["cascade"]
    return [
        (
            "second split",
            f"{SCREEN} {check[SCREEN]['accuracy']:.3f}, {EXPERT} {check[EXPERT]['accuracy']:.3f}, cascade "
            f"{c['accuracy']:.3f} escalating {c['escalation_rate']:.1%} ({check['items']} cases, same threshold)",
        )
    ]


def _temperature(cal: dict) -> str:
    return f", T = {cal['temperature']:.2f}" if cal["method"] == "temperature" else ""


def answers_row(results: Path) -> tuple[str, str]:
    """How many of the demo batch's final answers match the label the bundled items carry in `meta`."""
    rows = [orjson.loads(line) for line in results.read_bytes().splitlines() if line.strip()]
    labelled = [r for r in rows if isinstance(r.get("meta"), dict) and r["meta"].get("label")]
    right = sum((r.get("decision") or "").strip().lower() == r["meta"]["label"] for r in labelled)
    return "final answers", f"{right} of {len(labelled)} right ({right / max(len(labelled), 1):.1%})"


def _summary(record, worker: BatchWorker, elapsed: float, total: float, results: Path, config: Path) -> None:
    s, c = worker.stats, record.counts
    figures_path = config.parent / "cascade.json"
    figures = cascade_rows(orjson.loads(figures_path.read_bytes())) if figures_path.is_file() else []
    rows = [
        ("decisions", f"{c.total} ({c.finished} answered, {c.failed} failed)"),
        ("drain time", f"{elapsed:.1f} s ({c.total / max(elapsed, 1e-9):.1f} decisions/s)"),
        ("batches", f"{s.batches} (sizes: {dict(sorted(s.batch_sizes.items()))})"),
        ("model switches", str(s.switches)),
        ("escalations", f"{c.escalated} Laya answers escalated to Kev"),
        answers_row(results),
        (
            "generated tokens",
            f"{s.generated_tokens} ({s.generated_tokens / max(s.engine_s, 1e-9):.0f} tok/s in engine)",
        ),
        (
            "peak memory",
            f"{s.peak_memory_bytes / 2**20:.0f} MiB ({_memory_kind(worker)})",
        ),
        *figures,
        ("results", str(results)),
        ("config", f"{config} (kevlaya worker --config {config})"),
        ("total", f"{total:.1f} s"),
    ]
    click.echo("\nkevlaya demo summary")
    for key, value in rows:
        click.echo(f"  {key:<18} {value}")


def _memory_kind(worker: BatchWorker) -> str:
    device = getattr(worker.engine, "device", None)
    return "GPU, allocated" if device is not None and device.type == "cuda" else "process peak RSS, CPU"
