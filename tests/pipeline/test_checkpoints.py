"""Step-numbered checkpoints: written whole or not at all, pruned to keep_last plus keep_best,
resumed from the newest complete one; a used run_dir refused without --resume/--overwrite; a
checkpoint exported as a Hugging Face folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

import rlix
from rlix.pipeline import checkpoints


def fake_checkpoint(root, step: int, *, complete: bool = True, name: str | None = None):
    path = root / (name or checkpoints.step_name(step))
    path.mkdir(parents=True)
    if complete:
        (path / checkpoints.TRAINER_FILE).write_text(json.dumps({"step": step}))
    return path


def test_a_half_written_checkpoint_is_never_resumed_from_and_is_removed_by_the_next_save(tmp_path):
    root = tmp_path / "checkpoint"
    for step in (2, 4):
        fake_checkpoint(root, step)
    fake_checkpoint(root, 6, complete=False)  # a step name without trainer.json: copied in part
    partial = fake_checkpoint(root, 8, name=checkpoints.partial_path(root, 8).name)  # a save cut short
    assert [c.step for c in checkpoints.complete(root)] == [2, 4]
    assert checkpoints.newest(root) == checkpoints.Checkpoint(4, root / "step-000004")
    removed = checkpoints.prune(root, keep_last=1)
    assert removed == [2] and not partial.exists()
    assert sorted(p.name for p in root.iterdir()) == ["step-000004", "step-000006"]


def test_a_run_before_step_numbering_is_resumed_from_its_checkpoint_trainer(tmp_path):
    root = tmp_path / "checkpoint"
    fake_checkpoint(root, 7, name="trainer")
    assert checkpoints.newest(root) == checkpoints.Checkpoint(7, root / "trainer")
    fake_checkpoint(root, 9)
    assert checkpoints.newest(root).step == 9
    checkpoints.prune(root, keep_last=2)
    assert not (root / "trainer").exists()  # superseded


def test_keep_best_keeps_the_best_by_the_mean_of_the_steps_rows(tmp_path):
    rows = [{"step": 1, "reward": 0.1}, {"step": 2, "reward": 0.9}, {"step": 3, "reward": 0.2},
            {"step": 4, "reward": 0.3}, {"step": 5, "reward": 0.1},
            {"step": 2, "eval_acc": 0.5}, {"step": 4, "eval_acc": 0.7}, {"step": 4, "eval_acc": 0.1}]
    assert checkpoints.step_scores(rows, "eval_acc") == {2: 0.5, 4: pytest.approx(0.4)}
    root = tmp_path / "checkpoint"
    for step in range(1, 6):
        fake_checkpoint(root, step)
    found = checkpoints.complete(root)
    reward = checkpoints.step_scores(rows, "reward")
    assert checkpoints.to_keep(found, 2, 1, reward) == {2, 4, 5}
    assert checkpoints.to_keep(found, 1, 2, reward) == {2, 4, 5}
    assert checkpoints.to_keep(found, 1, 1, reward, mode="min") == {5}  # 1 and 5 tie: the newer ranks first
    # an eval metric ranks only the evaluated steps
    assert checkpoints.to_keep(found, 1, 1, checkpoints.step_scores(rows, "eval_acc")) == {2, 5}
    assert checkpoints.prune(root, 2, 1, reward) == [1, 3]
    assert [c.step for c in checkpoints.complete(root)] == [2, 4, 5]


def tiny_config(tmp_path, **pipeline) -> dict:
    pipe = {"name": "pa", "steps": 4, "checkpoint_every": 1, "checkpoint_keep_last": 2,
            "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 2, "group_size": 2, "max_new_tokens": 4, "concurrency": 2},
            **pipeline}
    return {"cluster": {"nodes": 1, "gpus_per_node": 1}, "scheduler": {"dwell_s": 0.2, "aging_s": 5},
            "run_dir": str(tmp_path / "run"), "pipelines": [pipe]}


def cli(*args: str):
    return subprocess.run([sys.executable, "-m", "rlix.cli", *args], capture_output=True, text=True, timeout=120)


def test_a_run_keeps_step_numbered_checkpoints_pruned_and_refuses_a_rerun(tmp_path, fresh_ray):
    # ranked by the step itself, lowest best: step 1 is kept besides the newest two
    cfg = tiny_config(tmp_path, checkpoint_keep_best=1, checkpoint_best_metric="step", checkpoint_best_mode="min")
    summary = rlix.run(cfg)  # the Python API, with the config as a dict
    assert [r["step"] for r in summary["pipelines"]["pa"]["records"]] == [1, 2, 3, 4]
    root = tmp_path / "run" / "pa" / "checkpoint"
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000003", "step-000004"]
    newest = root / "step-000004"
    assert json.loads((newest / "trainer.json").read_text())["step"] == 4
    assert (newest / "model" / "config.json").is_file() and list((newest / "model").glob("*.safetensors"))

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path)))
    for leftover in [tmp_path / "run" / "summary.json", *(tmp_path / "run" / "pa").glob("*.jsonl")]:
        leftover.unlink()  # the checkpoints alone are a previous run
    again = cli("run", str(path))
    assert again.returncode == 2 and again.stdout == ""
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds a previous run (pa/)" in lines[0] and "--resume" in lines[0], again.stderr

    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    done = cli("export", str(tmp_path / "run" / "pa"), str(out))  # the pipeline's folder: its newest
    assert done.returncode == 0 and str(newest) in done.stdout, done.stderr
    assert AutoModelForCausalLM.from_pretrained(str(out)).config.num_hidden_layers > 0
    assert (out / "tokenizer_config.json").is_file() or (out / "tokenizer.json").is_file()
    busy = cli("export", str(newest), str(out))
    assert busy.returncode == 2 and len(busy.stderr.strip().splitlines()) == 1 and "not an empty folder" in busy.stderr


@pytest.mark.slow
def test_resume_continues_from_the_newest_complete_checkpoint(tmp_path, fresh_ray):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tmp_path, steps=3)))
    first = cli("run", str(path))
    assert first.returncode == 0, first.stderr[-2000:]
    root = tmp_path / "run" / "pa" / "checkpoint"
    fake_checkpoint(root, 9, name=checkpoints.partial_path(root, 9).name)  # a save killed half-way
    fake_checkpoint(root, 8, complete=False)
    resumed = cli("run", str(path), "--resume", "--set", "pipelines.pa.steps=5")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {root / 'step-000003'} at step 3" in resumed.stdout, resumed.stdout[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "pa" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in root.iterdir()) == ["step-000004", "step-000005", "step-000008"]


def test_export_of_a_sharded_checkpoint_writes_a_folder_transformers_loads(tmp_path, tiny_model_dir):
    """A dcp/ checkpoint without model/ (a sharded trainer's, saved off a publish): its float32
    parameters, whole in the dcp files, become the run's model folder with these weights."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    trained = {n: (p.detach().float() + 0.25) for n, p in base.named_parameters()}
    ckpt = tmp_path / "step-000005"
    dcp.save({"model": trained, "trainer_step": torch.tensor(5)}, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 5, "model": str(tiny_model_dir)}))
    done = cli("export", str(ckpt), str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained[name].to(p.dtype)), name
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    bad = cli("export", str(wrong), str(tmp_path / "hf2"))
    assert bad.returncode == 2 and "no complete checkpoint under it" in bad.stderr and len(bad.stderr.splitlines()) == 1
