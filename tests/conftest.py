"""Tests run against a real Redis the suite starts itself (a private redis-server on a free port), flushed
around each test; never a Redis it did not start. KEVLAYA_TEST_REDIS_URL names another one explicitly (its
database is flushed: point it only at a Redis you own)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from producer.client import Client
from worker.tools.embedded_redis import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    explicit = os.environ.get("KEVLAYA_TEST_REDIS_URL")
    if explicit:
        yield explicit
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def redis(redis_url: str) -> Iterator[Redis]:
    conn = Redis.from_url(redis_url)
    conn.flushdb()
    yield conn
    conn.flushdb()
    conn.close()


@pytest.fixture
def client(redis: Redis) -> Client:
    return Client(redis=redis)


MODEL_CACHE = Path(__file__).resolve().parent.parent / ".kevlaya" / "test-models"


@pytest.fixture(scope="session")
def tiny_models() -> Path:
    """Tiny Qwen2 base + Kev/Laya adapters (random weights), built once and cached under .kevlaya/."""
    from worker.tools.tinymodel import build_tiny_set

    return build_tiny_set(MODEL_CACHE / "tiny").parent


def tiny_config(root: Path, quantization: str = "nf4", **kw: int):
    """A models config over the cached tiny models, written beside them for the given quantisation."""
    from worker.config import load_config
    from worker.tools.tinymodel import tiny_toml

    path = root / f"models-{quantization}.toml"
    path.write_text(tiny_toml(quantization=quantization, **kw))
    return load_config(path)


@pytest.fixture
def nf4_config(tiny_models: Path) -> Path:
    """Path of a models.toml over the tiny models in NF4, for worker subprocesses."""
    tiny_config(tiny_models, "nf4")
    return tiny_models / "models-nf4.toml"


@pytest.fixture
def blocked_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every matmul `worker.fastpath.gemm` runs from here on as a block of a larger one (a spy on
    its one matmul call)."""
    from worker.fastpath import gemm  # torch: only for the tests that ask

    rows: list[int] = []
    real = gemm._matmul_into

    def spy(out: Any, x: Any, weight: Any, bias: Any) -> None:
        rows.append(x.shape[0])
        real(out, x, weight, bias)

    monkeypatch.setattr(gemm, "_matmul_into", spy)
    return rows


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` skip cleanly where there is no CUDA device (CI, this 2-core machine)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu:
        item.add_marker(skip)
