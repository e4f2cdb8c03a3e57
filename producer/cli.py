"""The `kevlaya` command line. It only parses arguments and delegates to the client (or the worker)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, BinaryIO

import click
import orjson
from redis import exceptions as redis_exceptions

from producer.client import DEFAULT_COMPLETION_WINDOW_S, Client
from producer.jsonl import parse_lines, read_lines, written_whole
from producer.openai_format import CHAT_URL, COMPLETIONS_URL, parse_model_map, to_openai
from shared.conn import redis_problem
from shared.errors import (
    EXIT_INCOMPLETE,
    EXIT_ITEMS_FAILED,
    EXIT_OK,
    EXIT_REDIS,
    EXIT_USAGE,
    KevlayaError,
    StoreError,
    SubmissionError,
    WaitTimeoutError,
)
from shared.keys import BULK, DEFAULT_PREFIX, LANES
from shared.models import MODEL_NAMES
from shared.wrongtype import is_wrong_type

# Commands of other parts of the distribution (the worker's: worker, memory, train, eval, demo...) are
# registered as `kevlaya.commands` entry points and imported only when called: the producer names no worker
# module, and an install without the worker extra lists only the commands it can run.
COMMAND_GROUP = "kevlaya.commands"


def _entry_points() -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def _installed(ep: EntryPoint) -> bool:
    """Whether what the command's extra brings is importable (the worker extra: torch)."""
    return "worker" not in ep.extras or importlib.util.find_spec("torch") is not None


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        plugins = [name for name, ep in _entry_points().items() if _installed(ep)]
        return sorted([*super().list_commands(ctx), *plugins])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        # The producer's own commands first: reading every installed distribution's entry points costs each
        # `kevlaya submit` and `status` milliseconds to tens of them on a large environment.
        own = super().get_command(ctx, name)
        if own is not None:
            return own
        ep = _entry_points().get(name)
        if ep is None:
            return None
        hint = f"'kevlaya {name}' needs the worker extra: pip install 'kevlaya[worker]'"
        if not _installed(ep):
            raise click.ClickException(hint)
        try:
            return ep.load()
        except ImportError as exc:
            raise click.ClickException(f"{hint} ({exc})") from exc


def _bar(**kwargs: Any) -> Any:
    """A tqdm progress bar on stderr (imported here: most commands show none)."""
    from tqdm import tqdm

    return tqdm(file=sys.stderr, **kwargs)


class Seconds(click.ParamType):
    """A number of seconds: finite and not negative, or (`positive`) above 0. click's FloatRange lets NaN
    through (no comparison with it is true): `--timeout nan` waited forever."""

    name = "seconds"

    def __init__(self, *, positive: bool = False) -> None:
        self.positive = positive

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 0 or (self.positive and seconds == 0):
            self.fail(
                f"{value!r}: give a {'positive' if self.positive else 'non-negative'} number of seconds", param, ctx
            )
        return seconds


