"""The `kevlaya` commands of the tools off the serving path: memory report, demo, demo models, train, eval,
calibrate (registered as `kevlaya.commands` entry points beside the worker command)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from shared.errors import KevlayaError
from worker.cli import MemorySize, setup_logging


class Share(click.ParamType):
    """A share from 0 to 1. click's FloatRange lets NaN through (no comparison with it is true)."""

    name = "share"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            share = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not 0 <= share <= 1:  # NaN too
            self.fail(f"{value!r}: give a number from 0 to 1", param, ctx)
        return share


@click.command("memory")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
@click.option("--memory-budget", type=MemorySize(), default="6GiB", show_default=True)
@click.option("--device", default=None)
def memory_command(config_path: str, memory_budget: int, device: str | None) -> None:
    """Print the seed's memory table (after 4-bit load, after adapters, inference at 512/1024 tokens)
    and the batch plan: measured on a GPU, estimated on CPU (the output says which)."""
    from worker.tools.memory_report import memory_table

    try:
        click.echo(memory_table(config_path, budget_bytes=memory_budget, device=device))
    except KevlayaError as exc:
        raise click.ClickException(str(exc)) from exc


@click.command("demo")
@click.option("--out", default=".kevlaya/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--items", default=1000, show_default=True, help="How many decisions to submit.")
@click.pass_context
def demo_command(ctx: click.Context, out: str, items: int) -> None:
    """End to end on embedded defaults: Redis (started if none), demo models, submit, drain, summary."""
    from worker.tools.demo import run_demo

    setup_logging("warning")
    run_demo(Path(out), items=items, redis_url=(ctx.obj or {}).get("redis_url"))


@click.command("demo-models")
@click.option("--out", default=".kevlaya/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--seed", default=0, show_default=True, help="Another draw of data and initialisation (0: shipped).")
def demo_models_command(out: str, seed: int) -> None:
    """Build (or reuse) the demo models -- a tiny base trained on a synthetic loan-triage task, Kev and Laya
    adapters trained with `kevlaya train` -- and write OUT/models.toml (plus train/held-out JSONL)."""
    from worker.tools.demo import prepare_models

    setup_logging("info")
    click.echo(str(prepare_models(Path(out), seed=seed)))


@click.command("train")
@click.argument("which", type=click.Choice(["kev", "laya", "all"]))
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False), help="Training JSONL.")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="models.toml (base).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Adapter folder (all: OUT/kev, OUT/laya).")
@click.option("--epochs", type=float, default=None, help="Default 3 (the seed's table).")
@click.option("--lr", type=float, default=None, help="Default: Kev 1e-4, Laya 2e-4.")
@click.option("--rank", type=int, default=None, help="Default: Kev 16, Laya 8 (alpha = 2 x rank).")
@click.option("--batch-size", type=int, default=None, help="Default 4.")
@click.option("--grad-accum", type=int, default=None, help="Default 2.")
@click.option("--max-length", type=int, default=None, help="Default 1024 tokens.")
@click.option("--overlong", type=click.Choice(["drop", "truncate"]), default=None, help="Default drop.")
@click.option("--no-rebalance", is_flag=True, help="Keep the category mix as it is.")
@click.option("--max-steps", type=int, default=None)
@click.option("--device", default=None)
def train_command(
    which: str,
    data: str,
    config_path: str,
    out: str,
    epochs: float | None,
    lr: float | None,
    rank: int | None,
    batch_size: int | None,
    grad_accum: int | None,
    max_length: int | None,
    overlong: str | None,
    no_rebalance: bool,
    max_steps: int | None,
    device: str | None,
) -> None:
    """Train LoRA adapters with the seed's recipe (QLoRA on CUDA, plain LoRA on CPU). JSONL lines need
    `prompt` (or `input`), a target under `kev`/`laya` (or `target`), and optionally `category`."""
    from worker.config import load_config
    from worker.tools.train import train_models

    setup_logging("info")
    overrides = {
        "epochs": epochs,
        "lr": lr,
        "rank": rank,
        "alpha": 2 * rank if rank else None,
        "batch_size": batch_size,
        "grad_accum": grad_accum,
        "max_length": max_length,
        "overlong": overlong,
        "rebalance": False if no_rebalance else None,
        "max_steps": max_steps,
    }
    try:
        config = load_config(config_path, check_paths=False)
        reports = train_models(config, which, Path(data), Path(out), device=device, **overrides)
    except KevlayaError as exc:
        raise click.ClickException(str(exc)) from exc
    for name, r in reports.items():
        final = r.losses[-1] if r.losses else float("nan")
        click.echo(
            f"{name}: {r.steps} steps in {r.seconds:.0f} s, final loss {final:.4f}, "
            f"{len(r.skipped_steps)} skipped, {len(r.rollbacks)} rollbacks, {r.overlong_dropped} overlong dropped; "
            f"categories {r.categories_before} -> {r.categories_after}",
            err=True,
        )


