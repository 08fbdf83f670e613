"""Metrics per policy, the ideal bound, the JSON object and the rich tables.

The ideal bound is what no scheduler can beat: max(total GPU work / GPU count, the longest
makespan of any pipeline run alone on the whole cluster). GPU work counts training, decode at
the most efficient batch (a full shard: tokens * step_time(max_seqs) / max_seqs) and prefill
with a perfect prefix cache, so it is a lower bound on every real schedule.
"""

from __future__ import annotations

import math

from rich.table import Table

from rlix.sim.results import NotApplicable, PipelineResult, RunResult
from rlix.sim.scenario import Scenario
from rlix.sim.workload import Workload, gpu_work


def _r(x: float, digits: int = 3) -> float:
    return round(float(x), digits)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def policy_metrics(res: RunResult) -> dict:
    makespan = res.makespan
    hours = makespan / 3600.0
    pipes = res.pipelines.values()
    trajectories = sum(p.trajectories for p in pipes)
    tokens = sum(p.tokens for p in pipes)
    train = sum(p.train_gpu_s for p in pipes)
    inference = sum(p.shard_busy_gpu_s for p in pipes)
    capacity = res.gpus * makespan
    steps = [b - a for p in pipes for a, b in zip(p.step_ends, p.step_ends[1:])]
    decode_s = sum(p.decode_s for p in pipes)
    waits = [w for p in pipes for w in p.train_waits]
    turns = sum(p.turns for p in pipes)
    return {
        "applicable": True,
        "makespan_s": _r(makespan),
        "trajectories": trajectories,
        "trajectories_per_hour": _r(trajectories / hours),
        "tokens_generated": int(round(tokens)),
        "tokens_per_gpu_hour": _r(tokens / (res.gpus * hours), 1),
        "train_steps_per_hour": {p.name: _r(len(p.step_ends) / (p.finished_at / 3600.0))
                                 for p in pipes},
        "train_steps": {p.name: len(p.step_ends) for p in pipes},
        "gpu_busy_fraction": _r((train + inference) / capacity, 4),
        "step_time_p50_s": _r(percentile(steps, 50)),
        "step_time_p95_s": _r(percentile(steps, 95)),
        "pipeline_makespan_s": {p.name: _r(p.finished_at) for p in pipes},
        "pipeline_started_s": {p.name: _r(p.started_at) for p in pipes},
        "gpu_seconds": {
            "train": _r(train, 1),
            "inference_busy": _r(inference, 1),
            "transitions": _r(res.transition_gpu_s, 1),
            "capacity": _r(capacity, 1),
        },
        "mean_decode_batch": _r(sum(p.seq_s for p in pipes) / decode_s if decode_s else 0.0, 2),
        "prefill_tokens": int(round(sum(p.prefill_tokens for p in pipes))),
        "train_wait_mean_s": _r(sum(waits) / len(waits) if waits else 0.0),
        "train_wait_p95_s": _r(percentile(waits, 95)),
        "router_wait_per_turn_s": _r(sum(p.queue_turn_s for p in pipes) / max(1, turns)),
        "shard_wakes": sum(p.expands for p in pipes),
        "preempted_turns": sum(p.preempted_turns for p in pipes),
        "kept_tokens": int(round(sum(p.kept_tokens for p in pipes))),
        "plan_calls": res.plan_calls,
        "jain_fairness": _r(res.jain_fairness, 4),
        "pipelines": {p.name: pipeline_figures(p) for p in pipes},
    }


def pipeline_figures(p: PipelineResult) -> dict:
    """What one pipeline got in one run (the JSON edge of `PipelineResult`)."""
    return {
        "arrived_s": _r(p.arrived_at),
        "started_s": _r(p.started_at),
        "finished_s": _r(p.finished_at),
        "completion_s": _r(p.completion_s),
        "slowdown": None if p.slowdown is None else _r(p.slowdown, 4),
        "gpu_seconds": {role: _r(v, 1) for role, v in p.gpu_seconds.items()},
        "demand_gpu_s": _r(p.demand_gpu_s, 1),
        "gpu_share": _r(p.gpu_share, 4),
        "demand_share": _r(p.demand_share, 4),
        "longest_shardless_wait_s": _r(p.longest_shardless_wait_s),
        "shardless_s": _r(p.shardless_s),
        "train_steps": len(p.step_ends),
        "crashes": p.crashes,
    }


