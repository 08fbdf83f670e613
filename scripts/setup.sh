#!/usr/bin/env bash
# Create .venv/ at the repo root and install rlix with its dev extras into it.
# --with-vllm: also install vLLM's CPU build into an environment of its own (scripts/setup-vllm.sh),
# for `engine: vllm` pipelines and the vLLM tests; users of the embedded engine need none of it.
# --with-browser: also Debian's chromium and chromedriver (apt-get, only when /usr/bin/chromium is
# missing) and selenium (the `browser` extra), for the dashboard's browser test (`pytest -m browser`).
# torch is pinned to the local CPU build first, so the project's torch range installs nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
WITH_BROWSER=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    --with-browser) WITH_BROWSER=1 ;;
    *) echo "setup: unknown option $arg (known: --with-vllm, --with-browser)" >&2; exit 2 ;;
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
EXTRAS=dev
[ "$WITH_BROWSER" = 1 ] && EXTRAS=dev,browser
.venv/bin/pip install -q --disable-pip-version-check -e ".[$EXTRAS]"
if [ "$WITH_BROWSER" = 1 ]; then
  if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    echo "setup: installing chromium and chromium-driver (apt-get)" >&2
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO="sudo -n"
    if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
        chromium chromium-driver; } >/tmp/rlix-setup-apt.log 2>&1; then
      echo "setup: --with-browser: cannot install chromium and chromium-driver with apt-get (log /tmp/rlix-setup-apt.log; needs root or sudo and Debian's packages)" >&2
      exit 1
    fi
  fi
fi
if [ "$WITH_VLLM" = 1 ]; then
  bash scripts/setup-vllm.sh
fi
