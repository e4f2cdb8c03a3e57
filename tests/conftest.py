"""Tests run against a real Redis: database 15 of $REDIS_URL's server, flushed around each test."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis import Redis

from producer.client import Client

TEST_DB = 15


def _test_url() -> str:
    base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    return base.rsplit("/", 1)[0] + f"/{TEST_DB}" if base.count("/") >= 3 else f"{base}/{TEST_DB}"


@pytest.fixture
def redis_url() -> str:
    return _test_url()


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
    from worker.tinymodel import build_tiny_set

    return build_tiny_set(MODEL_CACHE / "tiny").parent


def tiny_config(root: Path, quantization: str = "nf4", **kw: int):
    """A models config over the cached tiny models, written beside them for the given quantisation."""
    from worker.config import load_config
    from worker.tinymodel import tiny_toml

    path = root / f"models-{quantization}.toml"
    path.write_text(tiny_toml(quantization=quantization, **kw))
    return load_config(path)


@pytest.fixture
def nf4_config(tiny_models: Path) -> Path:
    """Path of a models.toml over the tiny models in NF4, for worker subprocesses."""
    tiny_config(tiny_models, "nf4")
    return tiny_models / "models-nf4.toml"


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
