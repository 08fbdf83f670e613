"""`rlix check` on the `dataset` and `reasoning_gym` tasks and `rollout.stop`: a bad setting is
refused with one line naming the field; the shipped example passes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlix.cli import main
from rlix.config import load_config
from rlix.config.preflight import preflight
from rlix.envs import make_task
from rlix.errors import MAX_MESSAGE, ConfigError

pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]


def config(tmp: Path, task: dict | None = None, rollout: dict | None = None, model: str = "tiny") -> Path:
    """One pipeline `p` on a dataset of two rows (rows.jsonl) with its reward (rw.py), both in
    the config's folder and named relative to it; `task` / `rollout` change its settings."""
    (tmp / "rows.jsonl").write_text('{"q": "1+1?", "answer": 2}\n{"q": "2+2?", "answer": 4}\n')
    (tmp / "rw.py").write_text("def score(response, row):\n    return float(str(row['answer']) in response)\n")
    data = {"cluster": {"nodes": 1, "gpus_per_node": 2}, "run_dir": str(tmp / "run"),
            "pipelines": [{"name": "p", "steps": 2, "model": model,
                           "task": {"name": "dataset", "path": "rows.jsonl", "prompt_column": "q",
                                    "reward": "rw:score", **(task or {})},
                           "rollout": rollout or {}}]}
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def refused(path: Path) -> str:
    with pytest.raises(ConfigError) as exc:
        preflight(load_config(path), str(path))
    msg = str(exc.value)
    assert "\n" not in msg and len(msg) <= MAX_MESSAGE, msg
    return msg


def test_a_good_dataset_config_passes_with_paths_read_from_its_folder(tmp_path, monkeypatch):
    path = config(tmp_path)
    monkeypatch.chdir("/")
    cfg = load_config(path)
    preflight(cfg, str(path))


@pytest.mark.parametrize("task, field, reason", [
    ({"path": "nope.jsonl"}, "task.path", "nope.jsonl: no such file"),
    ({"path": "rows.csv"}, "task.path", "not a dataset file"),
    ({"prompt_column": "question"}, "task.prompt_column", "has no column 'question' (its columns: q, answer)"),
    ({"messages_column": "msgs"}, "task.messages_column", "has no column 'msgs'"),
    ({"reward": "no_such_module_xyz:score"}, "task.reward", "cannot be imported"),
    ({"reward": "rw:missing"}, "task.reward", "has no 'missing'"),
    ({"reward": None, "reward_batch": "rw.py:nope"}, "task.reward_batch", "has no 'nope'"),
    ({"reward": None}, "task", "needs one of reward or reward_batch"),
])
def test_bad_dataset_settings_are_refused_naming_the_field(tmp_path, task, field, reason):
    msg = refused(config(tmp_path, task))
    assert f"{field}:" in msg and reason in msg, msg


def test_a_reward_module_that_raises_on_import(tmp_path):
    path = config(tmp_path)
    (tmp_path / "rw.py").write_text("raise RuntimeError('broken module')\n")
    msg = refused(path)
    assert "pipelines[0] (p).task.reward: reward" in msg and "RuntimeError: broken module" in msg, msg


def test_a_model_folder_without_a_chat_template(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer_config.json").write_text("{}")
    msg = refused(config(tmp_path, model=str(model)))
    assert "task.chat_template: the model" in msg and "has no chat template" in msg, msg
    path = config(tmp_path, {"chat_template": False}, model=str(model))
    preflight(load_config(path), str(path))  # plain text needs none
    (model / "chat_template.jinja").write_text("{{ messages }}")
    preflight(load_config(config(tmp_path, model=str(model))), "ok.yaml")


@pytest.mark.parametrize("stop, reason", [
    ([str(i) for i in range(17)], "at most 16 items"),
    (["x" * 65], "at most 64 characters"),
    ([""], "at least 1 character"),
])
def test_stop_strings_are_bounded(tmp_path, stop, reason):
    msg = refused(config(tmp_path, rollout={"stop": stop}))
    assert "pipelines[0].rollout.stop" in msg and reason in msg, msg


def test_reasoning_gym_settings(tmp_path):
    pytest.importorskip("reasoning_gym")
    rg = {"name": "reasoning_gym", "path": None, "prompt_column": "prompt", "reward": None}
    msg = refused(config(tmp_path, {**rg, "dataset": "no_such_generator"}))
    assert "task.dataset: reasoning_gym 'no_such_generator'" in msg, msg
    msg = refused(config(tmp_path, {**rg, "dataset": "basic_arithmetic", "options": {"frobnicate": 1}}))
    assert "task.options: reasoning_gym 'basic_arithmetic'" in msg and "frobnicate" in msg, msg
    path = config(tmp_path, {**rg, "dataset": "basic_arithmetic", "size": 10})
    preflight(load_config(path), str(path))


def test_rlix_check_prints_one_line_naming_the_column(tmp_path):
    path = config(tmp_path, {"prompt_column": "question"})
    out = subprocess.run([sys.executable, "-m", "rlix.cli", "check", str(path)],
                         capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "pipelines[0] (p).task.prompt_column:" in lines[0] and "has no column 'question'" in lines[0]


def test_the_math_dataset_example_passes_rlix_check_and_its_reward_uses_the_rows_fields(monkeypatch, capsys):
    monkeypatch.setattr("rlix.env.join_ray_with_token", lambda: None)
    example = ROOT / "examples" / "math_dataset"
    assert main(["check", str(example / "config.yaml")]) == 0, capsys.readouterr().err
    task = make_task({"name": "dataset", "path": str(example / "problems.jsonl"), "prompt_column": "question",
                      "reward": f"{example / 'reward.py'}:reward"})
    rows = [task.prompt(i) for i in range(len(task))]  # type: ignore[attr-defined]
    assert len(rows) >= 5 and all("tolerance" in p.meta for p in rows)
    division = next(p for p in rows if p.meta["tolerance"] > 0)
    close = f"{division.meta['answer'] + division.meta['tolerance'] / 2:.4f}"
    got = asyncio.run(task.rewards(division, [close, "12345", "no idea"]))
    assert got == [1.0, 0.2, 0.0]
