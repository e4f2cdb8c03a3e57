"""`python -m bench variants`: its arguments on a machine without CUDA (its timings need the GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", "variants", *args], capture_output=True, text=True, timeout=120
    )


def test_an_unknown_section_is_refused_in_one_line() -> None:
    out = run("--only", "nf4,bogus")
    assert out.returncode == 2
    assert "unknown section(s) bogus; choose from nf4, silu, rms" in out.stderr


def test_without_cuda_it_says_what_it_needs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run as if the machine had no CUDA (whatever it has): exit 2 with one line saying what it needs."""
    import torch

    from bench import variants

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench variants", "--only", "silu"])
    with pytest.raises(SystemExit) as exited:
        variants.main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "bench variants: needs CUDA and Triton"
