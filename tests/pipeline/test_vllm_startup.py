"""`rlix run` with `engine: vllm` on the console: the vLLM servers' start-up (which server, what
phase, seconds) is printed while they start, and the first server's healthy line comes before
the first step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from kit import need_vllm  # noqa: E402

pytestmark = pytest.mark.vllm


def test_vllm_start_up_is_shown_before_the_first_step(tmp_path):
    need_vllm()
    run_dir = tmp_path / "run"
    cfg = {
        "cluster": {"nodes": 1, "gpus_per_node": 2},
        "scheduler": {"dwell_s": 0, "aging_s": 10},
        "control_plane": "rlix",
        "run_dir": str(run_dir),
        "pipelines": [{
            "name": "v", "model": "tiny", "engine": "vllm",
            "vllm": {"max_num_seqs": 16, "cpu_kvcache_gib": 1},
            "train_gpus": 1, "min_shards": 1, "max_shards": 1, "steps": 2, "seed": 1,
            "task": {"name": "pattern", "patterns": ["z"]},
            "rollout": {"groups_per_step": 2, "group_size": 4, "max_new_tokens": 8, "concurrency": 4},
            "train": {"lr": 0.003, "micro_batch_size": 8},
        }],
    }
    path = tmp_path / "vllm_startup.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "rlix.cli", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=560)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    first_step = next(i for i, line in enumerate(lines) if re.search(r"v: step 1/2", line))
    starting = [i for i, line in enumerate(lines[:first_step]) if re.search(r"v: vllm server 0 .+ \(\d+s\)$", line)]
    assert starting, out[-3000:]
    # the first server's start-up ends with a line before the first step (a server the scheduler
    # starts later on a freed GPU reports its own start-up meanwhile)
    healthy = [i for i, line in enumerate(lines) if re.search(r"v: vllm server 0 healthy after \d+s", line)]
    assert healthy and starting[0] < healthy[0] < first_step, out[-3000:]
