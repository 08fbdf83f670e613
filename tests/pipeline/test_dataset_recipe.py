"""The researcher's recipe end to end on CPU (issue 40): examples/math_dataset/ on a saved
instruct-style model (a folder with a chat template), its JSONL whose extra fields the reward
function uses, a held-out evaluation every 2 steps, step-numbered checkpoints pruned to
`checkpoint_keep_last`; then `rlix eval` and `rlix serve` on the checkpoint's Hugging Face folder.

Checked from the run's own records: the prompts the engine received are the chat-templated ones
(its generation log), the reward function saw the rows' extra fields, samples.jsonl has text and
rewards, the eval metrics and the RL metrics are in metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlix.inference.server.generation_log import read_generations
from rlix.run import run
from serve_kit import start_serve, stop_serve

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math_dataset"
RL_METRICS = ("response_len_mean", "response_len_max", "response_truncated_frac", "entropy", "clip_fraction",
              "grad_norm", "advantage_mean", "advantage_std", "reward_min", "reward_max", "tokens_per_s",
              "staleness_mean", "staleness_max")
SPYING_REWARD = '''
import json
import runpy
from pathlib import Path

score = runpy.run_path(str(Path(__file__).with_name("reward.py")))["reward"]  # the example's own reward


def reward(response, row):
    with open(Path(__file__).with_name("seen.jsonl"), "a") as fh:
        fh.write(json.dumps(sorted(row)) + "\\n")
    return score(response, row)
'''


def templated(tokenizer, rows: list[dict], system: str) -> set[tuple[int, ...]]:
    return {tuple(tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                 {"role": "user", "content": r["question"]}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
            for r in rows}


def scalar_tags(logdir: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for events in logdir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


@pytest.mark.slow
def test_the_dataset_recipe_runs_evaluates_checkpoints_and_serves(tmp_path, tiny_model_dir, fresh_ray):
    # an instruct-style model folder of the user's own: saved weights, tokenizer, chat template
    model_dir = tmp_path / "my-instruct-model"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.chat_template
    tokenizer.save_pretrained(model_dir)
    recipe = tmp_path / "recipe"
    shutil.copytree(EXAMPLE, recipe)
    (recipe / "spy.py").write_text(SPYING_REWARD)
    cfg = yaml.safe_load((recipe / "config.yaml").read_text())
    pipe = cfg["pipelines"][0]
    pipe.update(model=str(model_dir), steps=4, checkpoint_every=1, checkpoint_keep_last=2, checkpoint_keep_best=0,
                record_rollouts=True)
    pipe["task"]["reward"] = "spy:reward"
    pipe["eval"].update(every=2, k=2)
    pipe["rollout"].update(groups_per_step=2, group_size=4, max_new_tokens=8)
    cfg["run_dir"] = str(tmp_path / "run")
    (recipe / "config.yaml").write_text(yaml.safe_dump(cfg))

    summary = run(str(recipe / "config.yaml"))
    assert len(summary["pipelines"]["math"]["records"]) == 4
    out = tmp_path / "run" / "math"

    # the engine received the chat-templated prompts (training's and the held-out set's)
    rows = [json.loads(line) for name in ("problems.jsonl", "heldout.jsonl")
            for line in (recipe / name).read_text().splitlines() if line.strip()]
    system = pipe["task"]["system_prompt"]
    want = templated(tokenizer, rows, system)
    received = {tuple(g["prompt_token_ids"]) for g in read_generations(out / "generations")}
    assert received and received <= want, "a prompt reached the engine without the chat template"
    # the reward function saw each row whole, its extra fields included
    seen = [json.loads(line) for line in (recipe / "seen.jsonl").read_text().splitlines()]
    assert seen and all({"question", "answer", "tolerance", "unit"} <= set(keys) for keys in seen)
    # samples you can read: text, reward and length
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(isinstance(s["prompt"], str) and isinstance(s["response"], str)
                           and 0.0 <= s["reward"] <= 1.0 for s in samples)
    assert {s["prompt"] for s in samples} <= {r["question"] for r in rows}
    # the metrics RL people watch, and the evaluation every 2 steps
    metrics = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == [1, 2, 3, 4]
    for step, row in metrics.items():
        assert all(key in row for key in RL_METRICS), [k for k in RL_METRICS if k not in row]
        assert row["entropy"] > 0 and 0.0 <= row["response_truncated_frac"] <= 1.0
        assert ("eval/pass@1" in row) == (step % 2 == 0), step
    assert all(0.0 <= metrics[s]["eval/pass@1"] <= 1.0 for s in (2, 4))
    tags = scalar_tags(out / "tensorboard")
    assert {"eval/pass@1", "train/entropy", "train/response_len_mean"} <= tags, sorted(tags)
    # step-numbered checkpoints, pruned to the last 2
    kept = sorted(p.name for p in (out / "checkpoint").iterdir() if not p.name.startswith("."))
    assert kept == ["step-000003", "step-000004"], kept
    final = out / "checkpoint" / "step-000004" / "model"
    assert AutoModelForCausalLM.from_pretrained(final) is not None

    # `rlix eval` on that checkpoint prints pass@1 on the held-out set
    task_file = tmp_path / "heldout-task.yaml"
    task_file.write_text(yaml.safe_dump({**pipe["eval"]["task"], "path": str(recipe / "heldout.jsonl"),
                                         "reward": f"{recipe / 'reward.py'}:reward"}))
    done = subprocess.run([sys.executable, "-m", "rlix.cli", "eval", str(final), "--task", str(task_file),
                           "-k", "2", "--max-new-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    (scored,) = figures["eval"]
    assert "pass@1" in done.stdout and 0.0 <= scored["pass@1"] <= 1.0 and scored["prompts"] == 4, done.stdout

    # and `rlix serve` serves it
    proc, base = start_serve("--model", str(final), "--served-model-name", "math", "--max-num-seqs", "2")
    try:
        answer = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "math", "max_tokens": 4, "messages": [{"role": "user", "content": rows[0]["question"]}]})
        assert answer.status_code == 200, answer.text
    finally:
        stop_serve(proc)
