"""`rlix run` with an `eval:` section: a short run of the tiny model evaluates its held-out
dataset every 2 steps (rows in metrics.jsonl and TensorBoard beside the training metrics, none
of it in the training accounting), and `rlix eval CONFIG --checkpoint latest` scores the
checkpoint the run left."""

from __future__ import annotations

import json

import pytest
import ray
import yaml

from rlix.cli import main
from rlix.run import run


@pytest.mark.slow
def test_a_run_evaluates_every_n_steps_and_rlix_eval_scores_its_checkpoint(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # deferred: slow

    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"q": f"Repeat: {c}", "c": c}) + "\n" for c in "abcde"))
    (tmp_path / "rw.py").write_text("def score(response, row):\n    return float(response[:1] == row['c'])\n")
    task = {"name": "dataset", "path": "held.jsonl", "prompt_column": "q", "reward": "rw:score",
            "chat_template": False}
    pipe = {"name": "pa", "model": "tiny", "steps": 4, "checkpoint_every": 2,
            "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 2, "group_size": 2, "max_new_tokens": 4, "concurrency": 2},
            "eval": {"every": 2, "task": task, "samples": 3, "k": 2, "threshold": 0.5}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 1}, "run_dir": str(tmp_path / "run"), "pipelines": [pipe],
           "logging": {"tensorboard": True}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ray.shutdown()
    try:
        summary = run(str(path))
    finally:
        ray.shutdown()
    result = summary["pipelines"]["pa"]
    assert result["steps"] == 4
    pdir = tmp_path / "run" / "pa"
    rows = [json.loads(line) for line in (pdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    evaluated = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for r in evaluated:
        assert r["eval/prompts"] == 3 and r["eval/failed"] == 0 and r["eval/k"] == 2
        assert 0 <= r["eval/pass@1"] <= r["eval/pass@k"] + 1 and 0 <= r["eval/reward_mean"] <= 1
        assert "reward" in r and "loss" in r  # beside the training metrics, in the step's row
    # the summary's records keep them; the training accounting knows nothing of eval samples
    assert [rec.get("evaluation", {}).get("eval/pass@1") for rec in result["records"]] == [
        None, evaluated[0]["eval/pass@1"], None, evaluated[1]["eval/pass@1"]]
    accounting = result["accounting"]
    assert accounting["trained"] == 4 * 2 * 2 and not any("eval" in reason for reason in accounting["dropped"])
    acc = EventAccumulator(str(pdir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/pass@1")] == [2, 4]
    assert [e.value for e in acc.Scalars("eval/pass@k")] == pytest.approx([r["eval/pass@k"] for r in evaluated])

    capsys.readouterr()
    assert main(["eval", str(path), "--checkpoint", "latest", "-k", "0"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("pa: pass@1 ") and "(checkpoint step 4)" in out[0]
    (row,) = json.loads(out[-1])["eval"]
    assert row["checkpoint_step"] == 4 and row["prompts"] == 3 and row["pass@k"] is None
