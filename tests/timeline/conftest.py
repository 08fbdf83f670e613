"""The timeline's tests call `rlix.cli.main` in-process, which sets RAY_AUTH_MODE for a Ray
cluster it may join (rlix.env.join_ray_with_token); Ray tests later in the same session start
their own cluster and must not inherit it (their GCS would want a token their driver never
sends)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _ray_auth_mode_as_it_was():
    before = os.environ.get("RAY_AUTH_MODE")
    yield
    if before is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = before
