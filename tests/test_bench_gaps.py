"""`bench gaps`: the GPU's idle gaps from a Chrome trace, and the host frames they are laid against."""

from __future__ import annotations

from typing import Any

import pytest

from bench.gaps import RUN_MARK, Trace, bucket, main, report, stacks_at, where

ROOT = "/work/main/"


def kernel(ts: float, dur: float, corr: int, cat: str = "kernel") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}


def launch(ts: float, corr: int, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": tid,
            "args": {"correlation": corr}}  # fmt: skip


def frame(ts: float, dur: float, name: str, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "cat": "python_function", "ts": ts, "dur": dur, "tid": tid, "name": name}


def events() -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "process_name"},
        frame(0, 1000, f"{ROOT}worker/engine.py(10): run"),
        frame(5, 300, f"{ROOT}worker/fastpath/prefill.py(500): _layer"),
        frame(320, 600, f"{ROOT}worker/fastpath/prefill.py(430): _chunk"),
        frame(330, 100, "/opt/x/site-packages/numpy/core/fromnumeric.py(50): take"),
        frame(100, 50, f"{ROOT}worker/ahead.py(1): helper", tid=2),  # another thread: not the launching one
        launch(10, 1),
        launch(20, 2),
        launch(900, 3),
        kernel(50, 100, 1),
        kernel(120, 80, 2),  # overlaps the first: one busy span 50-200
        kernel(950, 50, 3, cat="gpu_memcpy"),
        {"ph": "X", "cat": "cpu_op", "ts": 1, "dur": 1, "tid": 1, "name": "aten::mm"},
        {"ph": "X", "cat": "user_annotation", "ts": 0, "dur": 1100, "tid": 1, "name": RUN_MARK},
    ]


def test_busy_spans_merge_overlapping_gpu_work_and_gaps_know_their_launch() -> None:
    trace = Trace.of(events())
    assert [(s.start_us, s.end_us) for s in trace.busy()] == [(50, 200), (950, 1000)]
    [gap] = trace.gaps()
    assert (gap.start_us, gap.end_us, gap.us) == (200, 950, 750)
    assert gap.host_late_us == 700  # launched at 900, the GPU idle since 200: the host was late
    assert trace.launch_thread() == 1


def test_stacks_follow_nesting_and_leave_closed_frames() -> None:
    frames = [f for f in Trace.of(events()).frames if f.thread == 1]
    stacks = stacks_at(frames, [350, 100, 950, 2000])
    assert [s.rsplit("/", 1)[-1] for s in stacks[0]] == ["engine.py(10): run", "prefill.py(430): _chunk",
                                                         "fromnumeric.py(50): take"]  # fmt: skip
    assert [s.rsplit("/", 1)[-1] for s in stacks[1]] == ["engine.py(10): run", "prefill.py(500): _layer"]
    assert [s.rsplit("/", 1)[-1] for s in stacks[2]] == ["engine.py(10): run"]  # _chunk ended at 920
    assert stacks[3] == ()


def test_where_names_our_innermost_frames_then_a_library_frame() -> None:
    stack = (f"{ROOT}worker/engine.py(10): run", f"{ROOT}worker/fastpath/prefill.py(430): _chunk",
             "/opt/x/site-packages/numpy/core/fromnumeric.py(50): take")  # fmt: skip
    assert (
        where(stack) == "worker/engine.py(10): run > worker/fastpath/prefill.py(430): _chunk > fromnumeric.py(50): take"
    )
    assert where(stack[:2], depth=1) == "worker/fastpath/prefill.py(430): _chunk"
    assert where(()) == "(outside Python)"


def test_report_attributes_idle_to_the_frame_at_the_gaps_middle() -> None:
    text = report(Trace.of(events()), label="t", wall_s=0.001)
    head, sizes = text.splitlines()[:2]  # sizes: the call's own span first
    assert "busy 0.2 ms (21%), idle 0.8 ms in 1 gaps" in head
    assert sizes == "the call ran 0.1 ms before its first GPU work and 0.1 ms after its last"
    assert text.splitlines()[2] == "idle by gap size: 100-1000 us 0.8 ms (1)"
    # the middle of 200-950 is 575: the host was building a chunk
    assert "0.75      1  worker/engine.py(10): run > worker/fastpath/prefill.py(430): _chunk" in text
    assert "   700  " in text  # the host late by 700 us


def test_bucket_edges() -> None:
    assert [bucket(x) for x in (5, 20, 999, 1000)] == ["0-20 us", "20-100 us", "100-1000 us", ">= 1000 us"]


def test_a_trace_without_gpu_work_says_so() -> None:
    assert report(Trace.of([frame(0, 5, "x.py(1): f")]), label="cpu", wall_s=0.0) == "cpu: no GPU work in the trace\n"


def test_off_a_gpu_it_stops_with_one_line() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["--device", "cpu"])


def test_contained_touching_and_tied_gpu_work_merge_and_the_first_event_ends_a_gap() -> None:
    trace = Trace.of(
        [
            kernel(0, 100, 1),
            kernel(10, 20, 2),  # inside the first
            kernel(100, 10, 3),  # touching its end
            kernel(200, 5, 4),
            kernel(200, 50, 5),  # the same start: the first in the trace ends the gap
            launch(150, 4),
            launch(160, 5),
        ]
    )
    assert [(s.start_us, s.end_us) for s in trace.busy()] == [(0, 110), (200, 250)]
    [gap] = trace.gaps()
    assert (gap.start_us, gap.end_us, gap.launched_us) == (110, 200, 150)
