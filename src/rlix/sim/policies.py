"""The three policies (and "alone"), each a way of carving the cluster into planner domains.

- exclusive-queue: each pipeline holds what its config asks for, max(train_gpus,
  max_shards * tp) (train_gpus + max_shards * tp without partial overlap), for its whole run
  and its teardown (`run.teardown_s`: each job is its own run); pipelines that do not fit wait
  in a FIFO queue (no backfill past the head).
- exclusive-partition: the cluster is cut into equal contiguous slices (node-aligned where the
  sizes allow), one per pipeline, all at once; each spec is clipped to its slice.
- rlix: one domain over the whole cluster, every pipeline registered on it.
- alone: one pipeline by itself on the whole cluster (for the ideal bound).
A run's makespan is its last pipeline's finish plus `run.teardown_s` (the process's exit); a
pipeline's set-up is `run.setup_s` (rlix, queue, alone) or `run.standalone_setup_s`
(partition) where given, else the table's `cold_start_s` (resident engines).
Inside its GPUs every baseline pipeline runs through the same planner, so it gets the same
async loop, staleness bound and partial overlap as under RLix: only sharing differs.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from rlix.errors import ScenarioError
from rlix.sim.engine import Clock, Domain
from rlix.sim.pipeline import PipelineRun
from rlix.sim.results import NotApplicable, PipelineResult, RunResult
from rlix.sim.trace import SimTrace
from rlix.sim.scenario import PipelineSetup, Scenario
from rlix.sim.workload import Workload, gpu_work
from rlix.scheduler.types import PipelineSpec, Topology

POLICIES = ("exclusive-queue", "exclusive-partition", "rlix")


class _Sim:
    """Collects domains and runs the clock to the end."""

    def __init__(self, scenario: Scenario, workloads: dict[str, Workload], policy: str,
                 on_step=None, trace: SimTrace | None = None) -> None:
        self.scenario = scenario
        self.workloads = workloads
        self.policy = policy
        self.clock = Clock()
        self.domains: list[Domain] = []
        self.runs: list[PipelineRun] = []
        self.on_step = on_step
        self.trace = trace

    def domain(self, topology: Topology, gpu_ids: list[int], on_finish=None) -> Domain:
        d = Domain(self.clock, topology, self.scenario.params, gpu_ids, on_finish, self.trace)
        self.domains.append(d)
        return d

    def launch(self, domain: Domain, setup: PipelineSetup, spec: PipelineSpec) -> None:
        """Start a pipeline now, or at its arrival if that is later."""
        if setup.arrive_s > self.clock.now:
            self.clock.at(setup.arrive_s, self.launch, domain, setup, spec)
            return
        run = PipelineRun(self.clock, domain, setup, spec, self.workloads[setup.name],
                          setup_s=self.scenario.run.setup_for(self.policy))
        if self.on_step is not None:
            run.on_step = self.on_step
        self.runs.append(run)
        domain.add(run)

    def finish(self) -> RunResult:
        self.clock.run()
        stuck = [r.name for r in self.runs if r.finished_at is None]
        if stuck or len(self.runs) != len(self.scenario.pipelines) and self.policy != "alone":
            raise RuntimeError(f"simulation of {self.policy} ended with pipelines unfinished: {stuck}"
                               f" (t={self.clock.now:.1f}s)")
        whole = self.scenario.topology
        out = RunResult(self.policy, self.scenario.gpus, events=self.clock.events,
                        teardown_s=self.scenario.run.teardown_s)
        for d in self.domains:
            out.plan_calls += d.plan_calls
            out.transition_gpu_s += d.transition_gpu_s
        for r in sorted(self.runs, key=lambda r: r.setup.index):  # scenario order
            shards = r.all_shards()
            out.pipelines[r.name] = PipelineResult(
                name=r.name, priority=r.spec.priority, started_at=r.started_at,
                finished_at=r.finished_at, step_ends=list(r.step_ends),
                trajectories=r.finish_events, tokens=sum(s.tokens for s in shards),
                prefill_tokens=r.prefill_tokens, preempted_turns=r.preempted_turns,
                aborted_turns=r.aborted_turns, kept_tokens=r.kept_tokens,
                train_gpu_s=r.train_gpu_s, shard_busy_gpu_s=sum(s.busy_gpu_s for s in shards),
                decode_s=sum(s.decode_s for s in shards), seq_s=sum(s.seq_s for s in shards),
                whole_cluster=(r.domain.ledger.topology == whole and self.policy in
                               ("alone", "exclusive-queue")),
                traj_finish_times=[t.finished_at for batch in r.trajs for t in batch],
                train_waits=list(r.train_waits), expands=r.expands, turns=r.turns_dispatched,
                queue_turn_s=r.queue_area, arrived_at=r.setup.arrive_s, crashes=r.crashes,
                gpu_seconds=dict(sorted(r.domain.account.gpu_s.get(r.name, {}).items())),
                demand_gpu_s=gpu_work(r.setup, r.workload).total,
                longest_shardless_wait_s=r.shardless.longest, shardless_s=r.shardless.total)
        out.fill_shares()
        return out


# ---------------------------------------------------------------------- helpers
def sub_topology(topology: Topology, gpu_ids: list[int]) -> Topology:
    """The topology of a set of GPUs (ids sorted), keeping node boundaries."""
    node_of = topology.node_of()
    counts: dict[int, int] = {}
    for g in gpu_ids:
        counts[node_of[g]] = counts.get(node_of[g], 0) + 1
    return Topology(tuple(counts[n] for n in sorted(counts)))


def pick_gpus(topology: Topology, free: set[int], need: int) -> list[int] | None:
    """Node-aligned choice: one node if it fits (best fit), else the emptiest nodes first."""
    by_node = {n: [g for g in topology.node_gpus(n) if g in free] for n in range(topology.num_nodes)}
    fits = [(len(gs), n) for n, gs in by_node.items() if len(gs) >= need]
    if fits:
        return by_node[min(fits)[1]][:need]
    picked: list[int] = []
    for n in sorted(by_node, key=lambda n: (-len(by_node[n]), n)):
        picked += by_node[n][:need - len(picked)]
        if len(picked) == need:
            return sorted(picked)
    return None


def config_gpus(spec: PipelineSpec, total: int) -> int:
    """What a standalone job's config asks the cluster for."""
    shards = spec.max_shards * spec.tp
    need = max(spec.train_gpus, shards) if spec.partial_overlap else spec.train_gpus + shards
    return min(need, total)


