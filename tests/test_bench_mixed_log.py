"""`bench mixed` reads its figures from the worker's log: out-of-memory errors, graph captures, the seconds
each batch spent in the engine (from the worker's own lines only), each take's allocator headroom and the
allocator's retries."""

from __future__ import annotations

from bench.mixed import LogCounts

LOG = """\
02:28:19 INFO kevlaya.worker: batch model=laya n=256 ran=256 tokens=8192 wait=0.13s engine=1.52s total=1.56s tok/s=5377
02:28:19 INFO kevlaya.engine: take for laya: 160 rows at prompts up to 426 tokens: 253 MiB left
02:28:19 INFO kevlaya.fastpath: decode: captured a graph for 160 rows x 512 tokens (laya; 10 captured)
02:28:20 INFO kevlaya.worker: batch model=kev+laya n=160 ran=160 tokens=5120 wait=1.69s engine=0.73s total=0.75s \
tok/s=7014 (host: take 0.025s, triage 0.011s, write 0.017s)
02:28:21 ERROR kevlaya.engine: OUT OF MEMORY at 160 rows (out-of-memory error #1 of this worker): ...
02:28:21 INFO kevlaya.worker: job j1 says engine=9.99s in its prompt, not a batch line
02:28:22 INFO kevlaya.engine: take: 144 kev rows (generation, prompts up to 412 tokens): allocator peak 4344 MiB \
(4500 MiB held), cap 5370 MiB, headroom 1026 MiB, 0 retries, 3986 MiB allocated after it
02:28:23 INFO kevlaya.engine: take: 256 laya rows (scoring, prompts up to 300 tokens): allocator peak 5400 MiB \
(5370 MiB held), cap 5370 MiB, headroom -30 MiB, 3 retries, 3986 MiB allocated after it
"""


def test_the_log_gives_oom_captures_and_engine_seconds() -> None:
    counts = LogCounts.of(LOG)
    assert counts == LogCounts(oom=1, captures=1, engine_s=1.52 + 0.73, headrooms_mib=(1026, -30), retries=3)
    assert LogCounts.of("") == LogCounts(oom=0, captures=0, engine_s=0.0, headrooms_mib=())


def test_a_row_names_the_worker_settings_it_changed() -> None:
    """Benchmarks run the worker with a user's defaults or say what they changed: `--take-ahead on|off` and
    `--pointwise-kernels` appear in the row's model cell, the default (auto) does not."""
    import argparse

    from bench.mixed import _row

    figures = {
        "items": 600, "wall_s": 1.5, "engine_s": 1.1, "decisions_per_s": 400.0, "prompt_tokens_per_s": 1,
        "generated_tokens_per_s": 0, "tokens_per_s": 1, "oom": 0, "captures": 0, "errors": 0, "peak_mib": None,
        "peak_is_per_process": True,
    }  # fmt: skip

    def model_cell(**changed: object) -> str:
        settings = {"device": "cuda", "memory_budget": "6GiB", "shape": None, "nightly_tokens_per_s": None}
        settings |= {"pointwise_kernels": False, "take_ahead": "auto", "workload_set": "standard", **changed}
        return _row("choices", figures, argparse.Namespace(**settings), []).split(" | ")[2]

    assert "--take-ahead" not in model_cell() and "--pointwise-kernels" not in model_cell()
    assert model_cell(take_ahead="off").endswith("+ `--take-ahead off`")
    assert "`--pointwise-kernels` + `--take-ahead on`" in model_cell(take_ahead="on", pointwise_kernels=True)
    assert "Kev 512 / Laya 64 new tokens" in model_cell(workload_set="edges")  # the edge set's own models.toml
    assert "Kev 512" not in model_cell()
