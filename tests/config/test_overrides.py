"""`--set path.to.field=value` on rlix check / run / submit, applied before validation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from rlix.config.loader import resolve_config
from rlix.config.overrides import parse_path
from rlix.errors import ConfigError

CONFIG = {"cluster": {"nodes": 1, "gpus_per_node": 2},
          "pipelines": [{"name": "pa", "steps": 3}, {"name": "pb", "rollout": {"temperature": 0.9}}]}


@pytest.fixture()
def config(tmp_path) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "run_dir": str(tmp_path / "run")}))
    return str(path)


def rlix(*args: str):
    return subprocess.run([sys.executable, "-m", "rlix.cli", *args], capture_output=True, text=True, timeout=120)


def test_check_reports_the_fields_set(config):
    done = rlix("check", config, "--set", "pipelines.pa.steps=7", "--set", "pipelines[1].rollout.temperature=0.5",
                "--set", "pipelines.pb.task={name: arithmetic, max_operand: 9}", "--set", "scheduler.dwell_s=2")
    assert done.returncode == 0, done.stderr
    assert "  --set pipelines.pa.steps: 7\n" in done.stdout
    assert "  --set pipelines[1].rollout.temperature: 0.5\n" in done.stdout
    assert '"max_operand": 9' in done.stdout and "  --set scheduler.dwell_s: 2.0\n" in done.stdout


@pytest.mark.parametrize("item, says", [
    ("pipelines.pa.rollout.temprature=1", "--set pipelines.pa.rollout.temprature=1: pipelines[0].rollout has no "
                                          "field 'temprature' (it has: "),
    ("pipelines.pc.steps=1", "pipelines has no item named 'pc' (names: pa, pb)"),
    ("pipelines[2].steps=1", "pipelines has 2 item(s); no [2]"),
    ("stepz=1", "the config has no field 'stepz'"),
    ("pipelines..steps=1", "not a field path"),
    ("pipelines.pa.steps", "expected path.to.field=value"),
    ("pipelines.pa.steps=[1", "the value is not YAML"),
    ("pipelines.pa.steps=-1", "cfg.yaml: pipelines[0].steps: Input should be greater than or equal to 1"),
    ("pipelines.pa.steps=yes", "cfg.yaml: pipelines[0].steps: expected a number, got a boolean"),
])
def test_a_bad_set_is_one_line_naming_it_with_exit_code_2(config, item, says):
    for command in ("check", "run"):  # run refuses it before Ray starts
        done = rlix(command, config, "--set", item)
        assert done.returncode == 2 and done.stdout == "", (command, done.stdout)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("rlix: error: ") and says in lines[0], (command, lines)


def test_paths_and_the_python_apis_config_forms(tmp_path):
    assert parse_path("pipelines[0].rollout.temperature") == ["pipelines", "0", "rollout", "temperature"]
    assert parse_path("pipelines.pa.train.lr") == ["pipelines", "pa", "train", "lr"]
    for bad in ("", ".a", "a.", "a[0", "a]b", "a..b"):
        with pytest.raises(ValueError):
            parse_path(bad)
    data = {**CONFIG, "run_dir": str(tmp_path / "run")}
    cfg, source = resolve_config(data, ["pipelines.pb.steps=4"])
    assert source == "<config>" and cfg.pipelines[1].steps == 4 and data["pipelines"][1].get("steps") is None
    again, _ = resolve_config(cfg, ["pipelines[0].seed=5"])
    assert again.pipelines[0].seed == 5 and again.pipelines[1].steps == 4 and again.run_dir == cfg.run_dir
    assert resolve_config(cfg)[0] is cfg
    with pytest.raises(ConfigError, match=r"^<config>: pipelines\[0\]\.name: "):
        resolve_config({"pipelines": [{"name": ".."}]})


def test_importing_rlix_stays_light_and_rlix_run_is_the_api():
    code = ("import sys, rlix; heavy = [m for m in ('torch', 'ray', 'transformers', 'rlix.config') if m in sys.modules]; "
            "assert not heavy, heavy; assert callable(rlix.run) and callable(rlix.run.run); "
            "assert rlix.RlixConfig.__name__ == 'RlixConfig'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-1000:]