@click.command("eval")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
@click.option(
    "--data",
    default=None,
    type=click.Path(dir_okay=False),
    help="Held-out JSONL (default: heldout.jsonl beside the config).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--out", default=None, type=click.Path(file_okay=False), help="Plots go here (default: eval/ beside the config)."
)
@click.option("--target-escalation", type=Share(), default=None, help="Pick the threshold for this rate (0 to 1).")
@click.option("--target-accuracy", type=Share(), default=None, help="Pick the threshold for this (0 to 1).")
@click.option("--write-threshold", is_flag=True, help="Write the picked threshold into the config's escalation rule.")
@click.option("--device", default=None)
def eval_command(
    config_path: str,
    data: str | None,
    as_json: bool,
    out: str | None,
    target_escalation: float | None,
    target_accuracy: float | None,
    write_threshold: bool,
    device: str | None,
) -> None:
    """Accuracy of Laya, Kev and the cascade, the escalation rate, Laya's calibration (ECE raw and served,
    reliability PNGs), the accuracy / escalation-rate curve (PNG) and the threshold that meets a target."""
    import orjson

    from worker.config import load_config
    from worker.engine import Engine
    from worker.tools.config_write import set_key
    from worker.tools.evaluate import SCREEN, evaluate

    if target_escalation is not None and target_accuracy is not None:
        raise click.UsageError("give --target-escalation or --target-accuracy, not both")
    if write_threshold and target_escalation is None and target_accuracy is None:
        raise click.UsageError("--write-threshold needs --target-escalation or --target-accuracy")
    setup_logging("warning")
    try:
        config = load_config(config_path)
        heldout = Path(data) if data else config.path.parent / "heldout.jsonl"
        if not heldout.is_file():
            raise click.ClickException(f"no held-out data at {heldout} (pass --data)")
        report = evaluate(
            Engine(config, device=device),
            heldout,
            Path(out) if out else config.path.parent / "eval",
            target_escalation=target_escalation,
            target_accuracy=target_accuracy,
        )
        written = write_threshold and report["target"]["met"]
        if written:
            set_key(config.path, f"models.{SCREEN}.escalation", "threshold", report["threshold"])
        report["threshold_written"] = bool(written)
    except KevlayaError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(orjson.dumps(report).decode())
        return
    _print_eval(report, config.path if write_threshold else None)


def _print_eval(report: dict, config_path: Path | None) -> None:
    from worker.tools.evaluate import EXPERT, SCREEN

    c, cal = report["cascade"], report["calibration"]
    click.echo(f"held-out items      {report['items']}")
    click.echo(f"{SCREEN} alone{'':<10}{report[SCREEN]['accuracy']:.3f}")
    click.echo(f"{EXPERT} alone{'':<11}{report[EXPERT]['accuracy']:.3f}")
    click.echo(
        f"cascade             {c['accuracy']:.3f} (escalating {c['escalation_rate']:.1%} at threshold {c['threshold']})"
    )
    click.echo(f"{SCREEN} calibration{'':<4}ECE {cal['ece_before']:.3f} raw, {cal['ece_after']:.3f} as served")
    click.echo("curve               threshold  escalation  accuracy")
    for point in report["curve"][::5]:
        click.echo(f"{'':<20}{point['threshold']:>9.2f}  {point['escalation_rate']:>10.1%}  {point['accuracy']:>8.3f}")
    target = report.get("target")
    if target:
        verdict = "met" if target["met"] else "NOT reachable; the most accurate threshold instead"
        click.echo(
            f"target              {target['kind']} {target['value']}: threshold {report['threshold']} ({verdict})"
        )
        if config_path is not None:
            done = "written to" if report["threshold_written"] else "not written to"
            click.echo(f"                    {done} {config_path}")
    click.echo(f"plots               {', '.join(report['plots'])}")


