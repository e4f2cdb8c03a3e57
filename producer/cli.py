"""The `kevlaya` command line. It only parses arguments and delegates to the client (or the worker)."""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any

import click
import orjson
from tqdm import tqdm

from producer.client import Client
from producer.jsonl import parse_lines
from shared.errors import BatchNotFoundError, KevlayaError, SubmissionError
from shared.keys import DEFAULT_PREFIX
from shared.models import MODEL_NAMES

# Worker-side commands live in worker.cli and are imported only when called, so a producer-only
# install (no torch) still has a working `kevlaya submit/status/results/cancel`.
_LAZY_COMMANDS = {
    "worker": "worker.cli:worker_command",
    "memory": "worker.cli:memory_command",
    "demo": "worker.cli:demo_command",
    "demo-models": "worker.cli:demo_models_command",
    "train": "worker.cli:train_command",
    "eval": "worker.cli:eval_command",
    "calibrate": "worker.cli:calibrate_command",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in _LAZY_COMMANDS:
            return super().get_command(ctx, name)
        module, attr = _LAZY_COMMANDS[name].split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise click.ClickException(
                f"'kevlaya {name}' needs the worker extra: pip install 'kevlaya[worker]' ({exc})"
            ) from exc


@click.group(cls=_LazyGroup)
@click.option(
    "--redis-url",
    envvar="REDIS_URL",
    default=None,
    help="redis://[user:pass@]host:port/db or rediss://… (env REDIS_URL; default localhost:6379/0)",
)
@click.option("--prefix", default=DEFAULT_PREFIX, show_default=True, help="Prefix of every kevlaya key in Redis.")
@click.pass_context
def cli(ctx: click.Context, redis_url: str | None, prefix: str) -> None:
    """kevlaya: queue-driven batch worker for the Kev and Laya decision models."""
    ctx.obj = {"redis_url": redis_url, "prefix": prefix}


def _client(ctx: click.Context) -> Client:
    return Client(redis_url=ctx.obj["redis_url"], prefix=ctx.obj["prefix"])


@cli.command()
@click.argument("file", type=click.File("rb"))
@click.option("--model", type=click.Choice(MODEL_NAMES), default=None, help="Model for lines that name none.")
@click.option("--batch-id", default=None, help="Add to (or resubmit into) this batch; known items are skipped.")
@click.option("--wait", is_flag=True, help="Show a progress bar until every item is answered.")
@click.option("--no-escalate", is_flag=True, help="Never escalate Laya answers to Kev in this batch.")
@click.pass_context
def submit(
    ctx: click.Context, file: Any, model: str | None, batch_id: str | None, wait: bool, no_escalate: bool
) -> None:
    """Validate FILE (JSONL, or - for stdin) completely, then enqueue it. Prints the batch id on stdout."""
    try:
        jobs = parse_lines(file, default_model=model, escalate=False if no_escalate else None)
    except SubmissionError as exc:
        for err in exc.errors:
            click.echo(str(err), err=True)
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    client = _client(ctx)
    with tqdm(total=len(jobs), desc="enqueue", unit="job", file=sys.stderr, disable=len(jobs) < 5000 or None) as bar:
        handle = client.submit_batch(
            jobs, batch_id=batch_id, escalate=not no_escalate, progress=lambda n: bar.update(n - bar.n)
        )
    click.echo(f"batch {handle.id}: {handle.enqueued} enqueued, {handle.skipped} already present", err=True)
    click.echo(handle.id)
    if wait:
        record = _wait_with_bar(client, handle.id)
        sys.exit(0 if record.counts.failed == 0 else 2)


def _wait_with_bar(client: Client, batch: str) -> Any:
    record = client.status(batch)
    with tqdm(total=record.counts.total, desc=batch, unit="item", file=sys.stderr) as bar:

        def update(rec: Any) -> None:
            bar.update(rec.counts.done - bar.n)
            bar.set_postfix(running=rec.counts.running, failed=rec.counts.failed, escalated=rec.counts.escalated)

        return client.wait(batch, on_poll=update)


@cli.command()
@click.argument("batch", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with a `counts` object).")
@click.option("--wait", is_flag=True, help="Show a progress bar until the batch is complete.")
@click.pass_context
def status(ctx: click.Context, batch: str | None, as_json: bool, wait: bool) -> None:
    """Counts, rate and ETA of BATCH; without BATCH, queue depths per model and the workers seen."""
    client = _client(ctx)
    if batch is None:
        info = client.overview()
        if as_json:
            click.echo(orjson.dumps(info).decode())
            return
        for name, depth in info["queues"].items():
            click.echo(f"queue {name}: {depth} queued")
        click.echo(f"workers seen (last 60 s): {len(info['workers'])}")
        for w in info["workers"]:
            click.echo(f"  {w['name']} (heartbeat {w['last_seen_s']} s ago)")
        return
    record = _wait_with_bar(client, batch) if wait else client.status(batch)
    data = record.to_dict(time.time())
    if as_json:
        click.echo(orjson.dumps(data).decode())
        return
    c = data["counts"]
    click.echo(
        f"batch {batch}: {c['finished']}/{c['total']} finished, {c['failed']} failed, {c['cancelled']} cancelled, "
        f"{c['running']} running, {c['queued']} queued, {c['escalated']} escalated"
    )
    rate, eta = data["rate_per_s"], data["eta_s"]
    if rate is not None:
        click.echo(f"rate {rate:.1f} items/s" + (f", ETA {eta:.0f} s" if eta and not record.complete else ""))
    if record.complete:
        click.echo("complete")


@cli.command()
@click.argument("batch")
@click.option("-o", "--output", type=click.File("wb"), default="-", help="Write JSONL here (default stdout).")
@click.pass_context
def results(ctx: click.Context, batch: str, output: Any) -> None:
    """Export one JSON line per item of BATCH, in input order: its final answer or its error."""
    pending = 0
    for row in _client(ctx).iter_results(batch):
        pending += bool(row.get("pending"))
        output.write(orjson.dumps(row) + b"\n")
    if pending:
        click.echo(f"note: {pending} item(s) still pending", err=True)


@cli.command()
@click.argument("batch")
@click.pass_context
def cancel(ctx: click.Context, batch: str) -> None:
    """Cancel the queued items of BATCH; items already running are allowed to finish."""
    n = _client(ctx).cancel(batch)
    click.echo(f"cancelled {n} queued item(s) of {batch}", err=True)


def main() -> None:
    try:
        cli(standalone_mode=True)
    except BatchNotFoundError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KevlayaError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
