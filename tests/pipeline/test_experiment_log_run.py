"""`rlix run` with `logging:` and `scheduler.metrics_port`: a one-pipeline run on CPU writes its
steps to TensorBoard (the rewards of metrics.jsonl) and to wandb offline, and names the
scheduler's Prometheus endpoint in its log."""

from __future__ import annotations

import json

import pytest
import ray
import yaml

from rlix.run import run


@pytest.mark.slow
def test_run_logs_steps_to_tensorboard_and_wandb(tmp_path):
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # deferred: slow

    pipe = {"name": "pa", "model": "tiny", "steps": 2, "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 2, "group_size": 2, "max_new_tokens": 4, "concurrency": 2}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 1}, "scheduler": {"metrics_port": 0},
           "run_dir": str(tmp_path / "run"), "pipelines": [pipe],
           "logging": {"tensorboard": True, "wandb": {"project": "rlix-test", "mode": "offline"}}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ray.shutdown()
    try:
        summary = run(str(path))
    finally:
        ray.shutdown()
    assert summary["pipelines"]["pa"]["steps"] == 2
    pdir = tmp_path / "run" / "pa"
    rows = [json.loads(line) for line in (pdir / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(pdir / "tensorboard"))
    acc.Reload()
    logged = acc.Scalars("train/reward")
    assert [e.step for e in logged] == [r["step"] for r in rows] == [1, 2]
    assert [e.value for e in logged] == pytest.approx([r["reward"] for r in rows], abs=1e-6)
    assert list((pdir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert json.loads((pdir / "wandb" / "rlix_run.json").read_text())["last_step"] == 2
    assert "scheduler metrics (Prometheus): http://127.0.0.1:" in (tmp_path / "run" / "run.log").read_text()
