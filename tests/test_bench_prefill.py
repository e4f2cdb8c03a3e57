"""`python -m bench prefill` on the CPU's tiny models: every variant runs every workload without an error, the
same prompts in each, and its row lands in the results file (here a temporary one); our kernels' variant runs
where they do (Triton's interpreter) and is refused where they do not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.common
from bench import prefill
from tests.test_pointwise import run_interpreted
from worker.fastpath import pointwise


def test_every_variant_runs_every_workload_and_writes_its_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(bench.common, "RESULTS_MD", results)
    args = ["--device", "cpu", "--shape", "tiny", "--rows", "8", "--chunks", "256,512", "--groups", "0,1024"]
    report = prefill.main([*args, "--ops", "compiled", "--repeats", "1", "--out", str(tmp_path / "out")])
    runs = report["runs"]
    assert {(r["chunk_tokens"], r["group_tokens"]) for r in runs} == {(256, 0), (256, 1024), (512, 0), (512, 1024)}
    for workload in ("nightly", "long", "choices"):
        mine = [r for r in runs if r["workload"] == workload]
        assert len(mine) == 4 and len({r["prompt_tokens"] for r in mine}) == 1  # the same prompts in every variant
        assert not any(r["kernels_ran"] for r in mine)
    long = [r for r in runs if r["workload"] == "long"]
    assert all(r["prompt_tokens"] == r["rows"] * 1024 for r in long)  # cut at the input limit
    assert all(r["phases_s"][prefill.phase(r)] > 0 for r in runs)  # choices' prompts: in the scoring phase
    assert all(r["phases_s"]["decode_steps"] == 1 for r in runs if r["workload"] != "choices")  # one take each
    (row,) = results.read_text().splitlines()
    assert row.startswith("| prefill | CPU") and "long compiled 512/1024/16" in row and "FELL BACK" not in row
    assert (tmp_path / "out" / "RESULTS-rows.md").read_text().strip() == row


def test_the_shared_prefix_variants_run_the_same_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--prefixes 16,0`: the nightly rows (Laya's template before each prompt) run with their shared prefix
    made by each variant's warm-up run and kept (no timed run makes one), and with none."""
    monkeypatch.setattr(bench.common, "RESULTS_MD", tmp_path / "RESULTS.md")
    args = ["--device", "cpu", "--shape", "tiny", "--rows", "8", "--chunks", "256", "--groups", "1024"]
    args += ["--ops", "compiled", "--prefixes", "16,0", "--only", "nightly,choices", "--repeats", "2"]
    report = prefill.main([*args, "--out", str(tmp_path / "out")])
    runs = report["runs"]
    assert sorted((r["prefix_tokens"], r["workload"]) for r in runs) == [
        (0, "choices"), (0, "nightly"), (16, "choices"), (16, "nightly")
    ]  # fmt: skip
    assert all(r["prefixes_made"] == 0 for r in runs)
    assert all(r["first_prefixes_made"] == (r["prefix_tokens"] > 0) for r in runs if r["workload"] == "nightly")
    for workload in ("nightly", "choices"):
        assert len({r["prompt_tokens"] for r in runs if r["workload"] == workload}) == 1
    assert "nightly compiled 256/1024/0" in (tmp_path / "RESULTS.md").read_text()


def test_the_mlp_block_variants_run_the_same_prompts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--mlp-blocks 4096,0,8`: the loop's default blocks, the MLP whole and in blocks of 8 tokens; each cell
    names a variant that is not the default."""
    monkeypatch.setattr(bench.common, "RESULTS_MD", tmp_path / "RESULTS.md")
    args = ["--device", "cpu", "--shape", "tiny", "--rows", "8", "--chunks", "256", "--groups", "1024"]
    args += ["--ops", "compiled", "--mlp-blocks", "4096,0,8", "--only", "nightly,choices", "--repeats", "1"]
    report = prefill.main([*args, "--out", str(tmp_path / "out")])
    runs = report["runs"]
    assert sorted(r["mlp_block_tokens"] for r in runs) == [0, 0, 8, 8, 4096, 4096]
    for workload in ("nightly", "choices"):
        assert len({r["prompt_tokens"] for r in runs if r["workload"] == workload}) == 1
    row = (tmp_path / "RESULTS.md").read_text()
    assert "nightly compiled 256/1024/16:" in row and "256/1024/16 MLP whole:" in row and "/16 MLP in 8:" in row


def test_our_kernels_variant_runs_them_where_they_run(tmp_path: Path) -> None:
    """Under Triton's interpreter (the CPU) the `kernels` variant's prefill calls ours and says so."""
    out = run_interpreted(
        """
        import json, sys
        from pathlib import Path
        import bench.common
        from bench import prefill
        bench.common.RESULTS_MD = Path(sys.argv[1]) / "RESULTS.md"
        args = ["--device", "cpu", "--shape", "tiny", "--rows", "4", "--chunks", "256", "--groups", "1024",
                "--ops", "compiled,kernels", "--only", "nightly", "--repeats", "1", "--out", sys.argv[1]]
        report = prefill.main(args)
        print(json.dumps([(r["ops"], r["kernels_ran"], r["prompt_tokens"]) for r in report["runs"]]))
        """,
        str(tmp_path),
    )
    runs = json.loads(out.strip().splitlines()[-1])
    assert [(ops, ran) for ops, ran, _ in runs] == [("compiled", False), ("kernels", True)]
    assert runs[0][2] == runs[1][2] > 0


@pytest.mark.skipif(pointwise.INTERPRETED, reason="the interpreter runs our kernels on the CPU")
def test_our_kernels_are_refused_where_they_do_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench.common, "RESULTS_MD", tmp_path / "RESULTS.md")
    with pytest.raises(SystemExit, match="not available"):
        prefill.main(["--device", "cpu", "--shape", "tiny", "--rows", "4", "--ops", "kernels", "--out", str(tmp_path)])


def test_the_mixed_benchs_own_choice_jobs_run_as_a_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mixed-choices`: the choice jobs `bench mixed` submits (its 60-300-word prompts, its labels), in one process."""
    from bench.mixed import CHOICES
    from bench.mixed import workloads as mixed_workloads

    monkeypatch.setattr(bench.common, "RESULTS_MD", tmp_path / "RESULTS.md")
    args = ["--device", "cpu", "--shape", "tiny", "--rows", "8", "--chunks", "512", "--groups", "1024"]
    report = prefill.main(
        [*args, "--ops", "compiled", "--only", "mixed-choices", "--repeats", "1", "--out", str(tmp_path)]
    )
    (run,) = report["runs"]
    assert run["workload"] == "mixed-choices" and run["rows"] == 8
    assert run["phases_s"]["score"] > 0 and "decode_steps" not in run["phases_s"]
    jobs = mixed_workloads(8 / 600 + 1e-6)["choices"][:8]
    assert [j["choices"] for j in jobs] == [CHOICES] * 8 and len(jobs) == 8
