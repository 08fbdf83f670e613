"""Shared test setup: GPU tests skip without CUDA; Ray stays quiet and local."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The `tiny` preset (random Qwen2 shape + small tokenizer), built once per test session."""
    from rlix.models.presets import build_preset

    return build_preset("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture()
def fresh_ray():
    """No Ray connection before or after the test: the code under test starts (and ends) its own."""
    import ray

    ray.shutdown()
    yield
    ray.shutdown()