@click.command("calibrate")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="models.toml")
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False), help="Labelled held-out JSONL.")
@click.option(
    "--model",
    "models",
    multiple=True,
    help="Model(s) to calibrate (default: every model with an escalation rule, i.e. the one whose "
    "confidence decides escalation).",
)
@click.option(
    "--method",
    type=click.Choice(["auto", "temperature", "isotonic"]),
    default="auto",
    show_default=True,
    help="auto: temperature scaling, isotonic only when it beats it out of fold.",
)
@click.option(
    "--check",
    "check_data",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="A second labelled split, not used for fitting: its ECE before and after is printed too.",
)
@click.option("--out", default=None, type=click.Path(file_okay=False), help="PNGs (default: calibration/ by config).")
@click.option("--dry-run", is_flag=True, help="Fit and print, but leave the config as it is.")
@click.option("--json", "as_json", is_flag=True, help="Print the fit as JSON.")
@click.option("--device", default=None)
def calibrate_command(
    config_path: str,
    data: str,
    models: tuple[str, ...],
    method: str,
    check_data: str | None,
    out: str | None,
    dry_run: bool,
    as_json: bool,
    device: str | None,
) -> None:
    """Fit each model's confidence calibration on labelled held-out items and write it into the config
    under [models.NAME.calibration]; print ECE before and after, and write reliability PNGs."""
    import orjson

    from worker.config import load_config
    from worker.engine import Engine
    from worker.tools.config_write import write_table
    from worker.tools.evaluate import calibrate, check, reliability_pngs, uncalibrated

    setup_logging("warning")
    try:
        config = load_config(config_path)
        names = models or tuple(n for n, spec in config.models.items() if spec.escalation is not None)
        unknown = sorted(set(names) - set(config.models))
        if unknown:
            raise click.UsageError(f"unknown model(s) {unknown}; the config has {sorted(config.models)}")
        out_dir = Path(out) if out else config.path.parent / "calibration"
        engine = Engine(uncalibrated(config), device=device)
        fits = {}
        for name in names:
            fitted, summary = calibrate(engine, name, Path(data), method=method)
            summary["plots"] = reliability_pngs(summary, name, out_dir)
            if check_data:
                summary["check"] = check(engine, name, Path(check_data), fitted)
            fits[name] = (fitted, summary)
            if not dry_run:
                write_table(
                    config.path,
                    f"models.{name}.calibration",
                    fitted.to_table(),
                    comment="written by `kevlaya calibrate` (README: Calibration and thresholds)",
                )
    except KevlayaError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(orjson.dumps({n: {"calibration": f.to_table(), **s} for n, (f, s) in fits.items()}).decode())
        return
    for name, (fitted, summary) in fits.items():
        click.echo(f"{name}: {summary['items']} items, accuracy {summary['accuracy']:.3f}")
        params = f"T = {fitted.temperature:.3f}, choices T = {fitted.choices_temperature:.3f}"
        click.echo(f"  method            {fitted.method} ({params})")
        click.echo(f"  ECE               {summary['ece_before']:.3f} -> {summary['ece_after']:.3f} (fitting data)")
        if "check" in summary:
            ch = summary["check"]
            click.echo(
                f"  ECE on {Path(ch['data']).name:<10} {ch['ece_before']:.3f} -> {ch['ece_after']:.3f} (not fitted on)"
            )
        click.echo(f"  plots             {', '.join(summary['plots'])}")
        where = "not written (--dry-run)" if dry_run else f"[models.{name}.calibration] in {config.path}"
        click.echo(f"  config            {where}")
