"""`rlix sim --out DIR`: each policy's run recorded as `rlix run` records one (role log with
reasons, shard events, step records) and drawn by the same timeline; recording changes no
result, and every GPU-second of each simulated run is accounted for once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from chrome_trace_format import validate  # noqa: E402

from rlix.cli import main  # noqa: E402
from rlix.sim import POLICIES, run_scenario  # noqa: E402
from rlix.sim.scenario import ScenarioModel, build_scenario  # noqa: E402
from rlix.timeline import CHART_FILE, HELD, TRACE_FILE, build_timeline, gpu_account  # noqa: E402


def scenario():
    pipe = {"name": "p", "steps": 3, "train_gpus": 2, "train_gpu_seconds": 20.0, "max_shards": 4,
            "max_staleness": 1, "seqs_per_shard": 2,
            "rollout": {"prompts": 2, "samples": 2, "extra_turns_mean": 2, "max_turns": 6,
                        "gen_tokens": {"median": 200, "sigma": 1.0, "max": 2000},
                        "tool_s": {"median": 2.0, "sigma": 1.0}, "prompt_tokens": 300, "obs_tokens": 100}}
    d = {"name": "tiny", "seed": 3, "cluster": {"nodes": 2, "gpus_per_node": 2},
         "pipelines": [dict(pipe, name="a"), dict(pipe, name="b")]}
    return build_scenario(ScenarioModel.model_validate(d), "test.yaml")


def test_sim_out_writes_each_policys_timeline_and_changes_no_result(tmp_path):
    sc = scenario()
    plain = run_scenario(sc)
    recorded = run_scenario(sc, out=tmp_path)
    assert json.dumps(recorded) == json.dumps(plain)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(POLICIES)
    for policy in POLICIES:
        run_dir = tmp_path / policy
        validate(json.loads((run_dir / TRACE_FILE).read_text()))
        assert (run_dir / CHART_FILE).read_bytes()[:4] == b"\x89PNG"
        summary = json.loads((run_dir / "summary.json").read_text())
        makespan = recorded["policies"][policy]["makespan_s"]
        assert summary["run"]["ended_at"] == pytest.approx(makespan, abs=1e-3)
        assert summary["run"]["gpu_nodes"] == [0, 0, 1, 1]
        roles: dict[int, str] = {}
        for c in summary["role_changes"]:  # one holder at a time, each change from the last
            assert c["before"] == roles.get(c["gpu"], "idle"), (policy, c)
            roles[c["gpu"]] = c["after"]
        assert set(roles.values()) == {"idle"}  # every pipeline left at its end
        account = gpu_account(build_timeline(summary))
        total = account["idle_s"] + sum(r["held"] for r in account["pipelines"].values())
        assert total == pytest.approx(4 * summary["run"]["ended_at"], rel=1e-9)  # from 0
        for name in ("a", "b"):
            row = account["pipelines"][name]
            # every step trains 20 GPU-seconds, on GPUs the pipeline holds
            assert row["train"] == pytest.approx(3 * 20.0, rel=1e-9), (policy, name, row)
            assert row["generate"] > 0 and all(row[c] >= 0 for c in HELD)
        assert summary["gpu_account"]["pipelines"]["a"]["train"] == pytest.approx(60.0, abs=1e-3)
    rlix = json.loads((tmp_path / "rlix" / "summary.json").read_text())
    assert {"expand", "grant", "release", "unregister"} <= {c["reason"] for c in rlix["role_changes"]}
    kinds = {e[1] for p in rlix["pipelines"].values() for e in p["events"]}
    assert {"wake", "sync", "activate", "refit"} <= kinds


def test_rlix_timeline_redraws_a_simulated_run(tmp_path, capsys):
    run_scenario(scenario(), policies=("rlix",), out=tmp_path)
    (tmp_path / "rlix" / TRACE_FILE).unlink()
    assert main(["timeline", str(tmp_path / "rlix")]) == 0
    assert "GPU time (s) over 4 GPU(s)" in capsys.readouterr().out
    validate(json.loads((tmp_path / "rlix" / TRACE_FILE).read_text()))