def clip_spec(spec: PipelineSpec, topology: Topology, where: str, min_train_gpus: int = 1) -> PipelineSpec:
    """Fit a pipeline's spec into a smaller set of GPUs."""
    size = topology.num_gpus
    capacity = sum(n // spec.tp for n in topology.gpus_per_node)
    if capacity == 0:
        raise ScenarioError(f"{where}.tp: a shard of tp={spec.tp} does not fit the pipeline's "
                            f"slice of {size} GPUs {topology.gpus_per_node} under exclusive-partition")
    train = min(spec.train_gpus, size)
    if not spec.partial_overlap:
        train = min(train, size - spec.tp)
        if train < 1:
            raise ScenarioError(f"{where}.train_gpus: no room to train beside a shard in a slice of "
                                f"{size} GPUs without partial_overlap (exclusive-partition)")
    if train < min_train_gpus:
        raise ScenarioError(f"{where}.min_train_gpus: its train step needs {min_train_gpus} GPUs; "
                            f"a slice of {size} leaves it {train}")
    max_shards = min(spec.max_shards, capacity)
    return dataclasses.replace(spec, train_gpus=train, max_shards=max_shards,
                               min_shards=min(spec.min_shards, max_shards))


# ---------------------------------------------------------------------- policies
def run_rlix(sim: _Sim) -> None:
    domain = sim.domain(sim.scenario.topology, list(range(sim.scenario.gpus)))
    for setup in sim.scenario.pipelines:
        sim.launch(domain, setup, setup.spec)


def applicable(scenario: Scenario, policy: str) -> NotApplicable | None:
    """Why `policy` cannot run `scenario` at all, or None. Checked before any simulation so
    one inapplicable policy does not abort the others."""
    if policy == "exclusive-partition":
        total, count = scenario.gpus, len(scenario.pipelines)
        if count > total:
            return NotApplicable(policy, f"{count} pipelines cannot each get one of the {total} GPUs")
        try:
            partition(scenario)
        except ScenarioError as exc:
            return NotApplicable(policy, str(exc).removeprefix(f"{scenario.source}: "))
    if policy == "exclusive-queue":
        everything = set(range(scenario.gpus))
        for setup in scenario.pipelines:
            ids = pick_gpus(scenario.topology, everything, config_gpus(setup.spec, scenario.gpus))
            try:
                clip_spec(setup.spec, sub_topology(scenario.topology, ids), f"pipeline {setup.name}",
                          setup.min_train_gpus)
            except ScenarioError as exc:
                return NotApplicable(policy, str(exc))
    return None


def partition(scenario: Scenario) -> list[tuple[PipelineSetup, list[int], Topology, PipelineSpec]]:
    """Equal contiguous slices, one per pipeline, each spec clipped to its slice."""
    total, count = scenario.gpus, len(scenario.pipelines)
    if count > total:
        raise ScenarioError(f"{scenario.source}: pipelines: {count} pipelines cannot each get a GPU "
                            f"of the {total} under exclusive-partition")
    out = []
    offset = 0
    for setup in scenario.pipelines:
        size = total // count + (1 if setup.index < total % count else 0)
        ids = list(range(offset, offset + size))
        offset += size
        topo = sub_topology(scenario.topology, ids)
        spec = clip_spec(setup.spec, topo, f"{scenario.source}: pipeline {setup.name}",
                         setup.min_train_gpus)
        out.append((setup, ids, topo, spec))
    return out


def run_partition(sim: _Sim) -> None:
    for setup, ids, topo, spec in partition(sim.scenario):
        sim.launch(sim.domain(topo, ids), setup, spec)


def run_queue(sim: _Sim) -> None:
    scenario = sim.scenario
    free = set(range(scenario.gpus))
    waiting = deque(p for p in scenario.pipelines if p.arrive_s <= 0)  # FIFO by arrival
    later = [p for p in scenario.pipelines if p.arrive_s > 0]

    def admit() -> None:
        while waiting:
            setup = waiting[0]
            ids = pick_gpus(scenario.topology, free, config_gpus(setup.spec, scenario.gpus))
            if ids is None:
                return
            waiting.popleft()
            free.difference_update(ids)
            topo = sub_topology(scenario.topology, ids)
            spec = clip_spec(setup.spec, topo, f"{scenario.source}: pipeline {setup.name}",
                         setup.min_train_gpus)
            sim.launch(sim.domain(topo, ids, on_finish=done), setup, spec)

    def done(run: PipelineRun) -> None:
        # each job is its own run: its GPUs are free once its process has exited
        if scenario.run.teardown_s > 0:
            sim.clock.at(sim.clock.now + scenario.run.teardown_s, exited, run)
        else:
            exited(run)

    def exited(run: PipelineRun) -> None:
        free.update(run.domain.gpu_ids)
        admit()

    def arrive(setup: PipelineSetup) -> None:
        waiting.append(setup)
        admit()

    for setup in sorted(later, key=lambda p: (p.arrive_s, p.index)):
        sim.clock.at(setup.arrive_s, arrive, setup)
    admit()


def simulate(scenario: Scenario, workloads: dict[str, Workload], policy: str,
             only: str | None = None, on_step=None, trace: SimTrace | None = None) -> RunResult:
    """Run one policy (or `alone` with `only` = a pipeline name) to the end; `trace` records
    it for its timeline."""
    sim = _Sim(scenario, workloads, policy, on_step, trace)
    if policy == "rlix":
        run_rlix(sim)
    elif policy == "exclusive-partition":
        run_partition(sim)
    elif policy == "exclusive-queue":
        run_queue(sim)
    elif policy == "alone":
        setup = next(p for p in scenario.pipelines if p.name == only)
        domain = sim.domain(scenario.topology, list(range(scenario.gpus)))
        sim.launch(domain, setup, setup.spec)
    else:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES} or 'alone'")
    return sim.finish()
