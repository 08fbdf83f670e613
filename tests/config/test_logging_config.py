"""The `logging:` section (TensorBoard, wandb) and `scheduler.metrics_port`: strict fields named at
load, a chosen tracker that is not installed named by `rlix check`'s preflight."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlix.cli import main
from rlix.config import load_config
from rlix.config.preflight import problems
from rlix.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(f"run_dir: {tmp_path / 'run'}\n" + text)
    return p


def test_logging_and_metrics_port_load(tmp_path):
    cfg = load_config(write(tmp_path, "logging: {tensorboard: true, wandb: {project: p, mode: offline}}\n"
                                      "scheduler: {metrics_port: 0}\npipelines: [{name: a}]\n"))
    assert cfg.logging.tensorboard and cfg.logging.wandb.project == "p" and cfg.logging.wandb.mode == "offline"
    assert cfg.scheduler.metrics_port == 0
    default = load_config(write(tmp_path, "pipelines: [{name: a}]\n"))
    assert not default.logging.tensorboard and default.logging.wandb is None
    assert default.scheduler.metrics_port is None


@pytest.mark.parametrize("body, field, reason", [
    ("logging: {tensorbord: true}", "logging.tensorbord", "unknown field"),
    ("logging: {wandb: {mode: sometimes}}", "logging.wandb.mode", "'offline', 'online' or 'disabled'"),
    ("logging: {wandb: {project: ''}}", "logging.wandb.project", "at least 1 character"),
    ("logging: {wandb: {projct: x}}", "logging.wandb.projct", "unknown field"),
    ("scheduler: {metrics_port: 70000}", "scheduler.metrics_port", "less than or equal to 65535"),
])
def test_bad_logging_field_is_named(tmp_path, body, field, reason, capsys, monkeypatch):
    path = write(tmp_path, body + "\npipelines: [{name: a}]\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert field in str(exc.value) and reason in str(exc.value) and "\n" not in str(exc.value)
    monkeypatch.setattr("rlix.env.join_ray_with_token", lambda: None)  # leave this process's env be
    assert main(["check", str(path)]) == 2  # `rlix check`: one line naming the field
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


def test_a_chosen_tracker_that_is_not_installed_is_named(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    cfg = load_config(write(tmp_path, "logging: {tensorboard: true, wandb: {mode: offline}}\n"
                                      "pipelines: [{name: a}]\n"))
    found = [p for p in problems(cfg) if p.startswith("logging.")]
    assert len(found) == 2
    assert found[0].startswith("logging.tensorboard: the tensorboard package is not installed")
    assert found[1].startswith("logging.wandb: the wandb package is not installed")
    off = load_config(write(tmp_path, "logging: {wandb: {mode: disabled}}\npipelines: [{name: a}]\n"))
    assert not [p for p in problems(off) if p.startswith("logging.")]  # disabled needs nothing