def ideal_bound(scenario: Scenario, workloads: dict[str, Workload],
                alone: dict[str, float]) -> dict:
    """No schedule ends before every pipeline's arrival plus its time alone, nor before the
    work of the pipelines arriving at or after t, spread over all GPUs from t, for any t; and
    its run then still exits (`run.teardown_s`, added to the larger bound)."""
    works = {s.name: gpu_work(s, workloads[s.name]) for s in scenario.pipelines}
    train = sum(w.train for w in works.values())
    decode = sum(w.decode for w in works.values())
    prefill = sum(w.prefill for w in works.values())
    stages = sum(w.stages for w in works.values())
    work = train + decode + prefill + stages
    arrivals = sorted({s.arrive_s for s in scenario.pipelines})
    work_bound = max(t + sum(works[s.name].total for s in scenario.pipelines if s.arrive_s >= t)
                     / scenario.gpus for t in arrivals)
    alone_bound = max(s.arrive_s + alone[s.name] for s in scenario.pipelines)
    return {
        "ideal_makespan_s": _r(max(work_bound, alone_bound) + scenario.run.teardown_s),
        "gpu_work_s": _r(work, 1),
        "train_gpu_s": _r(train, 1),
        "decode_gpu_s": _r(decode, 1),
        "prefill_gpu_s": _r(prefill, 1),
        "stages_gpu_s": _r(stages, 1),
        "work_bound_s": _r(work_bound),
        "alone_bound_s": _r(alone_bound),
    }


def priority_check(scenario: Scenario, rlix: RunResult, alone: dict[str, float]) -> dict | None:
    """For a mixed-priority scenario: how much the top tier loses to sharing, and how far the
    others got meanwhile."""
    tiers = {p.spec.priority for p in scenario.pipelines}
    if len(tiers) < 2:
        return None
    top = max(tiers)
    high = [p.name for p in scenario.pipelines if p.spec.priority == top]
    done_at = max(rlix.pipelines[n].finished_at for n in high)
    return {
        "high_priority": high,
        "slowdown_vs_alone": {n: _r(rlix.pipelines[n].completion_s / alone[n] - 1.0, 4) for n in high},
        "within_10pct_of_alone": all(rlix.pipelines[n].completion_s <= 1.1 * alone[n] for n in high),
        "others_steps_when_high_done": {
            p.name: sum(1 for t in p.step_ends if t <= done_at)
            for p in rlix.pipelines.values() if p.name not in high},
        "others_trajectories_per_hour_while_high_ran": _r(sum(
            sum(1 for t in p.traj_finish_times if t is not None and t <= done_at)
            for p in rlix.pipelines.values() if p.name not in high) / (done_at / 3600.0)),
    }


def build_report(scenario: Scenario, workloads: dict[str, Workload], runs: dict[str, RunResult],
                 alone: dict[str, float], alone_source: dict[str, str],
                 skipped: dict[str, NotApplicable] | None = None) -> dict:
    from rlix.sim.policies import POLICIES  # the canonical order

    skipped = skipped or {}
    policies: dict[str, dict] = {}
    for name in [p for p in POLICIES if p in runs or p in skipped] + \
            [p for p in runs if p not in POLICIES]:
        if name in runs:
            policies[name] = policy_metrics(runs[name])
        else:
            policies[name] = {"applicable": False, "reason": skipped[name].reason}
    out: dict = {
        "scenario": scenario.name,
        "source": scenario.source,
        "seed": scenario.seed,
        "gpus": scenario.gpus,
        "pipelines": [p.name for p in scenario.pipelines],
        "policies": policies,
        "alone_makespan_s": {n: _r(t) for n, t in alone.items()},
        "alone_source": alone_source,
    }
    ideal = ideal_bound(scenario, workloads, alone)
    out["ideal_makespan_s"] = ideal["ideal_makespan_s"]
    out["ideal"] = ideal
    pol = {k: v for k, v in out["policies"].items() if v["applicable"]}
    if "rlix" in pol:
        rl = pol["rlix"]
        if "exclusive-queue" in pol:
            out["throughput_ratio_vs_exclusive"] = _r(
                rl["trajectories_per_hour"] / pol["exclusive-queue"]["trajectories_per_hour"], 4)
        if "exclusive-partition" in pol:
            out["throughput_ratio_vs_partition"] = _r(
                rl["trajectories_per_hour"] / pol["exclusive-partition"]["trajectories_per_hour"], 4)
        out["efficiency_vs_ideal"] = _r(ideal["ideal_makespan_s"] / rl["makespan_s"], 4)
        check = priority_check(scenario, runs["rlix"], alone)
        if check is not None:
            out["priority_check"] = check
    return out


