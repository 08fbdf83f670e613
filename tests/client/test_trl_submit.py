"""Issue 39, acceptance 1 on a shared cluster: `rlix up`, then rlix's own GRPO pipeline and TRL's
GRPOTrainer (an external pipeline) submitted as two jobs from two processes; both run to the
end on the cluster's 2 fake GPUs, the scheduler moving GPUs between them, and `rlix down`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_a_trl_job_and_a_native_job_share_an_up_cluster(tmp_path):
    env = {**os.environ, "RLIX_CACHE_DIR": str(tmp_path / "cache"), "TRL_OUTPUT_DIR": str(tmp_path / "trl-out")}
    env.pop("RAY_ADDRESS", None)

    def cli(*args: str, timeout: float = 300) -> str:
        out = subprocess.run([sys.executable, "-m", "rlix.cli", *args], capture_output=True, text=True, env=env,
                             timeout=timeout)
        assert out.returncode == 0, f"rlix {' '.join(args)} -> {out.returncode}: {out.stderr[-2000:]}"
        return out.stdout

    example = yaml.safe_load((ROOT / "examples" / "trl_grpo" / "config.yaml").read_text())
    native, trl = example["pipelines"]
    native.update(steps=150, priority=1)
    trl["external"]["command"] = [sys.executable, str(ROOT / "examples" / "trl_grpo" / "train.py")]
    jobs = {}
    for pipe in (native, trl):
        path = tmp_path / f"{pipe['name']}.yaml"
        path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "runs" / pipe["name"]), "pipelines": [pipe]}))
        jobs[pipe["name"]] = str(path)
    assert "rlix cluster up at" in cli("up", "--num-gpus", "2", "--num-cpus", "8", "--dwell-s", "0.2", "--aging-s", "5")
    try:
        subs = [subprocess.Popen([sys.executable, "-m", "rlix.cli", "submit", p], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env) for p in jobs.values()]
        for proc in subs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
        deadline = time.monotonic() + 600
        while True:
            states = {j["name"]: j for j in json.loads(cli("jobs", "--json"))}
            if all(j["state"] in ("done", "failed", "cancelled") for j in states.values()) and len(states) == 2:
                break
            assert time.monotonic() < deadline, states
            time.sleep(2)
        assert {n: j["state"] for n, j in states.items()} == {"native": "done", "trl-grpo": "done"}, states
    finally:
        cli("down", timeout=300)
    summaries = {n: json.loads((tmp_path / "runs" / n / "summary.json").read_text()) for n in jobs}
    ours, theirs = summaries["native"]["pipelines"]["native"], summaries["trl-grpo"]["pipelines"]["trl-grpo"]
    assert ours["steps"] == 150 and theirs["steps"] == trl["steps"]
    assert theirs["reward_last5"] > theirs["reward_first5"], theirs["rewards"]
    assert theirs["checksum_checks"] >= 1 and theirs["checksum_mismatches"] == []
    # the shared scheduler moved GPUs between the two jobs: one of its GPUs held by both
    changes = summaries["trl-grpo"]["role_changes"] + summaries["native"]["role_changes"]
    held = {g: {c["after"].split("/")[0] for c in changes if c["gpu"] == g and "/" in c["after"]} for g in (0, 1)}
    assert any(h >= {"native", "trl-grpo"} for h in held.values()), held
