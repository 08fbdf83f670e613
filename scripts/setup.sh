#!/usr/bin/env bash
# Create .venv/ at the repo root and install rlix with its dev extras into it.
# torch is pinned to the local CPU build first, so the project's torch range installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch==2.13.0 (CPU build) into .venv" >&2
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
fi
echo "setup: installing rlix and its dependencies into .venv" >&2
.venv/bin/pip install -q --disable-pip-version-check -e '.[dev]'
