"""Where the GPU waits: engine takes under the profiler, every idle gap between kernels laid against what the host
was doing then.

    python -m bench gaps --device cuda --memory-budget 6GiB --only choices --rows 256,344

One engine (the worker's defaults: its warm-up included), then for each workload its takes (`--rows`: one
`Engine.run` per size, in order, as a worker takes them) run twice: the first time (shapes, allocations and
kernels new to the worker) and again, each run under `torch.profiler` with the Python stack. Per run a file
`gaps-<workload>-<first|again>.txt`: the wall, the GPU busy (kernels, copies and memsets merged), the idle split
by gap size, the idle summed by the frame the host was in at each gap's middle (what kept it from launching), and
the largest gaps one by one with how late the host launched the kernel that ended them (late: the host was the
bottleneck; early: the GPU waited on something else -- a copy from pageable memory, a synchronisation). The
profiler's own host overhead (~2x on Python-heavy code) makes gaps larger than in a plain run: compare runs and
frames, not absolute idle.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
OUR_ROOTS = ("worker/", "shared/", "producer/", "bench/")
GAP_BUCKETS_US = (20.0, 100.0, 1000.0)  # edges of the size classes the idle is split into
RUN_MARK = "bench.gaps.run"  # the profiled call's own span in the trace


@dataclass(frozen=True)
class Span:
    start_us: float
    end_us: float


@dataclass(frozen=True)
class GpuEvent:
    start_us: float
    end_us: float
    correlation: int | None


@dataclass(frozen=True)
class Frame:
    start_us: float
    end_us: float
    name: str  # "path(line): function"
    thread: int


@dataclass(frozen=True)
class Gap:
    start_us: float
    end_us: float
    launched_us: float | None  # when the host launched the kernel that ended the gap (None: not in the trace)

    @property
    def us(self) -> float:
        return self.end_us - self.start_us

    @property
    def host_late_us(self) -> float | None:
        """How long after the GPU went idle the host launched the next kernel (negative: before)."""
        return None if self.launched_us is None else self.launched_us - self.start_us


@dataclass(frozen=True)
class Trace:
    gpu: tuple[GpuEvent, ...]  # in start order
    launches: dict[int, tuple[float, int]]  # correlation -> (host time, thread)
    frames: tuple[Frame, ...]
    run: Span | None = None  # the profiled call (`RUN_MARK`), where the trace has it

    @classmethod
    def of(cls, events: Iterable[dict[str, Any]]) -> Trace:
        """From a Chrome trace's events (`torch.profiler` `export_chrome_trace`)."""
        gpu: list[GpuEvent] = []
        launches: dict[int, tuple[float, int]] = {}
        frames: list[Frame] = []
        run = None
        for e in events:
            if e.get("ph") != "X":
                continue
            cat, start = e.get("cat"), float(e.get("ts", 0.0))
            end = start + float(e.get("dur", 0.0))
            correlation = (e.get("args") or {}).get("correlation")
            if cat in GPU_CATEGORIES:
                gpu.append(GpuEvent(start, end, None if correlation is None else int(correlation)))
            elif cat in LAUNCH_CATEGORIES and correlation is not None:
                launches[int(correlation)] = (start, int(e.get("tid", 0)))
            elif cat == "python_function":
                frames.append(Frame(start, end, str(e.get("name", "?")), int(e.get("tid", 0))))
            elif e.get("name") == RUN_MARK and cat != "gpu_user_annotation":
                run = Span(start, end)
        gpu.sort(key=lambda g: g.start_us)
        return cls(gpu=tuple(gpu), launches=launches, frames=tuple(frames), run=run)

    def busy(self) -> list[Span]:
        """The GPU's busy time: every kernel, copy and memset merged into disjoint spans."""
        return [span for span, _ in self._spans()]

    def _spans(self) -> list[tuple[Span, GpuEvent]]:
        """The busy spans, each with the event that started it (the earliest; the first in the trace on a tie)."""
        spans: list[tuple[Span, GpuEvent]] = []
        for g in self.gpu:
            if spans and g.start_us <= spans[-1][0].end_us:
                span, first = spans[-1]
                if g.end_us > span.end_us:
                    spans[-1] = (Span(span.start_us, g.end_us), first)
            else:
                spans.append((Span(g.start_us, g.end_us), g))
        return spans

    def gaps(self) -> list[Gap]:
        """Every idle stretch between two busy spans, with the launch of the work that ended it."""
        out: list[Gap] = []
        for (before, _), (after, first) in itertools.pairwise(self._spans()):
            launched = None
            if first.correlation is not None and first.correlation in self.launches:
                launched = self.launches[first.correlation][0]
            out.append(Gap(before.end_us, after.start_us, launched))
        return out

    def launch_thread(self) -> int | None:
        """The host thread that launched most GPU work: the one whose frames say why the GPU waited."""
        counts = Counter(thread for _, thread in self.launches.values())
        return counts.most_common(1)[0][0] if counts else None


