"""`bench timeline`: its log read back, each workload's lines from its first submit on, idle polls left out."""

from __future__ import annotations

from pathlib import Path

from bench.timeline import Line, read, workload_lines


def test_each_workload_is_timed_from_its_first_submit_and_idle_polls_are_left_out(tmp_path: Path) -> None:
    log = tmp_path / "timeline.log"
    log.write_text(
        "step 100.0000 100.50\n"  # an idle poll before the workload
        "cli_imports 100.2000 170.00 submit\n"
        "enqueue_chunk 100.3700 50.00 256\n"
        "step 100.3000 101.00\n"  # an idle poll inside it
        "engine_run 100.4000 500.00 256\n"
        "cli_imports 101.0000 150.00 status\n"
        "garbage\n"
    )
    lines = read(log)
    assert [x.label for x in lines] == ["step", "cli_imports", "step", "enqueue_chunk", "engine_run", "cli_imports"]
    ((name, timed),) = workload_lines(lines, {"choices": (100.1, 101.5)})
    assert name == "choices"
    assert [(x.label, round(x.start_s), x.note) for x in timed] == [
        ("cli_imports", 0, "submit"),
        ("enqueue_chunk", 170, "256"),
        ("engine_run", 200, "256"),
        ("cli_imports", 800, "status"),
    ]
    assert timed[2] == Line("engine_run", timed[2].start_s, 500.0, "256")
