"""Config loading: good files load; bad ones fail with file, field and reason on one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlix.config import load_config
from rlix.config.preflight import preflight
from rlix.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_shipped_example_loads():
    cfg = load_config(ROOT / "examples" / "cluster.yaml")
    assert [p.name for p in cfg.pipelines] == ["pattern", "arithmetic"]
    assert cfg.cluster.topology().num_gpus == 2
    spec = cfg.pipelines[0].spec()
    assert spec.max_shards == 2 and spec.partial_overlap


def test_auto_cluster_is_accepted_and_must_be_resolved(tmp_path):
    cfg = load_config(write(tmp_path, "cluster: {nodes: auto, gpus_per_node: auto}\npipelines: [{name: a}]\n"))
    assert cfg.cluster.is_auto
    with pytest.raises(ValueError, match="auto"):
        cfg.cluster.topology()


@pytest.mark.parametrize("body, field, reason", [
    ("pipelines: [{name: a, tp: 0}]", "pipelines[0].tp", "greater than or equal to 1"),
    ("pipelines: [{name: a, weight: -2}]", "pipelines[0].weight", "greater than 0"),
    ("pipelines: [{name: a, max_shard: 2}]", "pipelines[0].max_shard", "unknown field"),
    ("pipelines: [{name: a, min_shards: 3, max_shards: 2}]", "pipelines[0]", "must not exceed"),
    ("pipelines: [{name: a}, {name: a}]", "<top>", "unique"),
    ("cluster: {nodes: 1, gpus_per_node: 2}\npipelines: [{name: a, train_gpus: 4}]", "<top>", "exceeds"),
    ("cluster: {nodes: 0}\npipelines: [{name: a}]", "cluster", "nodes must be >= 1"),
    ("pipelines: []", "pipelines", "at least 1"),
    ("scheduler: {dwell_s: fast}\npipelines: [{name: a}]", "scheduler.dwell_s", "valid number"),
    ("scheduler: {report_stale_s: 0}\npipelines: [{name: a}]", "scheduler.report_stale_s", "greater than 0"),
    ("scheduler: {rotate_s: -1}\npipelines: [{name: a}]", "scheduler.rotate_s", "greater than or equal to 0"),
    # rollout.length_tail: a heavy-tailed limit per sample
    ("pipelines: [{name: a, rollout: {length_tail: {dist: weibull, median: 8, sigma: 1}}}]",
     "pipelines[0].rollout.length_tail.dist", "'lognormal' or 'pareto'"),
    ("pipelines: [{name: a, rollout: {length_tail: {dist: lognormal, median: 8}}}]",
     "pipelines[0].rollout.length_tail", "dist lognormal needs sigma"),
    ("pipelines: [{name: a, rollout: {length_tail: {dist: pareto, median: 8, alpha: 1.5, sigma: 1}}}]",
     "pipelines[0].rollout.length_tail", "sigma is not a parameter of dist pareto"),
    ("pipelines: [{name: a, rollout: {length_tail: {dist: pareto, median: 8, alpha: 0}}}]",
     "pipelines[0].rollout.length_tail.alpha", "greater than 0"),
    ("pipelines: [{name: a, rollout: {length_tail: {dist: lognormal, median: 8, sigma: 1, min: 9}}}]",
     "pipelines[0].rollout.length_tail", "min (9) must not exceed median (8)"),
    ("pipelines: [{name: a, rollout: {max_new_tokens: 16, length_tail: {dist: lognormal, median: 64, sigma: 1}}}]",
     "pipelines[0].rollout", "length_tail.median (64) must not exceed max_new_tokens (16)"),
])
def test_bad_field_is_named(tmp_path, body, field, reason):
    path = write(tmp_path, body + "\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert msg.startswith(str(path)) and f"{field}" in msg and reason in msg and "\n" not in msg


def test_length_tail_loads_and_defaults_to_none(tmp_path):
    cfg = load_config(write(tmp_path, "pipelines:\n  - {name: a, rollout: {max_new_tokens: 1024, length_tail: "
                                      "{dist: lognormal, median: 64, sigma: 1.0, min: 8}}}\n  - {name: b}\n"))
    tail = cfg.pipelines[0].rollout.length_tail
    assert tail is not None and (tail.dist, tail.median, tail.sigma, tail.alpha, tail.min) == ("lognormal", 64, 1.0, None, 8)
    assert cfg.pipelines[1].rollout.length_tail is None  # today's behaviour


def test_scheduler_knobs_reach_the_planner(tmp_path):
    cfg = load_config(write(tmp_path, "scheduler: {rotate_s: 45, report_stale_s: 90}\npipelines: [{name: a}]\n"))
    params = cfg.scheduler.params()
    assert (params.rotate_s, params.report_stale_s, params.dwell_s) == (45.0, 90.0, 30.0)
    assert load_config(write(tmp_path, "pipelines: [{name: a}]\n")).scheduler.params().report_stale_s is None


def test_not_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "pipelines: [unclosed\n"))
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_cli_prints_one_line_and_no_traceback(tmp_path):
    path = write(tmp_path, "pipelines: [{name: a, tp: 0}]\n")
    out = subprocess.run([sys.executable, "-m", "rlix.cli", "check", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pipelines[0].tp" in lines[0] and str(path) in lines[0]


def test_cli_check_accepts_the_example():
    out = subprocess.run([sys.executable, "-m", "rlix.cli", "check", str(ROOT / "examples" / "cluster.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "2 pipeline(s)" in out.stdout


def test_relative_task_files_verifiers_and_models_are_read_from_the_configs_folder(tmp_path, monkeypatch, tiny_model_dir):
    """A config means the same from any working directory (and in every Ray worker): its
    relative task file, verifier module and model directory are anchored to its folder."""
    import shutil

    from rlix.config import load_config
    from rlix.config.preflight import preflight
    from rlix.envs import make_task

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "tasks.jsonl").write_text('{"prompt": "2+2=", "answer": 4}\n')
    (proj / "grader.py").write_text("def score(prompt, answer, response):\n    return 0.25\n")
    shutil.copytree(tiny_model_dir, proj / "ckpt")
    (proj / "run.yaml").write_text(
        "cluster: {nodes: 1, gpus_per_node: 1}\n"
        f"run_dir: {tmp_path / 'out'}\n"
        "pipelines:\n"
        "  - {name: p, model: ckpt, task: {name: jsonl, path: tasks.jsonl, verifier: 'grader:score'}}\n")
    monkeypatch.chdir(tmp_path)  # not the config's folder
    cfg = load_config("proj/run.yaml")
    p = cfg.pipelines[0]
    assert p.task.path == str(proj / "tasks.jsonl") and p.model == str(proj / "ckpt")
    assert p.task.verifier == f"{proj / 'grader.py'}:score"
    preflight(cfg, "proj/run.yaml")  # a real checkpoint, a good task file and verifier: no error
    task = make_task(p.task)
    prompt = task.items[0]
    assert task.reward(prompt, "anything") == 0.25
    assert not (tmp_path / "out").exists()  # check creates nothing


def test_engine_vllm_needs_a_python_with_vllm(tmp_path):
    """rlix check names vllm_python when the Python it would start vLLM with has no vLLM (the
    test's own Python: rlix's environment never holds vLLM)."""
    text = (f"run_dir: {tmp_path / 'run'}\nvllm_python: {sys.executable}\n"
            "pipelines: [{name: a, engine: vllm, vllm: {enforce_eager: true}}, {name: b}]\n")
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"vllm_python: .* has no vllm package \(needed by pipelines\[0\] \(a\)"):
        preflight(load_config(path), str(path))
    ok = load_config(write(tmp_path, text.replace("engine: vllm", "engine: embedded")))
    preflight(ok, "ok.yaml")
    assert ok.pipelines[0].vllm.enforce_eager and ok.pipelines[1].engine == "embedded"
    with pytest.raises(ConfigError, match="engine"):
        load_config(write(tmp_path, text.replace("engine: vllm", "engine: sglang")))