def expires_in_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`--expires-in` (a batch's completion window, as `expires_in_s`), for each command that submits."""
    return click.option(
        "--expires-in",
        "expires_in_s",
        type=Seconds(positive=True),
        default=DEFAULT_COMPLETION_WINDOW_S,
        show_default=True,
        help=help_text,
    )


def key_prefix(ctx: click.Context, param: click.Parameter, prefix: str) -> str:
    """The --prefix given, refused in one line when empty or blank: kevlaya's keys (`batches`, `events`, `notices`,
    `schedules`, queues named after the bare model) would then sit among every other program's keys in the
    database, where a flush or a clash of names is some other writer's to make."""
    if not prefix.strip():
        raise click.ClickException(
            f"--prefix {prefix!r}: give a non-empty prefix, e.g. {DEFAULT_PREFIX!r} (the default)"
        )
    return prefix


@click.group(cls=_LazyGroup)
@click.version_option(package_name="kevlaya", message="kevlaya %(version)s")
@click.option(
    "--redis-url",
    envvar="REDIS_URL",
    default=None,
    help="redis://[user:pass@]host:port/db, rediss://… or redis+sentinel://[user:pass@]host:port[,host:port]"
    "/service[/db] (env REDIS_URL; default localhost:6379/0)",
)
@click.option(
    "--prefix",
    default=DEFAULT_PREFIX,
    show_default=True,
    callback=key_prefix,
    help="Prefix of every kevlaya key in Redis (not empty).",
)
@click.pass_context
def cli(ctx: click.Context, redis_url: str | None, prefix: str) -> None:
    """kevlaya: queue-driven batch worker for the Kev and Laya decision models."""
    ctx.obj = {"redis_url": redis_url, "prefix": prefix}
    _CONTEXT["redis_url"] = redis_url


_CONTEXT: dict[str, str | None] = {}  # what main() needs to name the Redis an error came from


def _client(ctx: click.Context) -> Client:
    return Client(redis_url=ctx.obj["redis_url"], prefix=ctx.obj["prefix"])


class InputFile(click.File):
    """A file read as bytes, `-` for stdin. click raises a bare RuntimeError (a traceback) for `-` when the
    process has no stdin (`kevlaya submit - <&-`): refused in one line instead."""

    def __init__(self) -> None:
        super().__init__("rb")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "-" and sys.stdin is None:
            self.fail("stdin is closed: pipe the lines in, or give a FILE", param, ctx)
        return super().convert(value, param, ctx)


@cli.command()
@click.argument("file", type=InputFile())
@click.option("--model", type=click.Choice(MODEL_NAMES), default=None, help="Model for lines that name none.")
@click.option("--batch-id", default=None, help="Add to (or resubmit into) this batch; known items are skipped.")
@click.option("--wait", is_flag=True, help="Show a progress bar until every item is answered.")
@click.option(
    "--timeout", "timeout_s", type=Seconds(), default=None, help="With --wait: give up after this many seconds."
)
@click.option("--no-escalate", is_flag=True, help="Never escalate Laya answers to Kev in this batch.")
@click.option("--model-map", default=None, help="OpenAI model names to kevlaya models: gpt-4o-mini=laya,gpt-4o=kev.")
@click.option(
    "--notify-url", default=None, help="POST the batch's status here when it finishes (workers allowlist it)."
)
@click.option(
    "--lane",
    type=click.Choice(LANES),
    default=BULK,
    show_default=True,
    help="Priority lane of items that name none: interactive work is taken before bulk.",
)
@expires_in_option("Completion window in seconds: items still queued after it end as `expired` and never run.")
@click.pass_context
def submit(
    ctx: click.Context,
    file: Any,
    model: str | None,
    batch_id: str | None,
    wait: bool,
    timeout_s: float | None,
    no_escalate: bool,
    model_map: str | None,
    notify_url: str | None,
    lane: str,
    expires_in_s: float,
) -> None:
    """Validate FILE (JSONL, or - for stdin) completely, then enqueue it. Prints the batch id on stdout."""
    try:
        jobs = parse_lines(
            read_lines(file),
            default_model=model,
            escalate=False if no_escalate else None,
            model_map=parse_model_map(model_map),
        )
    except SubmissionError as exc:
        for err in exc.errors:
            click.echo(str(err), err=True)
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except OSError as exc:  # a read that fails part-way (EIO on a failing disk or network mount): nothing enqueued
        raise click.ClickException(f"cannot read {file.name}: {exc.strerror or exc}; nothing enqueued") from exc
    client = _client(ctx)
    with _bar(total=len(jobs), desc="enqueue", unit="job", disable=len(jobs) < 5000 or None) as bar:
        handle = client.submit_batch(
            jobs,
            batch_id=batch_id,
            escalate=not no_escalate,
            progress=lambda n: bar.update(n - bar.n),
            completion_window_s=expires_in_s,
            notify_url=notify_url,
            lane=lane,
        )
    click.echo(f"batch {handle.id}: {handle.enqueued} enqueued, {handle.skipped} already present", err=True)
    click.echo(handle.id)
    if wait:
        record = _wait_with_bar(client, handle.id, timeout_s)
        sys.exit(EXIT_OK if record.counts.failed == 0 else EXIT_ITEMS_FAILED)


NO_WORKER_WARN_S = 60.0


def _wait_with_bar(client: Client, batch: str, timeout_s: float | None = None) -> Any:
    """A progress bar until the batch completes; a warning when no worker has been seen for a minute."""
    record = client.status(batch)
    started, warned = time.monotonic(), False
    with _bar(total=record.counts.total, desc=batch, unit="item") as bar:

        def update(rec: Any) -> None:
            nonlocal warned
            bar.update(rec.counts.done - bar.n)
            bar.set_postfix(running=rec.counts.running, failed=rec.counts.failed, escalated=rec.counts.escalated)
            waited = time.monotonic() - started
            if not warned and waited >= NO_WORKER_WARN_S and not client.workers_seen(NO_WORKER_WARN_S):
                warned = True
                bar.write("warning: no kevlaya worker has been seen for a minute; is one running?", file=sys.stderr)

        return client.wait(batch, on_poll=update, timeout_s=timeout_s)


@cli.command()
@click.argument("batch", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with a `counts` object).")
@click.option("--wait", is_flag=True, help="Show a progress bar until the batch is complete.")
@click.option(
    "--timeout", "timeout_s", type=Seconds(), default=None, help="With --wait: give up after this many seconds."
)
@click.pass_context
def status(ctx: click.Context, batch: str | None, as_json: bool, wait: bool, timeout_s: float | None) -> None:
    """Counts, rate and ETA of BATCH; without BATCH, per model and lane the jobs queued and the oldest one's
    wait, and the workers seen."""
    client = _client(ctx)
    if batch is None:
        info = client.overview()
        if as_json:
            click.echo(orjson.dumps(info).decode())
            return
        for model, lanes in info["queues"].items():
            for lane, q in lanes.items():
                wait = q["oldest_wait_s"]
                oldest = f", oldest waited {wait:.1f} s" if wait is not None else ""
                click.echo(f"queue {model}/{lane}: {q['queued']} queued{oldest}")
        click.echo(f"workers seen (last 60 s): {len(info['workers'])}")
        for w in info["workers"]:
            counted = ", ".join(f"{k.replace('_', ' ')} {w[k]}" for k in ("jobs", "out_of_memory") if k in w)
            click.echo(f"  {w['name']} (heartbeat {w['last_seen_s']} s ago{'; ' + counted if counted else ''})")
        quarantine = info["quarantine"]
        if quarantine["total"]:
            click.echo(f"quarantined (unreadable entries moved aside by workers): {quarantine['total']}")
            for q in quarantine["recent"]:
                click.echo(f"  {q.get('where')}: {q.get('reason')} -- {q.get('entry')}")
        return
    record = _wait_with_bar(client, batch, timeout_s) if wait else client.status(batch)
    data = record.to_dict(time.time())
    if as_json:
        click.echo(orjson.dumps(data).decode())
        return
    c = data["counts"]
    click.echo(
        f"batch {batch} [{data['status']}]: {c['finished']}/{c['total']} finished, {c['failed']} failed, "
        f"{c['cancelled']} cancelled, {c['expired']} expired, {c['running']} running, {c['queued']} queued, "
        f"{c['escalated']} escalated"
    )
    rate, eta = data["rate_per_s"], data["eta_s"]
    if rate is not None:
        click.echo(f"rate {rate:.1f} items/s" + (f", ETA {eta:.0f} s" if eta and not record.complete else ""))
    if record.complete:
        click.echo("complete")


@cli.command()
@click.argument("batch")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    default="-",
    help="Write JSONL here (default stdout); written beside and renamed, so it is whole or untouched.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["kevlaya", "openai", "openai-completions"]),
    default="kevlaya",
    show_default=True,
    help="kevlaya: one result per item; openai: OpenAI Batch output lines (chat completions; "
    "openai-completions: /v1/completions bodies), errors to --errors.",
)
@click.option(
    "--errors",
    "errors_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --format openai*: error lines (an empty file when there are none).",
)
@click.pass_context
def results(ctx: click.Context, batch: str, output: str, fmt: str, errors_file: str | None) -> None:
    """Export one JSON line per item of BATCH, in input order: its final answer or its error."""
    pending = 0
    url = COMPLETIONS_URL if fmt == "openai-completions" else CHAT_URL
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(_atomic_output(output))
        errors = stack.enter_context(_atomic_output(errors_file)) if errors_file is not None else out
        for row in _client(ctx).iter_results(batch):
            pending += bool(row.get("pending"))
            if fmt == "kevlaya":
                out.write(orjson.dumps(row) + b"\n")
                continue
            line, is_error = to_openai(row, url=url, batch=batch)
            (errors if is_error else out).write(orjson.dumps(line) + b"\n")
    if pending:
        click.echo(f"note: {pending} item(s) still pending; exported what is done", err=True)
        sys.exit(EXIT_INCOMPLETE)


