"""Scenario features: arrivals, extra stages, min_train_gpus, uneven nodes, and their errors.
Times are checked against hand-computed ones where the model makes them exact."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import build, one_gpu_dict, pipe, scenario_dict, single_turn  # noqa: E402

from rlix.errors import ScenarioError  # noqa: E402
from rlix.sim import load_scenario, run_policies, run_scenario, simulate  # noqa: E402
from rlix.sim.workload import Workload, generate  # noqa: E402

T2 = 0.0206  # one decode step with two running sequences (20 ms + 2 x 0.3 ms)


# ---------------------------------------------------------------------- arrivals
def test_a_pipeline_arriving_after_the_other_left_runs_as_if_alone():
    first = build(scenario_dict(pipelines=[pipe("a")]))
    t_a = simulate(first, generate(first), "rlix").makespan
    sc = build(scenario_dict(pipelines=[pipe("a"), pipe("b", arrive_s=t_a + 50)]))
    runs, _, alone, _ = run_policies(sc, generate(sc), ("exclusive-queue", "rlix"))
    for policy, res in runs.items():
        b = res.pipelines["b"]
        assert b.started_at == pytest.approx(t_a + 50), policy
        assert b.arrived_at == t_a + 50
        assert b.slowdown == pytest.approx(1.0, rel=1e-9), policy
    # two arrivals: nothing can end before b's arrival plus its time alone
    report = run_scenario(sc, ("rlix",))
    assert report["ideal"]["alone_bound_s"] == pytest.approx(t_a + 50 + alone["b"], abs=1e-3)


def test_queue_admits_in_order_of_arrival_not_of_listing():
    sc = build(scenario_dict(pipelines=[pipe("late", arrive_s=30.0), pipe("early", arrive_s=10.0)]))
    res = simulate(sc, generate(sc), "exclusive-queue")  # each asks for the whole cluster
    early, late = res.pipelines["early"], res.pipelines["late"]
    assert early.started_at == pytest.approx(10.0)
    assert late.started_at == pytest.approx(early.finished_at)


# ---------------------------------------------------------------------- extra stages
def test_a_logprob_stage_runs_before_each_train_step_on_the_shards_gpu():
    d = one_gpu_dict(steps=2, staleness=1, train_gpu_s=4.0)
    d["pipelines"][0]["stages"] = [{"name": "reference", "gpus": 1, "gpu_seconds": 3.0}]
    sc = build(d)
    work = {"p": Workload("p", (single_turn(100), single_turn(1000)))}
    p = simulate(sc, work, "rlix").pipelines["p"]
    a_done = 5 + 5 + 100 * T2  # wake + sync, then A decodes beside B
    # the stage shrinks the only shard (sleep 2 s), runs 3 s, then training takes the GPU 4 s
    assert p.step_ends[0] == pytest.approx(a_done + 2 + 3 + 4, rel=1e-9)
    assert p.longest_shardless_wait_s == pytest.approx(2 + 3 + 4, rel=1e-9)
    # held from the grant: each step's stage waits 2 s for the shard's sleep, then runs 3 s;
    # training then starts on a free GPU and holds it 4 s
    assert p.gpu_seconds["reference"] == pytest.approx(2 * (2 + 3), rel=1e-9)
    assert p.gpu_seconds["train"] == pytest.approx(2 * 4, rel=1e-9)
    # the rollout shard holds the GPU the rest of the time: nothing is idle on one GPU
    assert sum(p.gpu_seconds.values()) == pytest.approx(p.finished_at, rel=1e-9)


def test_stage_wider_than_the_training_home_is_an_error_naming_the_field(tmp_path):
    d = scenario_dict(pipelines=[pipe("a", partial_overlap=False, train_gpus=2,
                                      stages=[{"name": "ref", "gpus": 3, "gpu_seconds": 5}])])
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(d))
    with pytest.raises(ScenarioError, match=r"s\.yaml: pipelines\[0\]\.stages\[0\]\.gpus: 3 exceeds"):
        load_scenario(path)


# ---------------------------------------------------------------------- min_train_gpus
def test_partition_that_leaves_too_few_training_gpus_does_not_apply():
    sc = build(scenario_dict(pipelines=[pipe("a", train_gpus=4, min_train_gpus=3, steps=2),
                                        pipe("b", train_gpus=4, min_train_gpus=3, steps=2)]))
    runs, skipped, _, _ = run_policies(sc, generate(sc))
    assert set(runs) == {"exclusive-queue", "rlix"}
    assert "min_train_gpus" in skipped["exclusive-partition"].reason
    assert "a slice of 2 leaves it 2" in skipped["exclusive-partition"].reason
    # with 2 it fits a slice of 2
    ok = build(scenario_dict(pipelines=[pipe("a", train_gpus=4, min_train_gpus=2, steps=2),
                                        pipe("b", train_gpus=4, min_train_gpus=2, steps=2)]))
    assert not run_policies(ok, generate(ok), ("exclusive-partition",))[1]


def test_min_train_gpus_above_train_gpus_is_an_error(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(scenario_dict(pipelines=[pipe("a", min_train_gpus=3)])))
    with pytest.raises(ScenarioError, match=r"pipelines\[0\].*min_train_gpus \(3\) must not exceed"):
        load_scenario(path)


# ---------------------------------------------------------------------- uneven nodes
def test_uneven_nodes_build_the_topology_and_bound_tp_by_the_largest_node(tmp_path):
    sc = build(scenario_dict(pipelines=[pipe("a", tp=3, max_shards=1, train_gpus=1)],
                             cluster={"nodes": [3, 1]}))
    assert sc.topology.gpus_per_node == (3, 1) and sc.gpus == 4
    res = simulate(sc, generate(sc), "rlix")
    assert res.pipelines["a"].gpu_seconds["rollout"] > 0  # a tp=3 shard fits node 0 only
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(scenario_dict(pipelines=[pipe("a", tp=4)], cluster={"nodes": [3, 1]})))
    with pytest.raises(ScenarioError, match=r"pipelines\[0\]\.tp: 4 does not fit on one node \(the largest has 3"):
        load_scenario(path)
    path.write_text(json.dumps(scenario_dict(cluster={"nodes": [3, 1], "gpus_per_node": 2})))
    with pytest.raises(ScenarioError, match=r"cluster.*gpus_per_node: not allowed"):
        load_scenario(path)


def test_partition_on_uneven_nodes_keeps_each_slice_on_its_nodes():
    sc = build(scenario_dict(pipelines=[pipe("a", train_gpus=2), pipe("b", train_gpus=2)],
                             cluster={"nodes": [2, 2, 2]}))
    res = simulate(sc, generate(sc), "exclusive-partition")
    assert all(len(p.step_ends) == 3 for p in res.pipelines.values())
