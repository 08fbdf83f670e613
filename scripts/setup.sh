#!/usr/bin/env bash
# Create .venv/ at the repo root and install rlix with its dev extras into it.
# --with-vllm: also install vLLM's CPU build into an environment of its own (scripts/setup-vllm.sh),
# for `engine: vllm` pipelines and the vLLM tests; users of the embedded engine need none of it.
# torch is pinned to the local CPU build first, so the project's torch range installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    *) echo "setup: unknown option $arg (known: --with-vllm)" >&2; exit 2 ;;
  esac
done
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
if [ "$WITH_VLLM" = 1 ]; then
  bash scripts/setup-vllm.sh
fi
