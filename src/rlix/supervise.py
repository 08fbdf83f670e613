"""The pipelines of one `rlix run`, watched: each is started, followed, and when it fails
(an error, its actor's process dead, no answer within the heartbeat) ended alone.

Ending a failed pipeline: its checkpoint is saved if its trainer lives, its actor is stopped
(or killed), the scheduler drops it at once (its GPUs go back to the pool), shared memory left
by its dead processes is reaped on every node, and with `restart: on_failure` it starts again
from its last checkpoint. Its shard servers end with their owner whatever happens to it (they
run under rlix.procguard); its trainer actor is owned by its pipeline actor, so Ray ends it too.
The other pipelines never notice.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from types import FrameType
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from pydantic import ValidationError

from rlix.config.models import LoggingConfig, PipelineConfig
from rlix.errors import PipelineHungError, SchedulerError, format_validation_error, one_line
from rlix.inference.fleet.startup import ShardStartup, StartupReporter
from rlix.pipeline.actor import PipelineActor
from rlix.pipeline.device_plan import DevicePlan
from rlix.pipeline.reporting.metrics_file import read_metrics
from rlix.pipeline.reporting.samples import console_lines
from rlix.placement import on_this_node
from rlix.private_files import write_private
from rlix.run_summary import Failure, PipelineSummary
from rlix.scheduler.core import gpu_roles

#: how long a live pipeline may take to stop (checkpoint, leave, processes ended)
STOP_TIMEOUT_S = 120.0
#: how long a finished or failed pipeline may take to hand over its summary
SUMMARY_TIMEOUT_S = 15.0
#: how often the run checks that the nodes holding its GPUs are still in the cluster
NODE_WATCH_S = 2.0


@dataclass
class PipelineSlot:
    """One pipeline across its restarts, as the supervisor sees it."""

    cfg: PipelineConfig
    actor: Any = None
    state: str = "new"  # new | setup | running | done | failed
    setup_ref: Any = None
    run_ref: Any = None
    progress_ref: Any = None
    progress_sent: float = 0.0
    last_progress: dict = field(default_factory=dict)
    restarts: int = 0
    failures: list[dict] = field(default_factory=list)  # every failure: reason, step, what followed
    summary: PipelineSummary | None = None
    seen_step: int | None = None  # the last step whose line was printed (across restarts)
    seen_deaths: int = 0
    started: float = 0.0  # monotonic time of the current incarnation's start
    startup: StartupReporter | None = None  # lines about its shard servers starting
    answered: bool = False  # its actor answered a heartbeat: it is up (the heartbeat applies)

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def live(self) -> bool:
        return self.state in ("setup", "running")


class Supervisor:
    """See module doc. `say` prints a line to the run's log; `on_step(pipeline, step, steps,
    reward)` is told of each finished step (the run's progress bars)."""

    def __init__(self, pipelines: list[PipelineConfig], *, mode: str, run_dir: Path, api_key: str,
                 devices: DevicePlan, scheduler: Any, say: Callable[[str], None],
                 heartbeat_timeout_s: float, setup_timeout_s: float, all_gpus: list[int],
                 resume: bool = False, vllm_python: str | None = None, role_log_from: int = 0,
                 experiment_log: LoggingConfig | None = None,
                 on_step: Callable[[str, int, int, float | None], None] | None = None) -> None:
        self.on_step = on_step
        self.slots = {p.name: PipelineSlot(p) for p in pipelines}
        self.experiment_log = experiment_log  # the run's `logging:`, for every pipeline
        self.vllm_python = vllm_python
        self.mode, self.run_dir, self.api_key, self.devices = mode, run_dir, api_key, devices
        self.scheduler, self.say = scheduler, say
        self.heartbeat_timeout_s, self.setup_timeout_s = heartbeat_timeout_s, setup_timeout_s
        self.all_gpus, self.resume = all_gpus, resume
        self.role_changes: list[dict] = []
        self.gpu_seconds: dict[str, float] = {}
        self.ledger_audits: list[dict] = []
        self._seen_change = role_log_from  # a shared scheduler's earlier changes are not this run's
        self._seen_restarts: int | None = None  # of the scheduler's actor (Ray restarts it)
        self.lost_nodes: list[dict] = []  # nodes that left the cluster mid-run, with what they took
        self._nodes_checked = 0.0
        self._last_poll = time.perf_counter()
        self._processes: dict[str, dict] = {}
        self._trainers: set[int] = set()  # every trainer PID reported in this run

    # ------------------------------------------------------------------ starting
    def start_all(self) -> None:
        for slot in self.slots.values():
            self._start(slot, self.resume)

    def _start(self, slot: PipelineSlot, resume: bool) -> None:
        gpus = slot.cfg.gpus if slot.cfg.gpus is not None else self.all_gpus
        # an external pipeline's program finds its actor by name (a new one per start: the
        # actor of a start before may not be gone yet)
        name = f"rlix-pipeline-{slot.cfg.name}-{uuid.uuid4().hex[:12]}" if slot.cfg.external is not None else None
        cfg = slot.cfg
        if cfg.external is not None and cfg.external.cwd is None:  # where `rlix run` runs, not the actor's
            cfg = cfg.model_copy(update={"external": cfg.external.model_copy(update={"cwd": os.getcwd()})})
        slot.actor = PipelineActor.options(**on_this_node(), **({"name": name} if name else {})).remote(
            cfg.model_dump(), mode=self.mode, run_dir=str(self.run_dir), api_key=self.api_key, gpus=gpus,
            resume=resume, devices=self.devices, vllm_python=self.vllm_python,
            experiment_log=None if self.experiment_log is None else self.experiment_log.model_dump(),
            actor_name=name)
        slot.setup_ref, slot.run_ref, slot.progress_ref = slot.actor.setup.remote(), None, None
        slot.state, slot.summary = "setup", None
        slot.started = slot.progress_sent = time.monotonic()
        slot.seen_deaths, slot.answered = 0, False

    def wait_setup(self, check: Callable[[], None] = lambda: None) -> None:
        """Until every pipeline has set up or failed (the scheduler's first plan waits for this).
        `check()` runs every turn (it raises to stop: a Ctrl-C noted by InterruptFlag)."""
        while any(s.state == "setup" for s in self.slots.values()):
            check()
            self._poll_setup(timeout_s=0.25)
            self._poll_scheduler()  # a pipeline set up gets GPUs while others still set up
            self._poll_progress()
            self._check_heartbeats()

    # ------------------------------------------------------------------ following
    def drive(self, check: Callable[[], None] = lambda: None) -> None:
        """Until every pipeline is done or failed for good; `check()` runs every turn."""
        while any(s.live for s in self.slots.values()):
            check()
            self._poll_setup(timeout_s=0.0)
            self._poll_runs(timeout_s=0.25)
            self._poll_scheduler()
            self._poll_nodes()
            self._poll_progress()
            self._check_heartbeats()

    def _poll_nodes(self) -> None:
        """Every NODE_WATCH_S: a node holding rlix GPUs that left the Ray cluster takes them out
        of the ledger (the scheduler re-plans without them); what it took is said and kept."""
        reservation = self.devices.reservation
        now = time.monotonic()
        if reservation is None or not reservation.multi_node or now - self._nodes_checked < NODE_WATCH_S:
            return
        self._nodes_checked = now
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for node in reservation.node_ids:
            if node in alive or any(e["node_id"] == node for e in self.lost_nodes):
                continue
            gpus = reservation.gpus_on(node)
            event: dict[str, Any] = {"node_id": node, "gpus": gpus, "at": time.time()}
            if self.scheduler is not None:
                try:
                    lost = ray.get(self.scheduler.gpus_lost.remote(gpus, f"node {node[:12]} left the cluster"),
                                   timeout=30)
                    event.update(shards=[f"{m.pipeline}#{m.dp_rank}" for m in lost.shards],
                                 training=lost.training, homeless=lost.homeless)
                except Exception as exc:  # noqa: BLE001 - said, and the run goes on
                    event["error"] = one_line(exc)
            self.lost_nodes.append(event)
            self.say(f"node {node[:12]} left the cluster: GPUs {gpus} lost"
                     + (f"; shards dropped {event['shards']}" if event.get("shards") else "")
                     + (f"; pipelines whose trainer was there: {event['homeless']}" if event.get("homeless") else "")
                     + (f"; the scheduler was not told: {event['error']}" if event.get("error") else ""))

    def _poll_setup(self, timeout_s: float) -> None:
        setting_up = {s.setup_ref: s for s in self.slots.values() if s.state == "setup"}
        if not setting_up:
            return
        done, _ = ray.wait(list(setting_up), timeout=timeout_s, num_returns=len(setting_up))
        for ref in done:
            slot = setting_up[ref]
            try:
                info = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - its failure is its own
                self.fail(slot, one_line(exc))
                continue
            if info.get("resumed_from"):
                self.say(f"{slot.name}: --resume: resuming from {info['resumed_from']}"
                         if info["start_step"] else f"{slot.name}: --resume: {info['resumed_from']}")
            phases = info.get("phases_s") or {}
            parts = (f" (trainer {phases['trainer']}s and engines {phases['engines']}s side by side)"
                     if "trainer" in phases and "engines" in phases else "")
            self.say(f"{slot.name}: ready in {info['setup_s']}s{parts}, shards {info['shards']}, "
                     f"starting at step {info['start_step']}")
            # the steps up to the start were printed by an earlier start (or are not this run's):
            # a restart that trains some again prints only those past the last one printed
            slot.seen_step = max(slot.seen_step or 0, int(info["start_step"]))
            slot.state, slot.run_ref = "running", slot.actor.run.remote()
            slot.progress_sent, slot.progress_ref = time.monotonic(), None

    def _poll_runs(self, timeout_s: float) -> None:
        running = {s.run_ref: s for s in self.slots.values() if s.state == "running"}
        if not running:
            time.sleep(timeout_s)
            return
        done, _ = ray.wait(list(running), timeout=timeout_s, num_returns=len(running))
        for ref in done:
            slot = running[ref]
            try:
                summary = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - its failure is its own
                self.fail(slot, one_line(exc))
                continue
            self._catch_up(slot)  # the steps it finished since the last progress answer
            slot.summary = self._typed_summary(slot, summary)
            slot.state = "done"
            steps = slot.summary.steps
            self.say(f"{slot.name}: finished {steps} step(s)")
            if self.on_step is not None:
                self.on_step(slot.name, steps, max(steps, slot.cfg.steps), None)
            self._end(slot)

    def _poll_scheduler(self) -> None:
        now = time.perf_counter()
        if self.scheduler is None:
            self._last_poll = now
            return
        try:
            snap = ray.get(self.scheduler.snapshot.remote(), timeout=30)
            changes = ray.get(self.scheduler.role_changes.remote(self._seen_change), timeout=30)
        except (RayActorError, GetTimeoutError) as exc:
            raise SchedulerError(f"the scheduler stopped answering: {one_line(exc)}") from None
        restarts = snap.get("restarts", 0)
        if self._seen_restarts is not None and restarts > self._seen_restarts:
            self.say(f"the scheduler's worker died and Ray restarted it (restart {restarts}); it "
                     f"carried on from its saved state")
        self._seen_restarts = restarts
        for what in gpu_roles(snap).values():
            name = what.split("/", 1)[0]
            self.gpu_seconds[name] = self.gpu_seconds.get(name, 0.0) + now - self._last_poll
        self._last_poll = now
        # the scheduler's clock is monotonic; the step records are wall-clock
        to_wall = time.time() - snap["now"]
        for change in changes:
            self.say(f"gpu {change['gpu']}: {change['before']} -> {change['after']}")
            self._seen_change = change["seq"]
            self.role_changes.append(dict(change, at=change["at"] + to_wall))

    def _poll_progress(self) -> None:
        """One progress call in flight per pipeline: its answer is the heartbeat."""
        for slot in self.slots.values():
            if not slot.live:
                continue
            if slot.progress_ref is None:
                slot.progress_ref, slot.progress_sent = slot.actor.progress.remote(slot.seen_step), time.monotonic()
                continue
            done, _ = ray.wait([slot.progress_ref], timeout=0)
            if not done:
                continue
            try:
                prog = ray.get(slot.progress_ref)
            except Exception:  # noqa: BLE001 - a dead actor: its run call says why
                slot.progress_ref = None
                continue
            slot.progress_ref, slot.answered = None, True
            slot.progress_sent = time.monotonic()
            slot.last_progress = prog
            self._show(slot, prog)

    def _catch_up(self, slot: PipelineSlot) -> None:
        """Print the steps a pipeline finished that no progress answer has shown yet (its last
        ones: the run ended between two polls), asked of its actor while it lives."""
        if slot.actor is None or slot.seen_step is None:
            return
        try:
            prog = ray.get(slot.actor.progress.remote(slot.seen_step), timeout=SUMMARY_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - dead or stuck: its metrics file has the steps
            return
        self._show_steps(slot, prog)

    def _show_steps(self, slot: PipelineSlot, prog: dict) -> None:
        """One line per step finished after the last one printed, in order, each once (an
        answer may repeat steps an earlier one showed: it was asked before that one came);
        the step's samples table under it when the answer carries one."""
        for row in prog.get("new_steps") or []:
            if slot.seen_step is not None and row["step"] <= slot.seen_step:
                continue
            slot.seen_step = row["step"]
            share = self.gpu_seconds.get(slot.name, 0.0)
            length = row.get("response_len_mean")
            self.say(f"{slot.name}: step {row['step']}/{prog['steps']} reward {row['reward']:.3f}"
                     + (f" len {length:.1f}" if length is not None else "")
                     + f" ({row['step_s']:.1f}s) active shards {prog['active_shards']} gpu-s {share:.0f}")
            if row.get("samples"):
                for line in console_lines(row["samples"]):
                    self.say(f"  {line}")
            if self.on_step is not None:
                self.on_step(slot.name, row["step"], prog["steps"], row["reward"])

    def _show(self, slot: PipelineSlot, prog: dict) -> None:
        self._show_startup(slot, prog)
        self._show_steps(slot, prog)
        if prog.get("shard_deaths", 0) > slot.seen_deaths:
            slot.seen_deaths = prog["shard_deaths"]
            replaced = prog.get("shard_replacements") or []
            tail = (f"; replaced shard {replaced[-1]['rank']} in {replaced[-1]['seconds']} s"
                    if replaced else "")
            self.say(f"{slot.name}: {slot.seen_deaths} shard process(es) died so far{tail}")
        if prog.get("processes") and prog["processes"] != self._processes.get(slot.name):
            self._processes[slot.name] = prog["processes"]
            if prog["processes"].get("trainer"):
                self._trainers.add(int(prog["processes"]["trainer"]))
            self._write_processes()

    def _show_startup(self, slot: PipelineSlot, prog: dict) -> None:
        """Lines about its shard servers while they start (a vLLM server takes a minute or more)."""
        snapshots = prog.get("shard_startup") or []
        if not snapshots:
            return
        if slot.startup is None:
            slot.startup = StartupReporter(self.say, slot.name, what=f"{slot.cfg.engine} server")
        slot.startup.update([ShardStartup.from_dict(d) for d in snapshots])

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for slot in self.slots.values():
            if not slot.live:
                continue
            if slot.state == "setup" and now - slot.started > self.setup_timeout_s:
                self.fail(slot, one_line(PipelineHungError(
                    f"not set up within setup_timeout_s ({self.setup_timeout_s:g} s)")), hung=True)
            elif slot.answered and slot.progress_ref is not None \
                    and now - slot.progress_sent > self.heartbeat_timeout_s:
                self.fail(slot, one_line(PipelineHungError(
                    f"its actor did not answer within the heartbeat timeout "
                    f"({self.heartbeat_timeout_s:g} s)")), hung=True)

    def _write_processes(self) -> None:
        """RUN_DIR/processes.json: every live process of the run by PID (what an operator, or
        a fault test, looks for)."""
        # mode 0600: it holds the addresses of the run's servers
        write_private(self.run_dir / "processes.json", json.dumps(self._processes, indent=1))

    # ------------------------------------------------------------------ ending
    def fail(self, slot: PipelineSlot, reason: str, hung: bool = False) -> None:
        """End one pipeline alone; restart it if its config says so."""
        step = slot.last_progress.get("step")
        self.say(f"{slot.name}: failed: {reason}")
        slot.state = "failed"
        slot.failures.append({"reason": reason, "at": time.time(), "step": step})
        self._end(slot, hung=hung, reason=reason)
        audit = self.audit_ledger(f"{slot.name} failed")
        if audit is not None and not audit["ok"]:
            self.say(f"scheduler ledger after {slot.name} failed: {audit['error']}")
        if slot.cfg.restart == "on_failure" and slot.restarts < slot.cfg.max_restarts:
            slot.restarts += 1
            slot.failures[-1]["then"] = f"restart {slot.restarts} of {slot.cfg.max_restarts}"
            self.say(f"{slot.name}: restarting from its last checkpoint "
                     f"(restart {slot.restarts} of {slot.cfg.max_restarts})")
            self._start(slot, resume=True)
        elif slot.cfg.restart == "on_failure":
            slot.failures[-1]["then"] = f"no restart left ({slot.cfg.max_restarts} used)"

    def _end(self, slot: PipelineSlot, hung: bool = False, reason: str = "",
             stopping: ray.ObjectRef | None = None) -> None:
        """Stop a pipeline's actor and everything it started; its GPUs back to the pool.
        `stopping`: its shutdown, asked already (stop_all asks every pipeline at once)."""
        actor = slot.actor
        if actor is None:
            return
        if not hung:
            try:
                took = ray.get(stopping or actor.shutdown.remote(), timeout=STOP_TIMEOUT_S)
                if took.get("checkpoint") is not None:
                    self.say(f"{slot.name}: checkpoint saved on the way out ({took['checkpoint']} s)")
                slow = {k: v for k, v in took.items() if v > 2 and k != "checkpoint"}
                if slow:
                    self.say(f"{slot.name}: slow shutdown {slow}")
            except RayActorError:
                pass  # dead already: its shards end with it (procguard), Ray ends its trainer
            except Exception as exc:  # noqa: BLE001 - killed below whatever happened
                self.say(f"{slot.name}: shutdown failed: {one_line(exc)}")
        if not hung:  # the steps finished on the way out (a checkpoint's step cut short) too
            self._catch_up(slot)
        if slot.summary is None:  # after the shutdown: the steps finished on the way out count
            slot.summary = self._fetch_summary(slot, alive=not hung)
        ray.kill(actor)
        slot.actor = None
        if self.scheduler is not None and slot.state == "failed":
            try:  # at once: the liveness check would take seconds, an unanswered one forever
                ray.get(self.scheduler.pipeline_failed.remote(slot.name, reason), timeout=30)
            except Exception as exc:  # noqa: BLE001
                self.say(f"{slot.name}: the scheduler did not take its failure: {one_line(exc)}")
        if slot.state == "failed":
            procs = self._processes.get(slot.name) or slot.last_progress.get("processes") or {}
            trainer = {procs["trainer_node"]: [procs["trainer"]]} if procs.get("trainer") else {}
            reaped = reap_shared_memory(trainer)
            if reaped:
                self.say(f"{slot.name}: removed {len(reaped)} shared-memory segment(s) of dead processes")
        self._processes.pop(slot.name, None)
        self._write_processes()

    def _fetch_summary(self, slot: PipelineSlot, alive: bool) -> PipelineSummary:
        if alive and slot.actor is not None:
            try:
                summary = ray.get(slot.actor.summary.remote(), timeout=SUMMARY_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - dead, or never set up: from its metrics file
                pass
            else:
                return self._typed_summary(slot, summary)
        return self._metrics_summary(slot)

    def _metrics_summary(self, slot: PipelineSlot) -> PipelineSummary:
        """What its metrics file says: the steps it finished and their rewards."""
        rows = read_metrics(self.run_dir / slot.name / "metrics.jsonl")
        return PipelineSummary(pipeline=slot.name, steps=len(rows), rewards=[r["reward"] for r in rows])

    def _typed_summary(self, slot: PipelineSlot, summary: dict) -> PipelineSummary:
        """The runner's summary as a PipelineSummary; one that does not fit the model (the two
        drifted apart) is said, naming the fields, and its metrics file's summary stands in."""
        try:
            return PipelineSummary.model_validate(summary)
        except ValidationError as exc:
            self.say(format_validation_error(f"{slot.name}: its summary is not a PipelineSummary", exc))
            return self._metrics_summary(slot)

    def trainer_pids(self) -> list[int]:
        """Every trainer PID (rank 0's) reported in this run, ended pipelines' too."""
        return sorted(self._trainers)

    def stop_all(self) -> None:
        """Ctrl-C or the run's own failure: every live pipeline is stopped (each saves a
        checkpoint on the way out)."""
        live = [slot for slot in self.slots.values() if slot.live and slot.actor is not None]
        # every shutdown asked first, so that the pipelines stop side by side: a run's stop takes
        # its slowest pipeline's time, not the sum (and stays within STOP_TIMEOUT_S)
        stopping = {slot.name: slot.actor.shutdown.remote() for slot in live}
        for slot in live:
            slot.state = "stopped"
            self._end(slot, stopping=stopping[slot.name])
        for slot in self.slots.values():
            if slot.live:  # no actor: never started
                slot.state = "stopped"

    def audit_ledger(self, after: str) -> dict | None:
        if self.scheduler is None:
            return None
        try:
            audit = ray.get(self.scheduler.audit.remote(), timeout=30)
        except Exception as exc:  # noqa: BLE001
            audit = {"ok": False, "error": one_line(exc)}
        audit["after"] = after
        self.ledger_audits.append(audit)
        return audit

    def summaries(self) -> dict[str, PipelineSummary]:
        """Each pipeline's summary (the runner's, or what is known of one that never gave it)
        with what the supervisor saw: its state, GPU-seconds, restarts and failures."""
        out = {}
        for name, slot in self.slots.items():
            ours: dict[str, Any] = {"gpu_seconds": round(self.gpu_seconds.get(name, 0.0), 1),
                                    "state": slot.state, "restarts": slot.restarts,
                                    "failures": [Failure.model_validate(f) for f in slot.failures]}
            if slot.state == "failed":
                ours["error"] = slot.failures[-1]["reason"]
            base = slot.summary or PipelineSummary(pipeline=name, steps=0, rewards=[])
            out[name] = base.model_copy(update=ours)
        return out


@ray.remote(num_cpus=0)
def _reap_node(wait_pids: list[int], wait_s: float) -> list[str]:
    """This node's orphaned weight-cache segments, once `wait_pids` have exited (a trainer that
    Ray is still killing keeps its segments until it is gone)."""
    from rlix.weights.wire import reap_orphaned_segments  # deferred: torch, on that node

    deadline = time.monotonic() + wait_s
    for pid in wait_pids:
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.05)
    return reap_orphaned_segments("rlix-w")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def reap_shared_memory(wait: dict[str, list[int]] | None = None, wait_s: float = 10.0) -> list[str]:
    """On every node: /dev/shm segments whose creating process is gone (a killed trainer's
    weight cache), after the processes in `wait` ({node id: PIDs}) have exited. Segments of
    live processes are never touched."""
    wait = wait or {}
    refs = [_reap_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            .remote(wait.get(n["NodeID"], []), wait_s)
            for n in ray.nodes() if n.get("Alive")]
    removed: list[str] = []
    for names in ray.get(refs, timeout=60):
        removed.extend(names)
    return removed


class InterruptFlag:
    """Ctrl-C noted, and raised where the driver polls, not wherever Python happens to be.

    Python raises KeyboardInterrupt at the next bytecode of the main thread, which may be inside a
    finaliser (an object's `__del__`, a weakref callback), where the exception is printed as
    "ignored" and lost: a run driven by a polling loop that makes garbage every turn then carries
    on as if nothing happened (seen once in CI: the SIGINT sent after a few steps, the run went on
    to its last step and exited 0). `InterruptFlag` replaces the handler for its block: the first
    SIGINT only sets a flag, which the loop's `check()` turns into KeyboardInterrupt at a point of
    its choosing; a second SIGINT raises at once (a user pressing Ctrl-C twice wants out).
    """

    def __init__(self) -> None:
        self.count = 0
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            self._previous = signal.signal(signal.SIGINT, self._note)
            self._installed = True

    def restore(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def __enter__(self) -> InterruptFlag:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C came (the caller's loop calls this every turn)."""
        if self.count:
            raise KeyboardInterrupt