def render(report: dict, console, wall_s: float | None = None) -> None:
    """Human-readable tables (rich)."""
    pol = {k: v for k, v in report["policies"].items() if v["applicable"]}
    t = Table(title=f"{report['scenario']}: {report['gpus']} GPUs, {len(report['pipelines'])} pipelines")
    t.add_column("policy", no_wrap=True)
    for col in ("makespan h", "traj/h", "tok/GPU-h", "GPU busy", "step p50 s", "step p95 s",
                "decode batch", "preempted"):
        t.add_column(col, justify="right")
    for name, m in pol.items():
        t.add_row(name, f"{m['makespan_s'] / 3600:.2f}", f"{m['trajectories_per_hour']:.0f}",
                  f"{m['tokens_per_gpu_hour']:,.0f}", f"{m['gpu_busy_fraction']:.1%}",
                  f"{m['step_time_p50_s']:.0f}", f"{m['step_time_p95_s']:.0f}",
                  f"{m['mean_decode_batch']:.1f}", f"{m['preempted_turns']}")
    console.print(t)

    p = Table(title="pipeline makespan (s, from t=0)")
    p.add_column("pipeline", no_wrap=True)
    for name in pol:
        p.add_column(name, justify="right")
    p.add_column("alone", justify="right")
    for n in report["pipelines"]:
        p.add_row(n, *[f"{pol[k]['pipeline_makespan_s'][n]:.0f}" for k in pol],
                  f"{report['alone_makespan_s'][n]:.0f}")
    console.print(p)
    for name, m in pol.items():
        render_pipelines(name, m, console)
    for name, m in report["policies"].items():
        if not m["applicable"]:
            console.print(f"{name}: not applicable: {m['reason']}")

    ideal = report["ideal"]
    console.print(f"ideal makespan {ideal['ideal_makespan_s']:.0f} s = max(GPU work bound "
                  f"{ideal['work_bound_s']:.0f} s ({ideal['gpu_work_s']:.0f} GPU-s on {report['gpus']} "
                  f"GPUs, from the arrivals), latest arrival + alone {ideal['alone_bound_s']:.0f} s)")
    for key in ("throughput_ratio_vs_exclusive", "throughput_ratio_vs_partition", "efficiency_vs_ideal"):
        if key in report:
            console.print(f"{key}: {report[key]:.3f}")
    if "priority_check" in report:
        c = report["priority_check"]
        console.print(f"priority: {', '.join(c['high_priority'])} slowdown vs alone "
                      f"{c['slowdown_vs_alone']}; within 10%: {c['within_10pct_of_alone']}; "
                      f"others' steps meanwhile {c['others_steps_when_high_done']}")
    if wall_s is not None:
        console.print(f"simulated in {wall_s:.1f} s wall time")


def render_pipelines(policy: str, m: dict, console) -> None:
    """One policy's per-pipeline table: what each got against what it needed."""
    figs = m["pipelines"]
    roles = sorted({r for f in figs.values() for r in f["gpu_seconds"]},
                   key=lambda r: (r != "rollout", r != "train", r))
    t = Table(title=f"{policy}: per pipeline (Jain fairness of GPU share / demand share "
                    f"{m['jain_fairness']:.3f})")
    t.add_column("pipeline", no_wrap=True)
    for col in ["completion s", "slowdown"] + [f"{r} GPU-s" for r in roles] + \
            ["GPU share", "demand share", "longest no-shard wait s"]:
        t.add_column(col, justify="right")
    for n, f in figs.items():
        slow = "-" if f["slowdown"] is None else f"{f['slowdown']:.2f}"
        t.add_row(n, f"{f['completion_s']:.0f}", slow,
                  *[f"{f['gpu_seconds'].get(r, 0.0):,.0f}" for r in roles],
                  f"{f['gpu_share']:.3f}", f"{f['demand_share']:.3f}",
                  f"{f['longest_shardless_wait_s']:.0f}")
    console.print(t)
