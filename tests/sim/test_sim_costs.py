"""The simulator charges the scheduler's move-cost table (issue 35): trainer reloads and
offloads, process starts (at set-up with resident engines, else where a rank first runs), the
deprecated `transitions:` read as the same table; and the planner's cost check repays."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import build, one_gpu_dict, scenario_dict, single_turn  # noqa: E402

from rlix.errors import ScenarioError  # noqa: E402
from rlix.scheduler.costs import MoveCosts, save_move_costs  # noqa: E402
from rlix.sim import load_scenario, run_scenario, simulate  # noqa: E402
from rlix.sim.engine import Domain  # noqa: E402
from rlix.sim.trace import SimTrace  # noqa: E402
from rlix.sim.workload import Workload, generate  # noqa: E402

T2 = 0.0206  # one decode step with two running sequences (20 ms + 2 x 0.3 ms)
#: the old `transitions: {sync_s: 5, sleep_s: 2, wake_s: 5}` as a table
LEGACY = {"sleep_s": 2, "wake_sync_s": 10, "sync_s": 5, "recapture_s": 0, "trainer_reload_s": 0,
          "trainer_offload_s": 0, "cold_start_s": 0}


def one_gpu(**costs) -> dict:
    d = one_gpu_dict(steps=2, staleness=1, train_gpu_s=4.0)
    del d["transitions"]
    d["costs"] = {**LEGACY, **costs}
    return d


def first_step_end(d: dict) -> float:
    sc = build(d)
    work = {"p": Workload("p", (single_turn(100), single_turn(1000)))}
    return simulate(sc, work, "rlix").pipelines["p"].step_ends[0]


A_DONE = 5 + 5 + 100 * T2  # wake + sync, then A decodes beside B


def test_the_deprecated_transitions_are_the_same_table():
    old = one_gpu_dict(steps=2, staleness=1, train_gpu_s=4.0)
    new = one_gpu()
    assert build(old).pipelines[0].costs == build(new).pipelines[0].costs
    assert build(old).params == build(new).params
    two = scenario_dict(transitions={"sync_s": 5, "sleep_s": 2, "wake_s": 5})
    assert json.dumps(run_scenario(build(two))) == json.dumps(run_scenario(build(scenario_dict(costs=LEGACY))))


def test_trainer_reload_and_offload_hold_the_gpu_around_each_step_by_hand():
    # the train step shrinks the only shard (sleep 2 s), reloads 1 s, trains 4 s, offloads 0.5 s
    assert first_step_end(one_gpu()) == pytest.approx(A_DONE + 2 + 4, rel=1e-9)
    assert first_step_end(one_gpu(trainer_reload_s=1.0, trainer_offload_s=0.5)) == \
        pytest.approx(A_DONE + 2 + 1 + 4 + 0.5, rel=1e-9)


@pytest.mark.parametrize("resident", [True, False])
def test_a_process_start_delays_the_first_shard_by_cold_start_s(resident):
    # resident: every process starts at set-up (in parallel) before the first shard serves;
    # not resident: the rank's first wake on its GPU starts it. One GPU: one start either way.
    d = one_gpu(cold_start_s=15.0)
    d["resident_engines"] = resident
    assert first_step_end(d) == pytest.approx(15 + A_DONE + 2 + 4, rel=1e-9)


def run(resident: bool = True, **costs):
    d = scenario_dict(costs=costs, resident_engines=resident)
    sc = build(d)
    trace = SimTrace()
    res = simulate(sc, generate(sc), "rlix", trace=trace)
    starts = sum(1 for events in trace.events.values() for e in events if e[1] == "start")
    return res, starts


def test_the_cost_table_moves_the_simulated_makespan_the_expected_way():
    free, _ = run(cold_start_s=0.0, recapture_s=0.0, trainer_reload_s=0.0, trainer_offload_s=0.0)
    table, starts = run()  # the defaults: measured on an H100, engines resident
    assert starts == 0 and table.makespan > free.makespan
    assert table.transition_gpu_s > free.transition_gpu_s
    # engines not resident: every first run of a rank on a GPU starts a process
    cold, starts = run(resident=False)
    assert starts >= 4 and cold.transition_gpu_s > table.transition_gpu_s
    # ... and a planner that ignores what moves cost (margin 0) pays for more starts: slower
    blind, blind_starts = run(resident=False, margin=0.0)
    assert blind_starts > starts and blind.makespan > table.makespan
    assert cold.makespan < blind.makespan  # the cost check repays


def test_the_planner_plans_on_the_scenarios_table_without_starts_when_engines_are_resident():
    sc = build(scenario_dict(costs={"cold_start_s": 11.0, "margin": 3.0}))
    assert sc.costs.cold_start_s == 11.0 and sc.params.move_costs.cold_start_s == 0.0
    assert sc.params.move_costs.margin == 3.0
    sc = build(scenario_dict(costs={"cold_start_s": 11.0}, resident_engines=False))
    assert sc.params.move_costs.cold_start_s == 11.0
    assert build(scenario_dict()).params.move_costs == MoveCosts().model_copy(update={"cold_start_s": 0.0})


def test_simulated_pipelines_report_their_rate(monkeypatch):
    seen: list = []
    original = Domain.report

    def spy(self, progress):
        seen.append(progress.seconds_per_trajectory)
        original(self, progress)

    monkeypatch.setattr(Domain, "report", spy)
    sc = build(scenario_dict())
    simulate(sc, generate(sc), "rlix")
    rates = [r for r in seen if r is not None]
    assert seen[0] is None and rates and all(r > 0 for r in rates)


def test_a_cost_table_file_is_read_relative_to_the_scenario_and_bad_ones_name_the_field(tmp_path):
    save_move_costs(tmp_path / "h100.json", MoveCosts(sleep_s=0.05, cold_start_s=12.0), "test")
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(scenario_dict(costs="h100.json")))
    sc = load_scenario(path)
    assert sc.costs == MoveCosts(sleep_s=0.05, cold_start_s=12.0)
    assert sc.pipelines[0].costs == sc.costs
    cases = [
        (scenario_dict(costs={"slep_s": 1}), r"s\.yaml: costs: slep_s: unknown field"),
        (scenario_dict(costs={"sync_s": 1.0}), r"s\.yaml: costs: sync_s \(1.0\) is part of wake_sync_s"),
        (scenario_dict(costs=LEGACY, transitions={"sync_s": 5}), r"s\.yaml: transitions: deprecated"),
        (scenario_dict(costs="missing.json"), r"s\.yaml: costs: .*missing\.json: no such cost table"),
        (scenario_dict(costs=3), r"s\.yaml: costs: expected a mapping of costs or the path"),
        (scenario_dict(resident_engines="maybe"), r"s\.yaml: resident_engines"),
    ]
    (tmp_path / "bad.json").write_text(json.dumps({"costs": {"wake_s": 1}}))
    cases.append((scenario_dict(costs="bad.json"), r"s\.yaml: costs: .*bad\.json: costs\.wake_s: unknown field"))
    for d, match in cases:
        path.write_text(json.dumps(d))
        with pytest.raises(ScenarioError, match=match):
            load_scenario(path)
