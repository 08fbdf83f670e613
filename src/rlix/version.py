"""rlix's version: what `rlix --version` and the servers' GET /version report.

A module of its own at the bottom of the layers (nothing of rlix imported), so the engine server
and the router can report it without importing the package root, whose lazy names reach up to
`rlix.run`."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

#: pyproject.toml's version (a test keeps the two equal): what `package_version` answers where
#: rlix runs from a source tree that is not installed (PYTHONPATH=src)
VERSION = "0.1.0"


@functools.lru_cache(maxsize=1)
def package_version() -> str:
    """The installed `rlix` distribution's version (what pip and `importlib.metadata` report, so
    an installed build that differs from this source file says so), else `VERSION`."""
    try:
        return version("rlix")
    except PackageNotFoundError:
        return VERSION
