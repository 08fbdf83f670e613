"""The package's layering (pyproject's import-linter contracts) holds, and would catch a breach."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (dev extra)")


def lint(src: Path, workdir: Path) -> subprocess.CompletedProcess:
    """lint-imports with the project's contracts over the package under `src`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_layers(tmp_path):
    out = lint(ROOT / "src", tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize("module,imported", [
    ("inference/engine/core.py", "rlix.inference.router.relay"),  # engine -> router
    ("weights/sync.py", "rlix.pipeline.coordinator"),  # weights -> pipeline
])
def test_a_lower_layer_importing_a_higher_one_fails(tmp_path, module, imported):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "rlix", src / "rlix", ignore=shutil.ignore_patterns("__pycache__"))
    target = src / "rlix" / module
    target.write_text(target.read_text() + f"\nimport {imported}  # a breach\n")
    out = lint(src, tmp_path)
    assert out.returncode != 0, out.stdout
    assert "BROKEN" in out.stdout and imported in out.stdout
