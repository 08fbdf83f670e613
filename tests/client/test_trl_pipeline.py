"""Issue 39, acceptance 1: TRL's GRPOTrainer (trl from PyPI, unmodified; examples/trl_grpo/train.py
through rlix.client.trl) and rlix's own GRPO pipeline time-share 2 fake GPUs in one `rlix run`:
both rewards rise, the scheduler moved GPUs between them, the TRL pipeline's requests cut by a
preemption were re-dispatched, and every weight version that reached its shards was audited equal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray
import yaml

from rlix.run import run

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("trl")


@pytest.mark.slow
def test_trl_grpo_and_rlix_grpo_share_the_gpus_to_the_end(tmp_path, monkeypatch):
    cfg = yaml.safe_load((ROOT / "examples" / "trl_grpo" / "config.yaml").read_text())
    cfg["run_dir"] = str(tmp_path / "run")
    native, trl = cfg["pipelines"]
    native["steps"] = 200  # still running while TRL trains (its program takes seconds to import TRL)
    native["priority"] = 1  # its demand takes GPUs from TRL's shards, mid-request
    trl["external"]["command"] = [sys.executable, str(ROOT / "examples" / "trl_grpo" / "train.py")]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("TRL_OUTPUT_DIR", str(tmp_path / "trl-output"))
    monkeypatch.setenv("TRL_MAX_COMPLETION", "32")  # requests long enough to be in flight at a preemption
    ray.shutdown()
    try:
        summary = run(str(path))
    finally:
        ray.shutdown()
    a, b = summary["pipelines"]["native"], summary["pipelines"]["trl-grpo"]
    assert a["state"] == "done" and a["steps"] == 200, a.get("error")
    assert b["state"] == "done" and b["steps"] == trl["steps"], b.get("error")
    for p in (a, b):
        assert p["reward_last5"] > p["reward_first5"], (p["pipeline"], p["rewards"])
    # the scheduler moved GPUs between them: each GPU held by both pipelines at some point
    holders = {g: {c["after"].split("/")[0] for c in summary["role_changes"] if c["gpu"] == g and "/" in c["after"]}
               for g in (0, 1)}
    assert any(h >= {"native", "trl-grpo"} for h in holders.values()), holders
    assert b["router_redispatched"] >= 1, b["router_redispatched"]  # preempted mid-request, sent again
    # its weights: every version published reached shards, each sync audited against the client's checksums
    assert b["published"] == list(range(trl["steps"] + 1))
    served = {v for history in b["shard_history"].values() for v in history}
    assert max(served) >= trl["steps"] - 1 and served <= set(b["published"]), b["shard_history"]
    assert b["checksum_checks"] >= 1 and b["checksum_mismatches"] == [] and b["version_mismatches"] == []
