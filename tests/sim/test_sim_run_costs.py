"""What a real `rlix run` pays besides its steps: the scenario's `run:` section (teardown,
set-up by mode) and the collector's in-flight cap (`rollout.in_flight`); and that without them
every shipped example gives what it gave before they existed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from helpers import build, one_gpu_dict, pipe, scenario_dict  # noqa: E402

from rlix.errors import ScenarioError  # noqa: E402
from rlix.sim import run_scenario, simulate  # noqa: E402
from rlix.sim.policies import _Sim, run_rlix  # noqa: E402
from rlix.sim.scenario import ScenarioModel, build_scenario  # noqa: E402
from rlix.sim.shard import Shard  # noqa: E402
from rlix.sim.workload import generate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "sim"
BEFORE = json.loads((Path(__file__).parent / "examples_before_run_section.json").read_text())
KEYS = ("makespan_s", "pipeline_makespan_s", "pipeline_started_s", "trajectories",
        "tokens_generated", "gpu_seconds", "plan_calls", "shard_wakes", "preempted_turns",
        "kept_tokens", "step_time_p50_s", "step_time_p95_s")


def _without_new_fields(d: dict) -> dict:
    """The scenario as it was before `run:` and `rollout.in_flight` existed."""
    d = dict(d)
    d.pop("run", None)
    for p in d["pipelines"]:
        p["rollout"].pop("in_flight", None)
    return d


# ---------------------------------------------------------------------- unchanged without them
@pytest.mark.parametrize("name", sorted(BEFORE))
def test_examples_without_the_new_fields_give_the_recorded_results(name):
    """Recorded with the simulator before this change (tests/sim/examples_before_run_section.json);
    gpu-mix4 / gpu-longtail4 now use the new fields, so they are run without them."""
    path = EXAMPLES / f"{name}.yaml"
    model = ScenarioModel.model_validate(_without_new_fields(yaml.safe_load(path.read_text())))
    report = run_scenario(build_scenario(model, str(path)))
    assert report["ideal_makespan_s"] == BEFORE[name]["ideal_makespan_s"]
    for policy, want in BEFORE[name]["policies"].items():
        got = report["policies"][policy]
        if not want.get("applicable", True):
            assert got == want
            continue
        assert {k: got[k] for k in KEYS} == want, policy


def test_the_defaults_are_zero_and_off():
    s = build(scenario_dict())
    assert (s.run.teardown_s, s.run.setup_s, s.run.standalone_setup_s) == (0.0, None, None)
    assert all(p.rollout.in_flight is None for p in s.pipelines)


@pytest.mark.parametrize("bad", [{"teardown": 1}, {"teardown_s": -1}, {"setup_s": -2}])
def test_run_section_is_strict(bad):
    with pytest.raises(Exception):
        build(scenario_dict(run=bad))


def test_in_flight_must_be_positive():
    with pytest.raises(Exception):
        build(scenario_dict(pipelines=[pipe("a", rollout={**pipe()["rollout"], "in_flight": 0})]))


@pytest.mark.parametrize("key", ["setup_s", "standalone_setup_s"])
def test_a_set_up_without_resident_engines_is_an_error_naming_the_field(key):
    with pytest.raises(ScenarioError, match=f"run.{key}"):
        build(scenario_dict(resident_engines=False, run={key: 10}))


# ---------------------------------------------------------------------- teardown
def _runs(d: dict, policy: str):
    s = build(d)
    return simulate(s, generate(s), policy)


@pytest.mark.parametrize("policy", ["rlix", "exclusive-partition"])
def test_teardown_adds_exactly_teardown_s_to_the_makespan(policy):
    base = _runs(scenario_dict(), policy)
    torn = _runs(scenario_dict(run={"teardown_s": 11.5}), policy)
    assert torn.makespan == pytest.approx(base.makespan + 11.5, abs=1e-9)
    for name, p in base.pipelines.items():  # the steps themselves are untouched
        assert torn.pipelines[name].finished_at == p.finished_at
        assert torn.pipelines[name].step_ends == p.step_ends


def test_teardown_delays_each_queued_job_by_teardown_s():
    """Both pipelines ask for the whole cluster: the second starts when the first has exited."""
    base = _runs(scenario_dict(), "exclusive-queue")
    torn = _runs(scenario_dict(run={"teardown_s": 7.0}), "exclusive-queue")
    a0, b0 = base.pipelines["a"], base.pipelines["b"]
    a1, b1 = torn.pipelines["a"], torn.pipelines["b"]
    assert b0.started_at == pytest.approx(a0.finished_at, abs=1e-9)
    assert a1.started_at == 0.0 and a1.finished_at == a0.finished_at
    assert b1.started_at == pytest.approx(a1.finished_at + 7.0, abs=1e-9)
    assert b1.duration == pytest.approx(b0.duration, abs=1e-6)  # its own turn, only later
    assert torn.makespan == pytest.approx(base.makespan + 2 * 7.0, abs=1e-6)


# ---------------------------------------------------------------------- set-up by mode
def _one_gpu(**top) -> dict:
    d = one_gpu_dict(steps=2)
    d.pop("transitions")
    d["costs"] = {"sleep_s": 2, "wake_sync_s": 10, "sync_s": 5, "recapture_s": 0,
                  "trainer_reload_s": 0, "trainer_offload_s": 0, "cold_start_s": 40}
    d.update(top)
    return d


@pytest.mark.parametrize("policy,charged", [("rlix", 30.0), ("exclusive-queue", 30.0),
                                            ("exclusive-partition", 12.0), ("alone", 30.0)])
def test_each_policy_is_charged_its_set_up_in_place_of_cold_start(policy, charged):
    s = build(_one_gpu())
    kw = {"only": "p"} if policy == "alone" else {}
    base = simulate(s, generate(s), policy, **kw).pipelines["p"].finished_at
    s2 = build(_one_gpu(run={"setup_s": 30, "standalone_setup_s": 12}))
    got = simulate(s2, generate(s2), policy, **kw).pipelines["p"].finished_at
    assert got == pytest.approx(base - 40.0 + charged, abs=1e-9)


def test_only_the_given_set_up_replaces_cold_start():
    """standalone_setup_s alone: partition uses it, the time-shared policies keep cold_start_s."""
    s = build(_one_gpu())
    s2 = build(_one_gpu(run={"standalone_setup_s": 5}))
    for policy, delta in (("rlix", 0.0), ("exclusive-queue", 0.0), ("exclusive-partition", -35.0)):
        a = simulate(s, generate(s), policy).makespan
        b = simulate(s2, generate(s2), policy).makespan
        assert b == pytest.approx(a + delta, abs=1e-9), policy


# ---------------------------------------------------------------------- in-flight cap
def _peak_in_flight(d: dict, monkeypatch) -> tuple[int, int, float]:
    """Largest number of trajectories at once between their first dispatch and their end,
    measured from the shards' side; the run's own peak; the makespan."""
    first: dict[int, tuple[float, object]] = {}
    orig = Shard.start_prefill

    def spy(self, traj, tokens):
        first.setdefault(id(traj), (self.clock.now, traj))
        return orig(self, traj, tokens)

    monkeypatch.setattr(Shard, "start_prefill", spy)
    s = build(d)
    sim = _Sim(s, generate(s), "rlix")
    run_rlix(sim)
    res = sim.finish()
    monkeypatch.setattr(Shard, "start_prefill", orig)
    events = []
    for start, traj in first.values():
        events += [(start, 1), (traj.finished_at, -1)]  # an end before a start at one time
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak, max(r.peak_in_flight for r in sim.runs), res.makespan


def _capped(cap: int | None, max_shards: int = 1) -> dict:
    rollout = {"prompts": 4, "samples": 4, "extra_turns_mean": 1, "max_turns": 3,
               "gen_tokens": {"median": 200, "sigma": 1.0, "max": 2000},
               "tool_s": {"median": 2.0, "sigma": 1.0}, "prompt_tokens": 300, "obs_tokens": 100}
    if cap is not None:
        rollout["in_flight"] = cap
    return scenario_dict(pipelines=[pipe("a", seqs_per_shard=8, max_shards=max_shards, rollout=rollout)])


def test_in_flight_cap_bounds_concurrent_samples(monkeypatch):
    free, _, free_makespan = _peak_in_flight(_capped(None), monkeypatch)
    assert free > 5  # without the cap more than 5 are in flight at once (16 a step, staleness 1)
    peak, own, makespan = _peak_in_flight(_capped(5), monkeypatch)
    assert peak == own == 5
    assert makespan > free_makespan


def test_in_flight_cap_is_per_active_shard(monkeypatch):
    """As the real collector's `concurrency`: two active shards, twice the samples in flight,
    and the run ends sooner than with one shard's worth split over them."""
    one = _peak_in_flight(_capped(5, max_shards=1), monkeypatch)
    two = _peak_in_flight(_capped(5, max_shards=2), monkeypatch)
    assert one[0] == 5 and 5 < two[0] <= 10 and two[0] == two[1]
    assert two[2] < one[2]


def test_in_flight_cap_at_or_above_what_is_released_changes_nothing(monkeypatch):
    """16 a step and max_staleness 1: at most 32 released at once, so a cap of 32 never binds."""
    free = _peak_in_flight(_capped(None), monkeypatch)
    loose = _peak_in_flight(_capped(32), monkeypatch)
    assert loose[0] == free[0] and loose[2] == pytest.approx(free[2], abs=1e-9)
