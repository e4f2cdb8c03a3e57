"""The `kevlaya worker` command (registered as a `kevlaya.commands` entry point; producer.cli loads it when called)."""

from __future__ import annotations

import logging
import sys

import click

from producer.cli import Seconds
from shared.conn import connect
from shared.errors import ConfigError, KevlayaError
from shared.keys import DEFAULT_PREFIX
from worker.memory import parse_bytes

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class MemorySize(click.ParamType):
    """A memory size above 0 (`6GiB`, `512MiB`, `6GB`). A plain string let `--memory-budget ''` through as "none
    given" (the GPU's total) and `0` as no limit at all (the planner reads a zero budget as none)."""

    name = "size"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        try:
            size = parse_bytes(str(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        if size <= 0:
            self.fail(f"{value!r}: give a size above 0, e.g. 6GiB", param, ctx)
        return size


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@click.command("worker")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="models.toml")
@click.option(
    "--burst",
    is_flag=True,
    help="Exit when nothing is queued or recoverable; exit 3 when Redis stays unreachable for about 15 s.",
)
@click.option(
    "--memory-budget",
    type=MemorySize(),
    default=None,
    help="Memory for the whole worker process as the driver (nvidia-smi) reports it: CUDA context, kernels, "
    "workspaces, graphs, KV cache, weights, activations, e.g. 6GiB. Batches are planned from what is left of it. "
    "Default: the GPU's total memory minus 512 MiB. On a card shared with other processes (a desktop), give "
    "what is free of it minus ~10%.",
)
@click.option(
    "--max-wait-ms",
    default=10000,
    show_default=True,
    type=click.IntRange(min=0),  # a negative wait made every other queue starving: a switch at every take
    help="Switch models once the other queue's oldest job waited this long (sooner when it holds a full take). "
    "Every switch breaks a batch: lower it for latency, raise it for throughput.",
)
@click.option(
    "--bulk-every-takes",
    default=4,
    show_default=True,
    type=click.IntRange(min=1),  # 0 would make bulk due at every take: interactive work no longer first
    help="Interactive work is taken before bulk; after this many interactive takes in a row while bulk "
    "waits, the next take is bulk's (no starvation).",
)
@click.option(
    "--paced-take-ms",
    default=600,
    show_default=True,
    type=click.IntRange(min=0),
    help="While interactive work is live, bulk takes are sized (from measured takes) to finish in about this "
    "long, since an interactive job waits for the bulk take in flight. Lower: faster interactive answers, "
    "slower bulk while they come. 0: bulk takes are always full.",
)
@click.option(
    "--interactive-window-s",
    default=3.0,
    show_default=True,
    type=Seconds(),
    help="Interactive work counts as live this long after one was last seen waiting (bulk takes paced). "
    "0: never paced.",
)
@click.option(
    "--max-batch-rows",
    type=click.IntRange(min=1),
    default=None,
    help="Upper bound on rows per batch (default: 512 on a GPU, where the memory plan bounds generation takes, "
    "256 on a CPU).",
)
@click.option("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available).")
@click.option("--no-mixed-tails", is_flag=True, help="Never mix Kev and Laya rows in one batch.")
@click.option(
    "--decode",
    type=click.Choice(["auto", "eager", "static"]),
    default="auto",
    show_default=True,
    help="auto: greedy rows through the static decode loop (CUDA graphs on a GPU) where the model supports "
    "it; static: the loop without graphs; eager: always HF generate (turns the fast path off).",
)
@click.option(
    "--no-compile",
    is_flag=True,
    help="Run the decode loop's fused elementwise steps eagerly instead of as torch.compile'd kernels "
    "(bf16/fp16 on a GPU; compiling adds seconds to the start-up warm-up), and prefill's rotary, SiLU x up and "
    "residual add with its RMSNorm eagerly instead of by kevlaya's own Triton kernels.",
)
@click.option(
    "--pointwise-kernels",
    is_flag=True,
    help="Experimental: the decode step's rotary and SiLU x up by kevlaya's own Triton kernels (CUDA, bf16/fp16) "
    "instead of the compiled ones, as prefill runs them by default there. Bit-equal and faster on GPU time; in "
    "the decode step not yet shown faster end to end.",
)
@click.option(
    "--take-ahead",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="While a take runs, a helper thread writes the one before it and takes, triages and encodes the next one "
    "of its queue, so the GPU waits for neither. auto: on where the engine runs on a GPU, off on a CPU (whose "
    "cores the helper's Python would take from the engine).",
)
@click.option(
    "--batch-time-limit-s",
    default=900.0,
    show_default=True,
    type=Seconds(positive=True),  # NaN never ran out; 0 failed every generated row at once
    help="Rows still generating then fail with `timeout`.",
)
@click.option("--name", default=None, help="Worker name (default: host + random suffix).")
@click.option(
    "--job-heartbeat-ttl-s",
    default=20.0,
    show_default=True,
    type=Seconds(positive=True),  # the heartbeat interval and worker TTL derive from it (WorkerSettings)
    help="A running job whose heartbeat is older than this is taken back from a dead worker.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus /metrics, /healthz and /readyz on this port (0: any free one, logged).",
)
@click.option(
    "--notify-allow",
    multiple=True,
    help="URL prefix a batch's completion notice may be POSTed to (repeatable; none: no POSTs).",
)
@click.option(
    "--gpus",
    default=None,
    help="`all` or a list like 0,1: one worker process per GPU under this one (CUDA_VISIBLE_DEVICES each, named "
    "NAME-gpuID, metrics on port N+i, at most 65535); signals are forwarded, a crashed worker restarted (3 times "
    "in 10 min, then the others are stopped and the exit is non-zero). The workers share a queue's tail among those "
    "idle.",
)
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="info", show_default=True)
@click.pass_context
def worker_command(
    ctx: click.Context,
    config_path: str,
    burst: bool,
    memory_budget: int | None,
    max_wait_ms: int,
    bulk_every_takes: int,
    paced_take_ms: int,
    interactive_window_s: float,
    max_batch_rows: int | None,
    device: str | None,
    no_mixed_tails: bool,
    decode: str,
    no_compile: bool,
    pointwise_kernels: bool,
    take_ahead: str,
    batch_time_limit_s: float,
    name: str | None,
    job_heartbeat_ttl_s: float,
    metrics_port: int | None,
    notify_allow: tuple[str, ...],
    gpus: str | None,
    log_level: str,
) -> None:
    """Run the batch worker: load the models once, then drain the Kev and Laya queues in batches."""
    setup_logging(log_level)
    obj = ctx.obj or {}
    if gpus is not None:
        sys.exit(_supervise(ctx, gpus))
    from worker.config import load_config
    from worker.engine import Engine
    from worker.fastpath import OpsOptions
    from worker.loop import BatchWorker
    from worker.settings import WorkerSettings, take_ahead_on

    try:
        config = load_config(config_path)
        engine = Engine(
            config,
            device=device,
            memory_budget_bytes=memory_budget,
            max_batch_rows=max_batch_rows,
            decode=decode,
            ops=OpsOptions(compile_ops=not no_compile, pointwise_kernels=pointwise_kernels),
        )
    except KevlayaError as exc:
        raise click.ClickException(str(exc)) from exc
    settings = WorkerSettings.with_heartbeat_ttl(
        job_heartbeat_ttl_s,
        burst=burst,
        max_wait_ms=max_wait_ms,
        bulk_every_takes=bulk_every_takes,
        paced_take_ms=paced_take_ms,
        interactive_window_s=interactive_window_s,
        mixed_tails=not no_mixed_tails,
        take_ahead=take_ahead == "on" or (take_ahead == "auto" and take_ahead_on(engine.device.type)),
        batch_time_limit_s=batch_time_limit_s,
        name=name,
        prefix=obj.get("prefix", DEFAULT_PREFIX),
        metrics_port=metrics_port,
        notify_allow=notify_allow,
    )
    BatchWorker(connect(obj.get("redis_url"), socket_timeout_s=60), engine, config, settings).work()


