"""The models config and loading refuse to start on anything wrong, with a message naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.errors import ConfigError
from worker.config import load_config
from worker.engine import Engine
from worker.tools.tinymodel import TinyShape, build_adapter, build_base


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def test_missing_base_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no checkpoint at .*nowhere"):
        load_config(write(tmp_path, '[base]\npath = "nowhere"\n'))


def test_missing_adapter_is_refused(tiny_models: Path, tmp_path: Path) -> None:
    text = f'[base]\npath = "{tiny_models / "base"}"\n[models.kev]\nadapter = "missing"\n'
    with pytest.raises(ConfigError, match="model 'kev': no PEFT adapter"):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            '[base]\npath = "b"\nquantization = "int3"\n',
            "quantization = 'int3': input should be 'nf4', 'fp4' or 'none'",
        ),
        ('[base]\npath = "b"\ncompute_dtype = "fp8"\n', "compute_dtype = 'fp8'"),
        (
            '[base]\npath = "b"\n[models.kev]\nmax_new_token = 5\n',
            "[models.kev] unknown key 'max_new_token' (did you mean 'max_new_tokens'?)",
        ),
        ('[base]\npath = "b"\n[models.kev]\nbase = "other"\n', "names base 'other'"),
        ('[base]\npath = "b"\n[models.kev.escalation]\nthreshold = 0.5\n', "has no escalates_to"),
        ("[models.kev]\n", "needs a [base] table"),
        ('[base]\npath = "b"\n[models.kve]\n', "[models.kve] is not a known model (did you mean [models.kev]?"),
        ('[base]\npath = "b"\n[models.laya]\nescalates_to = "laya"\n', "not another configured model"),
        ('[base]\npath = "b"\n[models.laya]\nescalates_to = "nobody"\n', "not another configured model"),
        ('[base]\npath = "b"\n[models.kev]\nescalates_to = "laya"\n', "escalates itself: one step only"),
        (
            '[base]\npath = "b"\n[models.kev]\njob_may_set_system = "yes"\n',
            "job_may_set_system = 'yes': input should be a valid boolean",
        ),
        (
            '[base]\npath = "b"\n[models.kev]\nmax_new_tokens = "eight"\n',
            "max_new_tokens = 'eight': input should be a valid integer",
        ),
        ('[base]\npath = "b"\n[model.kev]\n', "unknown key 'model' (did you mean 'models'?)"),
        ('[bases.x]\npathh = "b"\n', "[bases.x] missing key 'path'"),
        ("[base\n", "invalid TOML"),
    ],
)
def test_invalid_config_names_the_problem(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), check_paths=False)
    assert fragment in str(info.value)


def test_adapter_that_does_not_fit_its_base_is_refused(tiny_models: Path, tmp_path: Path) -> None:
    other = build_base(tmp_path / "wide", shape=TinyShape(hidden=128, intermediate=256))
    adapter = build_adapter(other, tmp_path / "wide-adapter", name="kev", seed=3)  # shapes differ from the base
    text = f'[base]\npath = "{tiny_models / "base"}"\nquantization = "none"\n[models.kev]\nadapter = "{adapter}"\n'
    with pytest.raises(ConfigError, match="adapter for 'kev' .* does not fit base 'default'"):
        Engine(load_config(write(tmp_path, text)), device="cpu")


def test_separate_bases_are_each_loaded_once(tiny_models: Path, tmp_path: Path) -> None:
    base = tiny_models / "base"
    text = (
        f'[bases.a]\npath = "{base}"\nquantization = "none"\n[bases.b]\npath = "{base}"\nquantization = "none"\n'
        f'[models.kev]\nbase = "a"\nadapter = "{tiny_models / "adapter-kev"}"\n'
        f'[models.laya]\nbase = "b"\nadapter = "{tiny_models / "adapter-laya"}"\n'
    )
    engine = Engine(load_config(write(tmp_path, text)), device="cpu")
    assert sorted(engine.bases) == ["a", "b"]
    assert engine.base_for("kev") is not engine.base_for("laya")
    from shared.job import Job

    outs = engine.run([Job(custom_id="1", model="kev", prompt="p"), Job(custom_id="2", model="laya", prompt="p")])
    assert all(o.error is None for o in outs)
