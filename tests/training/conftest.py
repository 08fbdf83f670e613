"""Fixtures for the trainer tests."""

from __future__ import annotations

import pytest

from trainer_helpers import make_samples


@pytest.fixture
def samples_factory():
    return make_samples
