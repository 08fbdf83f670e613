"""Issue 39, acceptance 3: the plain PyTorch loop (examples/external_loop/loop.py, nothing of
rlix but rlix.client) runs as a pipeline through `rlix run` of its example config: every step's
weights reach the shards, audited equal to the checksums the loop sent."""

from __future__ import annotations

import sys
from pathlib import Path

import ray
import yaml

from rlix.run import run

ROOT = Path(__file__).resolve().parents[2]


def test_the_plain_loop_example_runs_as_a_pipeline(tmp_path):
    cfg = yaml.safe_load((ROOT / "examples" / "external_loop" / "config.yaml").read_text())
    cfg["run_dir"] = str(tmp_path / "run")
    (pipe,) = cfg["pipelines"]
    pipe["steps"] = 4
    pipe["external"]["command"] = [sys.executable, str(ROOT / "examples" / "external_loop" / "loop.py")]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ray.shutdown()
    try:
        summary = run(str(path))
    finally:
        ray.shutdown()
    result = summary["pipelines"]["plain-loop"]
    log = (tmp_path / "run" / "plain-loop" / "program.log").read_text()
    assert result["state"] == "done" and result["steps"] == 4, log[-2000:]
    assert len(result["rewards"]) == 4 and all(0 <= r <= 1 for r in result["rewards"])
    assert result["published"] == [0, 1, 2, 3, 4]
    assert result["checksum_checks"] >= 1 and result["checksum_mismatches"] == [], result
    assert [line for line in log.splitlines() if line.startswith("step ")][-1].startswith("step 4: reward")