# Options the parent sets per child (or handles itself) instead of passing them on as given.
PER_CHILD = frozenset({"gpus", "name", "device", "metrics_port"})


def _supervise(ctx: click.Context, gpus: str) -> int:
    """`--gpus`: one child `kevlaya worker` per GPU with this command's other options (worker.supervisor)."""
    import os

    from worker.settings import worker_name
    from worker.supervisor import Supervisor, child_specs, parse_gpus

    params = ctx.params
    if params["device"] not in (None, "cuda"):
        raise click.UsageError(f"--gpus picks the devices: drop --device {params['device']}")
    obj = ctx.obj or {}
    redis_url = obj.get("redis_url")
    try:
        chosen = parse_gpus(gpus, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
        children = child_specs(
            chosen,
            base_name=worker_name(params["name"]),
            worker_args=_passed_on(ctx),
            global_args=["--prefix", obj.get("prefix", DEFAULT_PREFIX)],
            metrics_port=params["metrics_port"],
            env={"REDIS_URL": redis_url} if redis_url else None,  # not in argv, where `ps` shows a password
        )
    except KevlayaError as exc:
        raise click.ClickException(str(exc)) from exc
    return Supervisor(children).run()


def _passed_on(ctx: click.Context) -> list[str]:
    """This command's options as given, as arguments for a child (those in PER_CHILD left out)."""
    args: list[str] = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name in PER_CHILD:
            continue
        value, flag = ctx.params[param.name], param.opts[0]
        if param.is_flag:
            args += [flag] if value else []
        elif param.multiple:
            for v in value:
                args += [flag, str(v)]
        elif value is not None:
            args += [flag, str(value)]
    return args