@contextlib.contextmanager
def _atomic_output(path: str) -> Iterator[BinaryIO]:
    """Stdout for "-"; else a file written beside PATH and renamed onto it once complete: an export that fails
    part-way leaves PATH as it was (and no temporary file), never a half export that looks whole."""
    if path == "-":
        yield click.open_file("-", "wb")
        return
    with written_whole(Path(path)) as fh:
        yield fh


@cli.command()
@click.argument("batch")
@click.pass_context
def cancel(ctx: click.Context, batch: str) -> None:
    """Cancel the queued items of BATCH; items already running are allowed to finish."""
    n = _client(ctx).cancel(batch)
    click.echo(f"cancelled {n} queued item(s) of {batch}", err=True)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--limit", default=20, show_default=True, help="How many batches, newest first.")
@click.pass_context
def batches(ctx: click.Context, as_json: bool, limit: int) -> None:
    """List batches, newest first: status, counts and when each was created."""
    now = time.time()
    listing = _client(ctx).list_batches(limit=limit)
    for record in listing.records:
        data = record.to_dict(now)
        if as_json:
            click.echo(orjson.dumps(data).decode())
            continue
        c = data["counts"]
        click.echo(f"{record.id}  {data['status']:<11}  {record.counts.done}/{c['total']}  {_date(record.created_at)}")
    # A batch whose key some other writer gave another type is named as `status` names it, and fails the command
    # as `status` does: the rows above are all a listing could read, and a script must not take them for all.
    for exc in listing.unreadable:
        click.echo(f"error: {exc}", err=True)
    if listing.unreadable:
        ctx.exit(EXIT_USAGE)


