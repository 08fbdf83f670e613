"""rlix.client against a real pipeline: `rlix run` starts a program (order_program.py) for an
`external:` pipeline, which calls the hooks out of order and then runs one step. Every refused
call is a typed error that changed nothing; the step's weights reached the shards (audited)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ray
import yaml

import rlix.client
from rlix.run import run

HERE = Path(__file__).resolve().parent


def test_connect_outside_a_program_rlix_started_is_a_client_error(monkeypatch):
    for var in ("RLIX_CLIENT_RAY_ADDRESS", "RLIX_CLIENT_NAMESPACE", "RLIX_CLIENT_ACTOR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(rlix.client.ClientError, match="not started by rlix"):
        rlix.client.connect()


def test_calls_out_of_order_are_refused_and_a_step_reaches_the_shards(tmp_path):
    results = tmp_path / "answers.json"
    pipe = {"name": "ext", "model": "tiny", "steps": 1, "max_shards": 1, "audit_weights": True,
            "external": {"command": [sys.executable, str(HERE / "order_program.py"), str(results)],
                         "start_timeout_s": 120, "after_training_timeout_s": 120}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 1}, "control_plane": "rlix", "run_dir": str(tmp_path / "run"),
           "pipelines": [pipe]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ray.shutdown()
    try:
        summary = run(str(path))
    finally:
        ray.shutdown()
    log = (tmp_path / "run" / "ext" / "program.log").read_text()
    assert results.is_file(), log
    got = json.loads(results.read_text())
    refused = {k: v for k, v in got.items() if isinstance(v, dict) and "error" in v}
    assert set(refused) == {"before_start", "second_start", "after_without_before", "wrong_step", "before_again"}, got
    assert all(v["error"] == "ClientOrderError" for v in refused.values()), refused
    assert "before start()" in refused["before_start"]["message"]
    assert "called already" in refused["second_start"]["message"]
    assert "the next step is 0" in refused["wrong_step"]["message"]
    assert "holds the training GPUs" in refused["before_again"]["message"]
    assert "ok" in got["start"] and "ok" in got["before"] and "ok" in got["after"], got
    assert got["generate_status"] == 200  # the pipeline's router, at info.base_url
    assert int(got["generate_versions"][-1]["version"]) == 1, got  # the step's weights, not version 0
    result = summary["pipelines"]["ext"]
    assert result["state"] == "done" and result["steps"] == 1 and result["rewards"] == [0.5], result
    assert result["published"] == [0, 1]
    assert result["checksum_checks"] >= 1 and result["checksum_mismatches"] == [], result
