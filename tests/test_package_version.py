"""rlix's version as `rlix --version` and its servers' GET /version report it: the installed
distribution's, else the source tree's constant, which must equal pyproject.toml's."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import rlix
from rlix import version as V

ROOT = Path(__file__).resolve().parents[1]


def test_the_constant_is_pyprojects_version():
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert V.VERSION == rlix.__version__ == tomllib.load(f)["project"]["version"]


def test_installed_distribution_first_else_the_constant(monkeypatch):
    V.package_version.cache_clear()
    try:
        assert V.package_version() == importlib.metadata.version("rlix")

        def not_installed(name: str) -> str:
            raise importlib.metadata.PackageNotFoundError(name)

        monkeypatch.setattr(V, "version", not_installed)
        monkeypatch.setattr(V, "VERSION", "9.9.9-source")  # tells the fallback apart
        V.package_version.cache_clear()
        assert V.package_version() == "9.9.9-source"
    finally:
        monkeypatch.undo()
        V.package_version.cache_clear()
    assert V.package_version() == importlib.metadata.version("rlix")
