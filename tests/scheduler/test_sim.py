"""The cluster simulator: determinism, conservation, the decode and preemption models against
hand-computed times, the exclusive-queue identity, scenario errors, and the shipped example."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlix.errors import ScenarioError
from rlix.sim import POLICIES, cli_sim, load_scenario, run_scenario, simulate
from rlix.sim.scenario import ScenarioModel, build_scenario
from rlix.sim.workload import TrajectorySpec, Workload, generate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "sim"


def scenario_dict(nodes=1, gpus_per_node=4, pipelines=None, **top) -> dict:
    pipe = {
        "name": "p", "steps": 3, "train_gpus": 2, "train_gpu_seconds": 20.0, "max_shards": 4,
        "max_staleness": 1, "seqs_per_shard": 2,
        "rollout": {"prompts": 2, "samples": 2, "extra_turns_mean": 2, "max_turns": 6,
                    "gen_tokens": {"median": 200, "sigma": 1.0, "max": 2000},
                    "tool_s": {"median": 2.0, "sigma": 1.0},
                    "prompt_tokens": 300, "obs_tokens": 100},
    }
    d = {"name": "tiny", "seed": 3, "cluster": {"nodes": nodes, "gpus_per_node": gpus_per_node},
         "pipelines": pipelines if pipelines is not None else [dict(pipe, name="a"), dict(pipe, name="b")]}
    d.update(top)
    return d


def build(d: dict):
    return build_scenario(ScenarioModel.model_validate(d), "test.yaml")


def one_gpu(steps: int, staleness: int, prompt_tokens: int, train_gpu_s: float = 4.0, **engine):
    d = scenario_dict(nodes=1, gpus_per_node=1, pipelines=[{
        "name": "p", "steps": steps, "train_gpus": 1, "train_gpu_seconds": train_gpu_s,
        "max_shards": 1, "max_staleness": staleness,
        "rollout": {"prompts": 1, "samples": 2 if steps == 1 else 1,
                    "gen_tokens": {"median": 10}, "prompt_tokens": prompt_tokens, "obs_tokens": 0},
    }], engine=dict({"max_seqs": 8, "decode_base_ms": 20, "decode_per_seq_ms": 0.3,
                     "prefill_tokens_per_s": 20000}, **engine),
        transitions={"sync_s": 5, "sleep_s": 2, "wake_s": 5})
    return build(d)


def single_turn(*lengths: int, prompt: int) -> tuple[TrajectorySpec, ...]:
    return tuple(TrajectorySpec(gen=(n,), tool=(), prompt_tokens=prompt, obs_tokens=0) for n in lengths)


# ---------------------------------------------------------------------- determinism
def test_same_seed_gives_identical_json():
    sc = build(scenario_dict())
    assert json.dumps(run_scenario(sc)) == json.dumps(run_scenario(sc))


def test_result_does_not_depend_on_the_process_hash_seed(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(json.dumps(scenario_dict()))  # JSON is YAML
    code = "import sys; from rlix.sim import cli_sim; cli_sim(sys.argv[1], True)"
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.append(subprocess.run([sys.executable, "-c", code, str(path)], env=env, check=True,
                                   capture_output=True, text=True).stdout)
    assert outs[0] == outs[1] and json.loads(outs[0])["policies"]


def test_different_seed_changes_the_workload():
    a = generate(build(scenario_dict(seed=1)))
    b = generate(build(scenario_dict(seed=2)))
    assert a["a"].batches != b["a"].batches


# ---------------------------------------------------------------------- conservation
def test_every_trajectory_finishes_exactly_once_in_every_policy():
    sc = build(scenario_dict())
    workloads = generate(sc)
    for policy in POLICIES:
        res = simulate(sc, workloads, policy)
        for setup in sc.pipelines:
            p = res.pipelines[setup.name]
            w = workloads[setup.name]
            assert len(p.step_ends) == setup.steps, policy
            assert len(p.traj_finish_times) == w.trajectories, policy
            assert all(t is not None for t in p.traj_finish_times), policy
            assert p.trajectories == w.trajectories, policy  # finish events, so no double finish
            assert p.tokens == pytest.approx(w.tokens, rel=1e-9), policy
            assert p.train_gpu_s == pytest.approx(setup.steps * setup.train_gpu_seconds)


# ---------------------------------------------------------------------- queue == sum of alone
def test_exclusive_queue_of_whole_cluster_jobs_is_the_sum_of_alone_makespans():
    sc = build(scenario_dict())  # both ask for max(train 2, 4 shards) = the whole 4 GPUs
    workloads = generate(sc)
    queue = simulate(sc, workloads, "exclusive-queue")
    alone = [simulate(sc, workloads, "alone", only=p.name).makespan for p in sc.pipelines]
    assert queue.makespan == pytest.approx(sum(alone), rel=1e-9)
    assert queue.pipelines["b"].started_at == pytest.approx(alone[0], rel=1e-9)


# ---------------------------------------------------------------------- decode model
def test_decode_on_one_shard_matches_processor_sharing_by_hand():
    sc = one_gpu(steps=1, staleness=0, prompt_tokens=2000)
    work = {"p": Workload("p", (single_turn(100, 1000, prompt=2000),))}
    res = simulate(sc, work, "rlix")
    t1, t2 = 0.0203, 0.0206  # step time with 1 and 2 running sequences
    ready = 5 + 5  # wake + sync
    p = 2000 / 20000  # each prompt's prefill; the prefill queue is FIFO
    a_alone = p / t1  # A decodes alone while B is still in prefill
    a_done = ready + 2 * p + (100 - a_alone) * t2
    b_done = a_done + (1000 - (100 - a_alone)) * t1
    times = res.pipelines["p"].traj_finish_times
    assert times[0] == pytest.approx(a_done, rel=1e-9)
    assert times[1] == pytest.approx(b_done, rel=1e-9)
    # the train step then preempts the shard (sleep 2 s) and runs 4 GPU-s on 1 GPU
    assert res.makespan == pytest.approx(b_done + 2 + 4, rel=1e-9)


def test_sync_pause_delays_running_sequences_by_exactly_sync_s():
    # One shard on GPU 0; the train step lands on the idle GPU 1 and preempts nothing.
    d = scenario_dict(nodes=1, gpus_per_node=2, pipelines=[{
        "name": "p", "steps": 2, "train_gpus": 1, "train_gpu_seconds": 5.0, "max_shards": 1,
        "max_staleness": 1,
        "rollout": {"prompts": 1, "samples": 1, "gen_tokens": {"median": 10},
                    "prompt_tokens": 0, "obs_tokens": 0}}],
        transitions={"sync_s": 5, "sleep_s": 2, "wake_s": 5})
    sc = build(d)
    work = {"p": Workload("p", (single_turn(100, prompt=0), single_turn(1000, prompt=0)))}
    res = simulate(sc, work, "rlix")
    t1, t2 = 0.0203, 0.0206
    a_done = 10 + 100 * t2
    # Step 0 trains 5 s on GPU 1 while B decodes; then B's shard pauses 5 s for the weight sync.
    b_done = a_done + 900 * t1 + 5
    p = res.pipelines["p"]
    assert p.traj_finish_times == pytest.approx([a_done, b_done], rel=1e-9)
    assert p.step_ends[0] == pytest.approx(a_done + 5, rel=1e-9)
    assert p.preempted_turns == 0


# ---------------------------------------------------------------------- preemption
def test_tokens_generated_before_a_shrink_are_kept_not_regenerated():
    sc = one_gpu(steps=2, staleness=1, prompt_tokens=0, train_gpu_s=4.0)
    work = {"p": Workload("p", (single_turn(100, prompt=0), single_turn(1000, prompt=0)))}
    res = simulate(sc, work, "rlix")
    t1, t2 = 0.0203, 0.0206
    a_done = 10 + 100 * t2  # A and B decode together; A's batch completes -> train step 0
    train0_end = a_done + 2 + 4  # shrink the only shard (sleep 2 s), train 4 s
    # B resumes on a re-woken shard with its 100 tokens: re-prefill them, 900 left to decode
    b_done = train0_end + 10 + 100 / 20000 + 900 * t1
    p = res.pipelines["p"]
    assert p.preempted_turns == 1
    assert p.kept_tokens == pytest.approx(100, rel=1e-9)
    assert p.traj_finish_times == pytest.approx([a_done, b_done], rel=1e-9)
    assert p.tokens == pytest.approx(1100, rel=1e-9)
    assert res.makespan == pytest.approx(b_done + 2 + 4, rel=1e-9)


# ---------------------------------------------------------------------- bad scenarios
@pytest.mark.parametrize("patch, field", [
    (lambda d: d.update(engine={"max_seqs": 0}), "engine.max_seqs"),
    (lambda d: d["pipelines"][0].update(trian_gpus=2), "pipelines[0].trian_gpus"),
    (lambda d: d["pipelines"][1].update(tp=8), "pipelines[1].tp"),
    (lambda d: d["pipelines"][0]["rollout"].pop("gen_tokens"), "pipelines[0].rollout.gen_tokens"),
])
def test_bad_scenario_raises_scenario_error_naming_file_and_field(tmp_path, patch, field):
    d = scenario_dict()
    patch(d)
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(d))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    msg = str(info.value)
    assert str(path) in msg and field in msg and "\n" not in msg


def test_missing_or_unparsable_scenario_file_is_a_scenario_error(tmp_path):
    with pytest.raises(ScenarioError, match="no such file"):
        cli_sim(str(tmp_path / "nope.yaml"), True)
    broken = tmp_path / "broken.yaml"
    broken.write_text("cluster: [1, 2\n")
    with pytest.raises(ScenarioError, match="broken.yaml.*not valid YAML"):
        load_scenario(broken)


# ---------------------------------------------------------------------- shipped example
def test_agentic_longtail_example_runs_in_time_and_reports_every_key():
    started = time.perf_counter()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_sim(str(EXAMPLES / "agentic-longtail.yaml"), True) == 0
    wall = time.perf_counter() - started
    report = json.loads(out.getvalue())
    assert wall < 60, f"took {wall:.1f}s"
    for key in ("ideal_makespan_s", "throughput_ratio_vs_exclusive", "throughput_ratio_vs_partition",
                "efficiency_vs_ideal", "alone_makespan_s"):
        assert key in report
    assert set(report["policies"]) == set(POLICIES)
    names = [f"swe-{i}" for i in range(4)]
    for m in report["policies"].values():
        for key in ("trajectories_per_hour", "tokens_per_gpu_hour", "gpu_busy_fraction",
                    "step_time_p50_s", "step_time_p95_s", "makespan_s"):
            assert m[key] > 0
        assert m["trajectories"] == 4 * 20 * 64
        assert sorted(m["train_steps_per_hour"]) == names
        assert sorted(m["pipeline_makespan_s"]) == names
        assert 0 < m["gpu_busy_fraction"] <= 1
    assert report["ideal_makespan_s"] <= min(m["makespan_s"] for m in report["policies"].values())


@pytest.mark.parametrize("name", ["math-rlvr.yaml", "mixed-priority.yaml"])
def test_other_examples_load(name):
    sc = load_scenario(EXAMPLES / name)
    assert sc.gpus == 16 and len(sc.pipelines) >= 3
