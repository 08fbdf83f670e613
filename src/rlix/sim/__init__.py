"""Discrete-event cluster simulator: the real planner, driven by simulated async-GRPO pipelines.

`run_scenario` simulates a scenario under the three policies (exclusive-queue,
exclusive-partition, rlix) on one identical seeded workload and returns the report as a
JSON-ready dict; `run_policies` returns the typed results (`RunResult`, with each pipeline's
`PipelineResult`) instead; `cli_sim` is what `rlix sim SCENARIO.yaml [--json] [--out DIR]` calls.
A policy that cannot run the scenario is reported as not applicable; the others still run.
Modules: scenario (YAML models), workload (seeded trajectories, GPU work), shard
(decode/prefill model), pipeline (async loop + router + faults), engine (event loop + planner
domains), account (GPU-seconds held, no-shard waits), policies, results, report, trace (a run
recorded for rlix.timeline: with `out`, DIR/POLICY/ gets summary.json, timeline.json and
timeline.png).
"""

from __future__ import annotations

import json
import sys
import time

from rich.console import Console
from rich.progress import Progress
from collections.abc import Callable
from pathlib import Path

from rlix.run_summary import SUMMARY_FILE, GpuAccount
from rlix.sim.policies import POLICIES, applicable, simulate
from rlix.sim.results import NotApplicable, PipelineResult, RunResult
from rlix.sim.report import build_report, render
from rlix.sim.scenario import Scenario, load_scenario
from rlix.sim.trace import SimTrace
from rlix.sim.workload import generate
from rlix.timeline import write_timeline

__all__ = ["POLICIES", "NotApplicable", "PipelineResult", "RunResult", "Scenario", "cli_sim",
           "load_scenario", "run_scenario", "run_policies", "simulate"]


def total_steps(scenario: Scenario) -> int:
    return sum(p.steps for p in scenario.pipelines)


def run_scenario(scenario: Scenario | str | Path, policies: tuple[str, ...] = POLICIES,
                 on_run: Callable[[str, int], Callable[[str], None] | None] | None = None,
                 out: str | Path | None = None) -> dict:
    """Simulate every policy on one workload and build the report dict.

    `on_run(label, steps)` is called before each simulation and may return a per-step
    callback (used for progress bars). With `out`, each policy's run is recorded and
    out/POLICY/ gets its summary.json, timeline.json and timeline.png.
    """
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    workloads = generate(scenario)
    runs, skipped, alone, source = run_policies(scenario, workloads, policies, on_run, out)
    return build_report(scenario, workloads, runs, alone, source, skipped)


def run_policies(scenario: Scenario, workloads: dict, policies: tuple[str, ...] = POLICIES,
                 on_run: Callable[[str, int], Callable[[str], None] | None] | None = None,
                 out: str | Path | None = None
                 ) -> tuple[dict[str, RunResult], dict[str, NotApplicable], dict[str, float], dict[str, str]]:
    """The typed runs: (results by policy, policies that do not apply, alone completion time
    per pipeline, where each alone time came from). Every result's pipelines carry their
    `slowdown` against the alone time."""
    hook = on_run or (lambda label, steps: None)
    order = sorted(policies, key=lambda p: (p != "exclusive-queue", POLICIES.index(p)))
    runs: dict[str, RunResult] = {}
    skipped: dict[str, NotApplicable] = {}
    for policy in order:
        why = applicable(scenario, policy)
        if why is not None:
            skipped[policy] = why
            continue
        trace = SimTrace() if out is not None else None
        runs[policy] = simulate(scenario, workloads, policy,
                                on_step=hook(policy, total_steps(scenario)), trace=trace)
        if trace is not None:
            write_run(Path(out) / policy, scenario, policy, trace, runs[policy].makespan)
    # "Alone" times: reuse an exclusive-queue run that had the whole cluster to itself.
    alone: dict[str, float] = {}
    source: dict[str, str] = {}
    queue = runs.get("exclusive-queue")
    for setup in scenario.pipelines:
        res = queue.pipelines.get(setup.name) if queue is not None else None
        if res is not None and res.whole_cluster:
            alone[setup.name] = res.duration
            source[setup.name] = "exclusive-queue"
        else:
            solo = simulate(scenario, workloads, "alone", only=setup.name,
                            on_step=hook(f"alone {setup.name}", setup.steps))
            alone[setup.name] = solo.pipelines[setup.name].duration
            source[setup.name] = "alone run"
    for res in runs.values():
        for name, p in res.pipelines.items():
            p.slowdown = p.completion_s / alone[name] if alone[name] > 0 else None
    ordered = {p: runs[p] for p in POLICIES if p in runs}
    return ordered, skipped, alone, source


def write_run(run_dir: Path, scenario: Scenario, policy: str, trace: SimTrace, end: float) -> None:
    """One policy's recorded run as a run dir: summary.json (the shape `rlix timeline` reads)
    and its timeline, with the GPU-time account in the summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = trace.summary(scenario.name, policy, end, scenario.topology.node_of(),
                            [p.name for p in scenario.pipelines])
    summary.gpu_account = GpuAccount.model_validate(write_timeline(run_dir, summary))
    summary.write(run_dir / SUMMARY_FILE)


def cli_sim(path: str, as_json: bool, out: str | None = None) -> int:
    """`rlix sim`: JSON on stdout, or rich tables; a progress bar on stderr only on a terminal;
    with `out`, each policy's timeline under out/POLICY/."""
    scenario = load_scenario(path)
    started = time.perf_counter()
    if sys.stderr.isatty():
        with Progress(console=Console(stderr=True), transient=True) as bar:
            def on_run(label: str, steps: int):
                task = bar.add_task(label, total=steps)
                return lambda name: bar.advance(task)

            report = run_scenario(scenario, on_run=on_run, out=out)
    else:
        report = run_scenario(scenario, out=out)
    wall = time.perf_counter() - started
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report, Console(width=None if sys.stdout.isatty() else 120), wall_s=wall)
    return 0
