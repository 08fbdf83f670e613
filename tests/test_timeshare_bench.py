"""bench/timeshare_gpu.py's pure parts (bench/benchlib/timeshare.py) on summaries built by hand:
makespan ratios, the GPU-time account's shares (the switch split between shards and trainers),
shard starts after set-up, the move costs, unfinished pipelines. No Ray, no runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from rlix.timeline import build_timeline, gpu_account

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from benchlib import timeshare as ts  # noqa: E402


def test_ratios_are_the_other_modes_makespan_over_the_time_shared_one():
    assert ts.ratios("mix", {"timeshared": 100.0, "partition": 150.0, "queue": 250.0}) == {
        "mix_timeshared_vs_partition": 1.5, "mix_timeshared_vs_queue": 2.5}
    assert ts.ratios("agentic", {"timeshared": 80.0, "queue": 60.0}) == {"agentic_timeshared_vs_queue": 0.75}
    assert ts.ratios("longtail", {"partition": 10.0, "queue": 20.0}) == {}  # nothing to compare with


def shard_summary() -> dict:
    """Pipeline a: set up until its first step began at t=100; shard 0 started in set-up, slept,
    woke (sync 0.3 s), slept again and was started anew at 109 (a restart); rank 1 started at
    107, 3 s after the scheduler granted it GPU 1."""
    return {
        "role_changes": [
            {"seq": 1, "at": 98.0, "gpu": 0, "before": "idle", "after": "a/generate#0", "reason": "expand"},
            {"seq": 2, "at": 104.0, "gpu": 1, "before": "idle", "after": "a/generate#1", "reason": "expand"},
            {"seq": 3, "at": 108.0, "gpu": 0, "before": "a/generate#0", "after": "a/train", "reason": "grant"},
            {"seq": 4, "at": 108.5, "gpu": 2, "before": "idle", "after": "a/generate#0", "reason": "expand"},
        ],
        "pipelines": {"a": {
            "state": "done", "steps": 1,
            "records": [{"step": 1, "finished_at": 110.0, "step_s": 10.0, "reload_s": 0.5, "offload_s": 0.25}],
            "events": [
                [99.0, "start", [0], 0, 0.0], [99.1, "wake", [0], None, 0.01], [99.2, "activate", [0], 0, 0.0],
                [104.0, "sleep", [0], None, 0.2], [106.0, "sync", [0], 1, 0.3], [106.1, "activate", [0], 1, 0.0],
                [107.0, "start", [1], 1, 0.0], [108.2, "sleep", [0], None, 0.4],
                [109.0, "start", [0], 1, 0.0], [109.5, "activate", [0, 1], 1, 0.0],
            ],
            # a shard process's cumulative CUDA graph capture at each of its sleeps (the third
            # row is a new process on that GPU: its counter starts again)
            "gpu_memory": [{"event": "release", "holder": "shard 0 of pipeline a on GPU 0", "graph_capture_ms": v}
                           for v in (0.0, 400.0, 900.0, 100.0)]
                          + [{"event": "acquire", "holder": "trainer of a"}]}},
    }


def test_shard_starts_after_setup_count_each_rank_and_restarts():
    starts = ts.shard_starts(shard_summary())
    assert starts == {"after_setup": 2, "during_setup": 1, "restarts": 1, "per_pipeline": {"a": 2}}
    # a pipeline with no step never ended its set-up: its starts are all set-up's
    no_steps = shard_summary()
    no_steps["pipelines"]["a"]["records"] = []
    assert ts.shard_starts(no_steps)["after_setup"] == 0
    assert ts.startup_s(shard_summary(), launched_at=95.0) == 5.0


def test_move_costs_medians_from_events_records_and_grants():
    samples = ts.move_samples(shard_summary())
    assert samples["sleep_s"] == [0.2, 0.4]
    assert samples["wake_sync_s"] == [0.3]  # the activations after a start are cold: not here
    assert samples["sync_s"] == [0.3] and samples["recapture_s"] == [0.4, 0.5]
    assert samples["cold_start_s"] == [3.0, 0.5]  # grant at 104 -> start at 107; 108.5 -> 109
    assert samples["trainer_reload_s"] == [0.5] and samples["trainer_offload_s"] == [0.25]
    costs = ts.move_costs([shard_summary(), shard_summary()])
    assert costs["sleep_s"] == 0.3 and costs["cold_start_s"] == 1.75 and costs["wake_sync_s"] == 0.3
    assert costs["samples"]["sleep_s"] == 4
    assert set(costs) >= {"sleep_s", "wake_sync_s", "trainer_reload_s", "trainer_offload_s", "cold_start_s"}
    assert ts.move_costs([])["sleep_s"] is None


def test_the_cost_table_is_what_rlix_reads(tmp_path):
    costs = {"sleep_s": 0.05, "wake_sync_s": 0.04, "sync_s": 0.06, "recapture_s": None, "trainer_reload_s": 0.2,
             "trainer_offload_s": 0.1, "cold_start_s": 12.5, "samples": {"sleep_s": 3}}
    table = ts.cost_table(costs, "H100, 0.5B")
    # a move without samples is left out (the defaults stand); sync is part of wake + sync
    assert table == {"costs": {"sleep_s": 0.05, "wake_sync_s": 0.04, "sync_s": 0.04, "trainer_reload_s": 0.2,
                               "trainer_offload_s": 0.1, "cold_start_s": 12.5}, "about": "H100, 0.5B"}
    reader = pytest.importorskip("rlix.scheduler.costs")
    path = tmp_path / "move_costs.json"
    path.write_text(json.dumps(table))
    read = reader.load_move_costs(path)
    assert (read.sleep_s, read.sync_s, read.cold_start_s) == (0.05, 0.04, 12.5)


def account_summary() -> dict:
    """2 GPUs x 20 s. GPU 0: a's shard 0..10 (started, active from 2), then a's trainer 10..20:
    the shard sleeps 10-10.5, reload 10.5-11.5, train 11.5-17.5, cache 17.5-18, offload 18-19,
    waiting 19-20. GPU 1 idle throughout."""
    s = {
        "run": {"started_at": 0.0, "ended_at": 20.0, "gpu_nodes": [0, 0]},
        "role_changes": [
            {"seq": 1, "at": 0.0, "gpu": 0, "before": "idle", "after": "a/generate#0", "reason": "expand"},
            {"seq": 2, "at": 10.0, "gpu": 0, "before": "a/generate#0", "after": "a/train", "reason": "grant"},
        ],
        "pipelines": {"a": {
            "records": [{"step": 1, "finished_at": 20.0, "step_s": 20.0, "generate_s": 10.5, "wait_gpus_s": 0.0,
                         "reload_s": 1.0, "train_s": 6.0, "cache_s": 0.5, "offload_s": 1.0}],
            "events": [[2.0, "start", [0], 0, 0.0], [2.0, "activate", [0], 0, 0.0], [10.5, "sleep", [0], None, 0.5]],
        }},
    }
    s["gpu_account"] = gpu_account(build_timeline(s))
    return s


def test_account_shares_and_the_switch_split_between_shards_and_trainers():
    s = account_summary()
    shard, trainer = ts.switch_split(s)
    assert shard == pytest.approx(2.5) and trainer == pytest.approx(2.0)  # start 2 + sleep 0.5 | reload + offload
    assert shard + trainer == pytest.approx(s["gpu_account"]["pipelines"]["a"]["switch"])
    acc = ts.account([s])
    assert acc is not None and acc["gpu_s"] == 40.0 and acc["runs"] == 1
    assert acc["shares"] == pytest.approx({"generate": 0.2, "train": 0.15, "sync": 0.0125, "switch": 0.1125,
                                           "waiting": 0.025, "idle": 0.5, "lost": 0.0})
    assert sum(acc["shares"].values()) == pytest.approx(1.0)
    assert acc["switch_share"] == 0.0625 and acc["trainer_switch_share"] == 0.05 and acc["idle_share"] == 0.5
    both = ts.account([s, s])  # runs are summed before the shares
    assert both["gpu_s"] == 80.0 and both["switch_share"] == 0.0625
    # standalone runs have no role log: nobody is known to have held a GPU, so no account
    standalone = dict(s, role_changes=[], gpu_account=dict(s["gpu_account"], role_changes=0))
    assert ts.account([standalone]) is None and ts.account([]) is None


def test_unfinished_names_each_pipeline_short_of_its_steps():
    summary = {"pipelines": {"a": {"state": "done", "steps": 3},
                             "b": {"state": "failed", "steps": 1, "error": "shard died"},
                             "c": {"state": "done", "steps": 2}}}
    out = ts.unfinished(summary, {"a": 3, "b": 3, "c": 3, "d": 1}, "mix-timeshared")
    assert out == ["mix-timeshared/b (shard died)", "mix-timeshared/c (done, 2 of 3 steps)",
                   "mix-timeshared/d (not in the summary)"]
    assert ts.unfinished(None, {"a": 3}, "run") == ["run/a (no summary)"]
    assert ts.unfinished(summary, {"a": 3}, "run") == []


def test_device_idle_share_counts_a_device_busy_while_any_of_its_slices_is_held():
    """One device as two slices over 10 s: slice 0 held 0-4 s, slice 1 held 2-6 s: the device
    is idle 4 of its 10 s (the slices' account says 12 of 20); two devices, the second never
    held: 14 of 20."""
    def span(gpu, t0, t1, role):
        return {"ph": "X", "cat": "gpu", "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6, "args": {"gpu": gpu, "role": role}}
    events = [span(0, 0, 4, "a/train"), span(0, 4, 10, "idle"), span(1, 0, 2, "idle"), span(1, 2, 6, "b/generate#0"),
              span(1, 6, 10, "idle"), {"ph": "X", "cat": "gpu part", "ts": 0, "dur": 1e7, "args": {"gpu": 0}}]
    trace = {"traceEvents": events, "otherData": {"span_s": 10.0}}
    assert ts.device_idle_share(trace, slices=2) == 0.4
    trace["traceEvents"] = events + [span(2, 0, 10, "idle"), span(3, 0, 10, "idle")]
    assert ts.device_idle_share(trace, slices=2) == 0.7
    assert ts.device_idle_share({"traceEvents": []}, slices=2) is None


def test_more_pipelines_than_gpus_share_them_and_the_rate_counts_finished_steps():
    """`--gpus 1 --pipelines 2`: both pipelines may hold the one GPU's shard (no partition), and
    the steps-per-hour figure counts the steps the summaries say were done."""
    from argparse import Namespace

    import timeshare_gpu as tg
    args = Namespace(gpus=1, pipelines=2, model="tiny", lr=1e-3, spread=0.4, groups=4, group_size=4,
                     max_num_seqs=64, tail_max_tokens=64, tail_median=8.0, tail_sigma=1.0, tail_min=2,
                     tail_steps=5, max_staleness=None, capture_graphs=False)
    pipes = tg.workload_pipelines("longtail", args)
    assert [(p["name"], p["steps"], p["max_shards"], p["gpus"]) for p in pipes] == [
        ("tail-0", 5, 1, [0]), ("tail-1", 7, 1, [0])]
    run = {"makespan_s": 84.0, "summary": {"pipelines": {"tail-0": {"steps": 5}, "tail-1": {"steps": 2}}}}
    assert tg.steps_per_hour([run]) == pytest.approx(3600 * 7 / 84)
    assert tg.steps_per_hour([dict(run, summary=None)]) is None
