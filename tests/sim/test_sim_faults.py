"""Injected faults: a crash loses the batches in flight and restarts from the last step; muted
reports take the pipeline's shards away while it still has work; stale reports stop reaching
the scheduler, which keeps the last one (with its time)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import build, one_gpu_dict, pipe, scenario_dict, single_turn  # noqa: E402

from rlix.errors import ScenarioError  # noqa: E402
from rlix.sim import load_scenario, simulate  # noqa: E402
from rlix.sim.engine import Domain  # noqa: E402
from rlix.sim.workload import Workload, generate  # noqa: E402

T2 = 0.0206


def one_gpu_run(faults: list[dict]):
    d = one_gpu_dict(steps=2, staleness=1, train_gpu_s=4.0)
    d["faults"] = faults
    work = {"p": Workload("p", (single_turn(100), single_turn(1000)))}
    return simulate(build(d), work, "rlix").pipelines["p"]


def test_crash_before_any_result_shifts_the_whole_run_by_the_downtime():
    base = one_gpu_run([])
    p = one_gpu_run([{"kind": "crash", "pipeline": "p", "at_s": 5.0, "restart_after_s": 20.0}])
    assert p.crashes == 1
    # the waking shard dies with it; the GPU is free at once; everything restarts at 25 s
    assert p.finished_at == pytest.approx(base.finished_at + 25.0, rel=1e-9)
    assert p.trajectories == 2 and all(t is not None for t in p.traj_finish_times)


def test_crash_loses_a_finished_batch_and_waits_for_the_sleep_on_its_gpu():
    base = one_gpu_run([])
    a_done = 10 + 100 * T2
    # at 13 s batch 0 is done and its train step waits for the shard's sleep (until a_done + 2)
    p = one_gpu_run([{"kind": "crash", "pipeline": "p", "at_s": 13.0, "restart_after_s": 0.0}])
    assert p.crashes == 1 and len(p.step_ends) == 2
    assert p.trajectories == 2  # A was lost and generated again: counted once
    # it restarts at once, but its new shard wakes only when the old one's sleep is over
    assert p.finished_at == pytest.approx(base.finished_at + a_done + 2, rel=1e-9)
    # lost: A (100 tokens) and the 100 B had made when the shrink stopped it
    assert p.tokens == pytest.approx(base.tokens + 100 + 100, rel=1e-9)


def reports(monkeypatch, evidence: bool = True) -> list:
    """Spy on the reports; evidence=False strips `pending_work` (a pipeline that sends none)."""
    seen = []
    original = Domain.report

    def spy(self, progress):
        if not evidence:
            progress = dataclasses.replace(progress, pending_work=False)
        seen.append((self.clock.now, progress))
        original(self, progress)

    monkeypatch.setattr(Domain, "report", spy)
    return seen


def two_pipelines(faults: list[dict]):
    sc = build(scenario_dict(nodes=1, gpus_per_node=2, faults=faults,
                             pipelines=[pipe("a", train_gpus=1, max_shards=2, steps=3),
                                        pipe("b", train_gpus=1, max_shards=2, steps=3)]))
    return simulate(sc, generate(sc), "rlix")


def test_muted_reports_without_evidence_cost_the_pipeline_its_shards(monkeypatch):
    seen = reports(monkeypatch, evidence=False)
    muted = two_pipelines([{"kind": "mute_reports", "pipeline": "b", "from_s": 0, "to_s": 60}])
    in_window = [p for t, p in seen if p.pipeline == "b" and t < 60]
    assert in_window and all(p.remaining == 0 for p in in_window)
    assert any(p.remaining > 0 for t, p in seen if p.pipeline == "b" and t >= 60)
    base = two_pipelines([])
    b, b0 = muted.pipelines["b"], base.pipelines["b"]
    # with demand 0 and no pending-work evidence it gets no shard while its first batch
    # waits: a takes both GPUs
    assert b.longest_shardless_wait_s >= 55 > b0.longest_shardless_wait_s
    assert b.completion_s > b0.completion_s


def test_muted_reports_with_pending_work_keep_a_shard(monkeypatch):
    seen = reports(monkeypatch)
    muted = two_pipelines([{"kind": "mute_reports", "pipeline": "b", "from_s": 0, "to_s": 60}])
    in_window = [p for t, p in seen if p.pipeline == "b" and t < 60]
    assert in_window and all(p.remaining == 0 for p in in_window)
    assert any(p.pending_work for p in in_window)
    b = muted.pipelines["b"]
    # the router's evidence (turns outstanding) keeps it one shard: it never waits the window out
    assert b.longest_shardless_wait_s < 55
    assert len(b.step_ends) == 3


def test_stale_reports_stop_reaching_the_scheduler_until_the_window_ends(monkeypatch):
    seen = reports(monkeypatch)
    res = two_pipelines([{"kind": "stale_reports", "pipeline": "b", "from_s": 1, "to_s": 40}])
    times = [t for t, p in seen if p.pipeline == "b"]
    assert times[0] < 1 and not [t for t in times if 1 <= t < 40]
    assert 40.0 in times  # the window's end delivers the truth at once
    assert all(p.reported_at == t for t, p in seen)  # stamped when sent, as the core stamps them
    assert len(res.pipelines["b"].step_ends) == 3


@pytest.mark.parametrize("fault, message", [
    ({"kind": "crash", "pipeline": "zz", "at_s": 1, "restart_after_s": 1}, r"faults\[0\]\.pipeline: no pipeline 'zz'"),
    ({"kind": "mute_reports", "pipeline": "a", "from_s": 5, "to_s": 5}, r"faults\[0\]\.mute_reports.*to_s \(5.0\) must be after"),
    ({"kind": "melt", "pipeline": "a", "at_s": 1}, r"faults\[0\]"),
    ({"kind": "crash", "pipeline": "a", "at_s": 1}, r"faults\[0\]\.crash\.restart_after_s"),
])
def test_bad_fault_is_a_scenario_error_naming_the_field(tmp_path, fault, message):
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(scenario_dict(faults=[fault])))
    with pytest.raises(ScenarioError, match=message) as info:
        load_scenario(path)
    assert "\n" not in str(info.value)
