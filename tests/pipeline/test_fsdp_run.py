"""`rlix run` with `train.fsdp` on CPU: a pipeline whose 2 trainer ranks each hold a shard trains
through the time-sharing loop, publishes every version (each rank's rows into rank 0's cache),
keeps the run's guarantees, checkpoints every rank's shard, and resumes from them."""

from __future__ import annotations

import pytest
import yaml

from rlix.run import run
from test_end_to_end import check_guarantees


@pytest.mark.slow
def test_an_fsdp_pipeline_trains_checkpoints_and_resumes(tmp_path, fresh_ray):
    pipe = {"name": "pa", "model": "tiny", "train_gpus": 2, "min_shards": 1, "max_shards": 2,
            "max_staleness": 1, "steps": 3, "seed": 1, "checkpoint_every": 3,
            "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 4, "group_size": 4, "max_new_tokens": 8, "concurrency": 4},
            "train": {"fsdp": True, "micro_batch_size": 4}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 2}, "scheduler": {"dwell_s": 0.2, "aging_s": 5},
           "control_plane": "rlix", "run_dir": str(tmp_path / "run"), "pipelines": [pipe]}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    summary = run(str(path))
    check_guarantees(summary)
    records = summary["pipelines"]["pa"]["records"]
    assert len(records) == 3 and all(r["train_ranks"] == 2 for r in records)
    ckpt = tmp_path / "run" / "pa" / "checkpoint" / "step-000003"
    assert (ckpt / "dcp" / ".metadata").is_file() and (ckpt / "model" / "config.json").is_file()
    pipe["steps"] = 5
    path.write_text(yaml.safe_dump(cfg))
    resumed = run(str(path), resume=True)
    check_guarantees(resumed)
    assert [r["step"] for r in resumed["pipelines"]["pa"]["records"]][-2:] == [4, 5]
