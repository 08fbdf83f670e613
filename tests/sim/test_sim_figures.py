"""Per-pipeline figures of a simulated run: GPU-seconds held by role, shares, slowdown,
the longest wait with work and no shard, Jain's index; and a policy that does not apply."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import build, one_gpu_dict, pipe, scenario_dict, single_turn  # noqa: E402

from rlix.sim import POLICIES, cli_sim, run_policies, run_scenario, simulate  # noqa: E402
from rlix.sim.results import jain  # noqa: E402
from rlix.sim.workload import Workload, generate  # noqa: E402


def test_jain_index_is_one_when_equal_and_one_over_n_when_one_gets_all():
    assert jain([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0]) == pytest.approx(0.5)
    assert jain([3.0, 0.0, 0.0]) == pytest.approx(1 / 3)


def test_held_gpu_seconds_add_up_and_shares_sum_to_one():
    sc = build(scenario_dict())
    runs, skipped, alone, _ = run_policies(sc, generate(sc))
    assert not skipped and set(runs) == set(POLICIES)
    for policy, res in runs.items():
        held = sum(p.held_gpu_s for p in res.pipelines.values())
        assert 0 < held <= res.gpus * res.makespan + 1e-6, policy
        for p in res.pipelines.values():
            # training holds its GPUs at least for the step itself (plus waits for a sleep)
            assert p.gpu_seconds["train"] >= p.train_gpu_s - 1e-6, policy
            assert p.gpu_seconds["rollout"] >= p.shard_busy_gpu_s - 1e-6, policy
            assert p.slowdown == pytest.approx(p.completion_s / alone[p.name])
        assert sum(p.gpu_share for p in res.pipelines.values()) == pytest.approx(1.0)
        assert sum(p.demand_share for p in res.pipelines.values()) == pytest.approx(1.0)
        assert 1 / len(res.pipelines) <= res.jain_fairness <= 1.0 + 1e-12


def test_queue_slowdown_is_one_for_the_first_job_and_counts_the_queueing_of_the_second():
    sc = build(scenario_dict())  # both ask for the whole cluster: b waits for a
    runs, _, _, _ = run_policies(sc, generate(sc), ("exclusive-queue",))
    a, b = runs["exclusive-queue"].pipelines["a"], runs["exclusive-queue"].pipelines["b"]
    assert a.slowdown == pytest.approx(1.0)
    assert b.slowdown == pytest.approx(b.finished_at / b.duration) and b.slowdown > 1.5


def test_longest_shardless_wait_is_the_train_step_that_took_the_only_shard():
    # One GPU: A (100 tokens) completes batch 0 while B (1000 tokens, batch 1) still decodes;
    # the train step shrinks the only shard (sleep 2 s) and trains 4 s; then B's shard wakes.
    sc = build(one_gpu_dict(steps=2, staleness=1, train_gpu_s=4.0))
    work = {"p": Workload("p", (single_turn(100), single_turn(1000)))}
    p = simulate(sc, work, "rlix").pipelines["p"]
    assert p.longest_shardless_wait_s == pytest.approx(2 + 4, rel=1e-9)
    assert p.shardless_s == pytest.approx(6, rel=1e-9)  # the second step had no work left


def test_report_json_and_console_carry_the_per_pipeline_figures():
    sc = build(scenario_dict())
    report = run_scenario(sc)
    for m in report["policies"].values():
        assert m["applicable"] is True and 0 < m["jain_fairness"] <= 1
        for f in m["pipelines"].values():
            assert set(f) >= {"gpu_seconds", "demand_share", "gpu_share", "slowdown",
                              "longest_shardless_wait_s"}
            assert f["slowdown"] >= 0.999 and f["gpu_seconds"]["rollout"] > 0


def crowded(tmp_path: Path) -> Path:
    path = tmp_path / "crowded.yaml"
    path.write_text(json.dumps(scenario_dict(
        nodes=1, gpus_per_node=2,
        pipelines=[pipe("p", copies=3, steps=2, train_gpus=1, max_shards=2)])))
    return path


def test_partition_with_more_pipelines_than_gpus_is_reported_not_applicable(tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_sim(str(crowded(tmp_path)), True) == 0
    report = json.loads(out.getvalue())
    part = report["policies"]["exclusive-partition"]
    assert part == {"applicable": False, "reason": "3 pipelines cannot each get one of the 2 GPUs"}
    for name in ("exclusive-queue", "rlix"):
        assert report["policies"][name]["applicable"] and report["policies"][name]["makespan_s"] > 0
    assert "throughput_ratio_vs_partition" not in report and "throughput_ratio_vs_exclusive" in report


def test_console_says_which_policy_does_not_apply(tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_sim(str(crowded(tmp_path)), False) == 0
    text = out.getvalue()
    assert "exclusive-partition: not applicable: 3 pipelines cannot each get one of the 2 GPUs" in text
    assert "rlix: per pipeline" in text and "exclusive-queue: per pipeline" in text


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sim"


@pytest.mark.parametrize("name", ["bursty.yaml", "crowded.yaml", "out-of-phase.yaml"])
def test_new_examples_load_with_their_features(name):
    from rlix.sim import load_scenario

    sc = load_scenario(EXAMPLES / name)
    if name == "bursty.yaml":
        assert {p.arrive_s for p in sc.pipelines} == {0.0, 3600.0} and all(p.stages for p in sc.pipelines)
    if name == "crowded.yaml":
        assert len(sc.pipelines) > sc.gpus and any(p.faults for p in sc.pipelines)
    if name == "out-of-phase.yaml":
        assert sc.topology.gpus_per_node == (8, 4)


def test_crowded_example_runs_queue_and_rlix_and_says_partition_does_not_apply():
    from rlix.sim import load_scenario

    report = run_scenario(load_scenario(EXAMPLES / "crowded.yaml"))
    assert report["policies"]["exclusive-partition"]["applicable"] is False
    rl = report["policies"]["rlix"]
    assert rl["pipelines"]["small-2"]["crashes"] == 1
    assert all(f["train_steps"] == 10 for f in rl["pipelines"].values())


#: measured makespans (s) of bench/timeshare_gpu.py runs on H200s, docs/BENCHMARKS.md (rows H, K)
MEASURED = {"gpu-mix4-g32.yaml": {"rlix": 136.79, "exclusive-partition": 184.82},
            "gpu-mix2.yaml": {"rlix": 87.13, "exclusive-partition": 101.78}}


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_the_simulator_predicts_the_measured_gpu_makespans_within_15_percent(name):
    """Issue 35, acceptance 6: the files are fitted to the partition runs' engine and train
    figures (and each run's set-up); the time-shared makespan is a prediction."""
    from rlix.sim import load_scenario

    report = run_scenario(load_scenario(EXAMPLES / name))
    for policy, measured in MEASURED[name].items():
        got = report["policies"][policy]["makespan_s"]
        assert abs(got - measured) / measured <= 0.15, (policy, got, measured)
