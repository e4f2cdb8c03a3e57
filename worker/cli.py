"""Worker-side commands of `kevlaya` (loaded lazily by producer.cli): worker, memory, demo, demo-models."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from shared.conn import connect
from shared.errors import KevlayaError
from shared.keys import DEFAULT_PREFIX
from worker.memory import parse_bytes


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@click.command("worker")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="models.toml")
@click.option("--burst", is_flag=True, help="Exit when nothing is queued or recoverable.")
@click.option("--memory-budget", default=None, help="GPU memory budget that sizes batches, e.g. 6GiB.")
@click.option(
    "--max-wait-ms",
    default=2000,
    show_default=True,
    help="Switch models once the other queue's oldest job waited this long.",
)
@click.option("--max-batch-rows", default=256, show_default=True, help="Upper bound on rows per batch.")
@click.option("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available).")
@click.option("--no-mixed-tails", is_flag=True, help="Never mix Kev and Laya rows in one batch.")
@click.option("--name", default=None, help="Worker name (default: host + random suffix).")
@click.option(
    "--job-heartbeat-ttl-s",
    default=20.0,
    show_default=True,
    help="A running job whose heartbeat is older than this is taken back from a dead worker.",
)
@click.option("--log-level", default="info", show_default=True)
@click.pass_context
def worker_command(
    ctx: click.Context,
    config_path: str,
    burst: bool,
    memory_budget: str | None,
    max_wait_ms: int,
    max_batch_rows: int,
    device: str | None,
    no_mixed_tails: bool,
    name: str | None,
    job_heartbeat_ttl_s: float,
    log_level: str,
) -> None:
    """Run the batch worker: load the models once, then drain the Kev and Laya queues in batches."""
    from worker.batch_worker import BatchWorker, WorkerSettings
    from worker.config import load_config
    from worker.engine import Engine

    _setup_logging(log_level)
    obj = ctx.obj or {}
    try:
        config = load_config(config_path)
        budget = parse_bytes(memory_budget) if memory_budget else None
        engine = Engine(config, device=device, memory_budget_bytes=budget, max_batch_rows=max_batch_rows)
    except KevlayaError as exc:
        raise click.ClickException(str(exc)) from exc
    settings = WorkerSettings(
        burst=burst,
        max_wait_ms=max_wait_ms,
        mixed_tails=not no_mixed_tails,
        name=name,
        prefix=obj.get("prefix", DEFAULT_PREFIX),
        job_heartbeat_ttl_s=job_heartbeat_ttl_s,
        heartbeat_interval_s=min(3.0, job_heartbeat_ttl_s / 4),
        worker_ttl_s=max(2, int(job_heartbeat_ttl_s)),
    )
    BatchWorker(connect(obj.get("redis_url"), socket_timeout_s=60), engine, settings).work()


@click.command("memory")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
@click.option("--memory-budget", default="6GiB", show_default=True)
@click.option("--device", default=None)
def memory_command(config_path: str, memory_budget: str, device: str | None) -> None:
    """Print the seed's memory table (after 4-bit load, after adapters, inference at 512/1024 tokens)
    and the batch plan: measured on a GPU, estimated on CPU (the output says which)."""
    from worker.memory_report import memory_table

    try:
        click.echo(memory_table(config_path, budget_bytes=parse_bytes(memory_budget), device=device))
    except KevlayaError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command("demo")
@click.option("--out", default=".kevlaya/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--items", default=1000, show_default=True, help="How many decisions to submit.")
@click.pass_context
def demo_command(ctx: click.Context, out: str, items: int) -> None:
    """End to end on embedded defaults: Redis (started if none), demo models, submit, drain, summary."""
    from worker.demo import run_demo

    _setup_logging("warning")
    run_demo(Path(out), items=items, redis_url=(ctx.obj or {}).get("redis_url"))


@click.command("demo-models")
@click.option("--out", default=".kevlaya/demo", show_default=True, type=click.Path(file_okay=False))
def demo_models_command(out: str) -> None:
    """Build (or reuse) the demo models and write OUT/models.toml."""
    from worker.demo import prepare_models

    click.echo(str(prepare_models(Path(out))))