def _date(ts: float) -> str:
    """A local date and time, or '-' for a stamp no clock can show (some other writer's, years past 9999)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return "-"


@cli.command("retry-failed")
@click.argument("batch")
@click.pass_context
def retry_failed(ctx: click.Context, batch: str) -> None:
    """Run BATCH's failed items again (not cancelled or expired ones)."""
    n = _client(ctx).retry_failed(batch)
    click.echo(f"requeued {n} failed item(s) of {batch}", err=True)


@cli.command()
@click.option(
    "--cron", "cron_expr", default=None, help="Slots as a cron expression in UTC: '0 2 * * *' is 02:00 daily."
)
@click.option("--every", default=None, help="Slots every N s/m/h/d from the epoch (UTC), e.g. 15m; instead of --cron.")
@click.option("--input", "inputs", multiple=True, help="JSONL files to submit at each slot: a glob (repeatable).")
@click.option(
    "--output",
    default=None,
    help="Where each slot's results go, a template: {date} (YYYY-MM-DD), {time} (HHMMSS), {slot}, {name}, {batch}.",
)
@click.option("--name", default="default", show_default=True, help="Schedule name; part of every slot's batch id.")
@click.option("--model", type=click.Choice(MODEL_NAMES), default=None, help="Model for lines that name none.")
@click.option("--no-escalate", is_flag=True, help="Never escalate Laya answers to Kev in these batches.")
@expires_in_option("Each slot's completion window in seconds.")
@click.option("--list", "list_", is_flag=True, help="Show the schedules in Redis: last and next slot, runs, missed.")
@click.option("--json", "as_json", is_flag=True, help="With --list: one JSON object per schedule.")
@click.pass_context
def schedule(
    ctx: click.Context,
    cron_expr: str | None,
    every: str | None,
    inputs: tuple[str, ...],
    output: str | None,
    name: str,
    model: str | None,
    no_escalate: bool,
    expires_in_s: float,
    list_: bool,
    as_json: bool,
) -> None:
    """Run a schedule until stopped: at each slot, submit the files matching --input as one batch (id
    NAME-<slot>), wait for it, export its results to --output. Slots are claimed in Redis: several
    schedulers of one schedule run each slot once; slots missed while none ran are reported, not run late.
    With --list: show the schedules instead."""
    from producer import schedule as schedules

    client = _client(ctx)
    if list_:
        _list_schedules(schedules.overview(client), as_json)
        return
    if output is None:
        raise click.UsageError("--output is required (or --list)")
    spec = schedules.ScheduleSpec(
        name=name,
        cron=cron_expr,
        every_s=None if every is None else schedules.parse_every(every),
        inputs=inputs,
        output=output,
        model=model,
        escalate=not no_escalate,
        expires_in_s=expires_in_s,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from producer.cron import run_schedule

    click.echo(f"schedule {spec.name}: {spec.cadence.describe()}; Ctrl-C or SIGTERM stops it", err=True)
    run_schedule(client, spec)


def _list_schedules(rows: list[dict[str, Any]], as_json: bool) -> None:
    if not rows and not as_json:
        click.echo("no schedules in this Redis", err=True)
    for row in rows:
        if as_json:
            click.echo(orjson.dumps(row).decode())
            continue
        click.echo(
            f"{row['name']}: {row['cadence']}, last slot {row['last_slot'] or '-'}, next {row['next_slot'] or '-'}, "
            f"{row['missed']} missed"
        )
        for run in row["runs"]:
            detail = run.get("output") or run.get("error") or ""
            click.echo(f"  {run['slot']}  {run['status']:<10}  {run.get('batch') or '-'}  {detail}")


def main() -> None:
    """Run the CLI: expected failures end in one line on stderr and a documented exit code, never a traceback."""
    try:
        code = cli(standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.Abort:
        click.echo("aborted", err=True)
        code = EXIT_USAGE
    except click.ClickException as exc:
        exc.show()
        code = EXIT_USAGE
    except WaitTimeoutError as exc:
        click.echo(f"error: {exc}", err=True)
        code = EXIT_INCOMPLETE
    except KevlayaError as exc:
        click.echo(f"error: {exc}", err=True)
        # Redis answering with a key of another type: the data is wrong, not Redis (as below)
        code = EXIT_REDIS if isinstance(exc, StoreError) and not is_wrong_type(exc.__cause__) else EXIT_USAGE
    except redis_exceptions.RedisError as exc:
        click.echo(f"error: {redis_problem(exc, _CONTEXT.get('redis_url'))}", err=True)
        code = EXIT_USAGE if is_wrong_type(exc) else EXIT_REDIS  # Redis answered: the data is wrong, not Redis
    except ValueError as exc:
        if "Redis URL" not in str(exc) and "redis" not in str(exc).lower():
            raise
        click.echo(f"error: bad Redis URL ({exc}); expected redis://[user:pass@]host:port/db", err=True)
        code = EXIT_USAGE
    sys.exit(code or 0)