def stacks_at(frames: Sequence[Frame], times: Sequence[float]) -> list[tuple[str, ...]]:
    """The Python stack (outermost first) at each of `times`, from one thread's properly nested frames: a sweep
    over the frames in start order with a stack of those still open."""
    ordered = sorted(frames, key=lambda f: (f.start_us, -f.end_us))
    queries = sorted(range(len(times)), key=lambda i: times[i])
    out: list[tuple[str, ...]] = [()] * len(times)
    open_: list[Frame] = []
    k = 0
    for i in queries:
        t = times[i]
        while k < len(ordered) and ordered[k].start_us <= t:
            f = ordered[k]
            while open_ and open_[-1].end_us <= f.start_us:
                open_.pop()
            open_.append(f)
            k += 1
        while open_ and open_[-1].end_us < t:
            open_.pop()
        out[i] = tuple(f.name for f in open_ if f.start_us <= t <= f.end_us)
    return out


def short(name: str) -> str:
    """A frame's name from the project's root (`worker/fastpath/prefill.py(535): _layer`), else its file's."""
    for root in OUR_ROOTS:
        at = name.find(root)
        if at >= 0 and (at == 0 or name[at - 1] == "/"):
            return name[at:]
    path, sep, rest = name.partition("(")
    return f"{path.rsplit('/', 1)[-1]}{sep}{rest}"


def ours(name: str) -> bool:
    return short(name).startswith(OUR_ROOTS)


def where(stack: tuple[str, ...], depth: int = 2) -> str:
    """The innermost `depth` frames of our code, then the innermost frame if it is a library's."""
    mine = [short(n) for n in stack if ours(n)][-depth:]
    if stack and not ours(stack[-1]):
        mine.append(short(stack[-1]))
    return " > ".join(mine) or "(outside Python)"


def bucket(us: float) -> str:
    low = 0.0
    for edge in GAP_BUCKETS_US:
        if us < edge:
            return f"{low:g}-{edge:g} us"
        low = edge
    return f">= {low:g} us"


