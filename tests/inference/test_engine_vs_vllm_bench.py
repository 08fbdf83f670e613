"""bench/engine_vs_vllm.py end to end with --quick: a real rlix server and a real vLLM CPU
server on the tiny preset; its one JSON line has the issue's keys, and both servers (with
everything they started) are gone when it returns."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kit import need_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    """Running, not a zombie awaiting its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_quick_run_prints_the_figures_and_ends_both_servers(tmp_path):
    need_vllm()
    keep = tmp_path / "rounds.json"
    # captured output is no terminal: the script draws no progress bar into it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_vs_vllm.py"), "--quick", "--rounds", "2",
                           "--keep", str(keep)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    figures = json.loads(lines[0])
    for key in ("engine_vs_vllm_c1", "engine_vs_vllm_c8", "engine_vs_vllm_c32",
                "ttft_p50_c8_rlix_s", "ttft_p50_c8_vllm_s"):
        assert isinstance(figures[key], float) and figures[key] > 0, key
    kept = json.loads(keep.read_text())
    assert len(kept["rounds"]) == 2 and kept["rounds"][0]["order"] == kept["rounds"][1]["order"][::-1]
    assert kept["ended"] == {"vllm": True, "rlix": True}
    pids = [pid for group in kept["pids"].values() for pid in group]
    assert len(pids) >= 3  # each guard and its server, and vLLM's engine core
    assert not [pid for pid in pids if _alive(pid)]