def report(trace: Trace, *, label: str, wall_s: float, top: int = 25) -> str:
    """The text of one run's gaps (see the module's text)."""
    spans = trace.busy()
    if not spans:
        return f"{label}: no GPU work in the trace\n"
    busy_us = sum(s.end_us - s.start_us for s in spans)
    gaps = trace.gaps()
    idle_us = sum(g.us for g in gaps)
    thread = trace.launch_thread()
    frames = [f for f in trace.frames if f.thread == thread]
    mids = stacks_at(frames, [(g.start_us + g.end_us) / 2 for g in gaps])
    at_launch = stacks_at(frames, [g.launched_us if g.launched_us is not None else g.end_us for g in gaps])
    by_bucket: Counter[str] = Counter()
    by_count: Counter[str] = Counter()
    by_frame: Counter[str] = Counter()
    frame_count: Counter[str] = Counter()
    for g, mid in zip(gaps, mids, strict=True):
        by_bucket[bucket(g.us)] += g.us
        by_count[bucket(g.us)] += 1
        key = where(mid, depth=2)
        by_frame[key] += g.us
        frame_count[key] += 1
    first, last = spans[0].start_us, spans[-1].end_us
    share = 100 * busy_us / max(1.0, last - first)
    lines = [
        f"{label}: wall {1000 * wall_s:.1f} ms under the profiler; GPU from first to last work "
        f"{(last - first) / 1000:.1f} ms, busy {busy_us / 1000:.1f} ms ({share:.0f}%), idle {idle_us / 1000:.1f} "
        f"ms in {len(gaps)} gaps",
        "idle by gap size: "
        + ", ".join(
            f"{k} {v / 1000:.1f} ms ({by_count[k]})" for k, v in sorted(by_bucket.items(), key=lambda kv: -kv[1])
        ),
        "",
        "idle by where the host was at each gap's middle (ms, gaps):",
    ]
    if trace.run is not None:
        lines.insert(
            1,
            f"the call ran {(first - trace.run.start_us) / 1000:.1f} ms before its first GPU work and "
            f"{(trace.run.end_us - last) / 1000:.1f} ms after its last",
        )
    lines += [f"  {v / 1000:8.2f} {frame_count[k]:6d}  {k}" for k, v in by_frame.most_common(20)]
    lines += [
        "",
        f"the {top} largest gaps: at (ms from the first GPU work), idle us, host late us; "
        "host at the middle | at the launch",
    ]
    order = sorted(range(len(gaps)), key=lambda i: -gaps[i].us)[:top]
    for i in sorted(order, key=lambda i: gaps[i].start_us):
        g = gaps[i]
        late = "?" if g.host_late_us is None else f"{g.host_late_us:.0f}"
        lines.append(
            f"  {(g.start_us - first) / 1000:8.2f} {g.us:8.0f} {late:>7}  "
            f"{where(mids[i], 3)} | {where(at_launch[i], 2)}"
        )
    return "\n".join(lines) + "\n"


def profiled(run: Any) -> tuple[Trace, float]:
    """`run()` under the profiler (CPU, CUDA, Python stack): its trace and its wall seconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        sync()
        t0 = time.perf_counter()
        with record_function(RUN_MARK):
            run()
        sync()
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return Trace.of(events), wall


def takes(jobs: list[Any], rows: Sequence[int]) -> list[list[Any]]:
    out, start = [], 0
    for n in rows:
        out.append(jobs[start : start + n])
        start += n
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench gaps", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="qwen2.5-1.5b")
    parser.add_argument("--memory-budget", default="6GiB")
    parser.add_argument("--rows", default="256,344", help="the takes' sizes, run in this order")
    parser.add_argument(
        "--only", default="choices,nightly", help="bench prefill's workloads: nightly,long,choices,mixed,mixed-choices"
    )
    parser.add_argument("--top", type=int, default=25, help="gaps listed one by one")
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda"):
        raise SystemExit("bench gaps: GPU idle needs a CUDA device (--device cuda)")
    from bench.common import model_dir, write_config
    from bench.prefill import workloads
    from worker.config import load_config
    from worker.engine import Engine
    from worker.memory import parse_bytes

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(n) for n in args.rows.split(",")]
    config = load_config(write_config(model_dir(args.shape, device=args.device), device=args.device, name="gaps.toml"))
    engine = Engine(config, device=args.device, memory_budget_bytes=parse_bytes(args.memory_budget))
    loads = {k: v for k, v in workloads(engine, sum(sizes)).items() if k in args.only.split(",")}
    for name, jobs in loads.items():
        parts = takes(jobs, sizes)
        for run in ("first", "again"):
            for n, part in enumerate(parts):
                trace, wall = profiled(lambda part=part: engine.run(part))
                label = f"{name} take {n + 1} ({len(part)} rows), {run}"
                text = report(trace, label=label, wall_s=wall, top=args.top)
                (out / f"gaps-{name}-{run}-{n + 1}.txt").write_text(text)
                print(text.split("\n\n")[0], flush=True)
        plain = [plain_wall(engine, part) for part in parts]
        print(
            f"{name}: the same takes without the profiler: " + ", ".join(f"{w * 1000:.1f} ms" for w in plain),
            flush=True,
        )


def plain_wall(engine: Any, jobs: list[Any]) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.run(jobs)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
