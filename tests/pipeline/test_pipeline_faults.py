"""Faults caused on purpose during a two-pipeline `rlix run` (CPU, 2 fake GPUs): a shard server,
a trainer actor's worker and a pipeline actor's worker of pipeline pb are SIGKILLed by PID.

Each time pa trains every step; nothing of the dead part is left (process, port, /dev/shm
segment); the scheduler's ledger holds its invariants afterwards; and pb either goes on (a
killed shard is replaced), resumes from its checkpoint (restart: on_failure), or is reported
failed with its reason and its summary written.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import ray
import yaml

from rlix.pipeline import checkpoints
from rlix.run import run

PA_STEPS, PB_STEPS, KILL_AT_STEP = 8, 8, 3


def fault_config(tmp_path: Path, **pb: object) -> str:
    pipe = {"model": "tiny", "train_gpus": 1, "min_shards": 1, "max_shards": 2, "max_staleness": 1,
            "checkpoint_every": 2, "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 4, "group_size": 4, "max_new_tokens": 8, "concurrency": 4}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 2}, "scheduler": {"dwell_s": 0.2, "aging_s": 5},
           "control_plane": "rlix", "run_dir": str(tmp_path / "run"),
           "pipelines": [{**pipe, "name": "pa", "seed": 1, "steps": PA_STEPS},
                         {**pipe, "name": "pb", "seed": 2, "steps": PB_STEPS, **pb}]}
    path = tmp_path / "faults.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


class Killer(threading.Thread):
    """Once pb has trained KILL_AT_STEP steps, SIGKILL the PID `pick(pb's processes)` names."""

    def __init__(self, run_dir: Path, pick, sig: int = signal.SIGKILL) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.pick, self.sig = run_dir, pick, sig
        self.killed: int | None = None
        self.at = 0.0
        self.processes: dict = {}

    def run(self) -> None:
        deadline = time.monotonic() + 300
        metrics, procs = self.run_dir / "pb" / "metrics.jsonl", self.run_dir / "processes.json"
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                steps = len(metrics.read_text().splitlines())
                pb = json.loads(procs.read_text()).get("pb")
            except (OSError, ValueError):
                continue
            if steps < KILL_AT_STEP or not pb:
                continue
            pid = self.pick(pb)
            if pid is None:
                continue
            self.processes, self.at = pb, time.time()
            os.kill(pid, self.sig)
            self.killed = pid
            return


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def port_free(url: str) -> bool:
    """Nothing listens there any more (SO_REUSEADDR: a killed server's closed connections may
    linger in TIME_WAIT; that is not a process holding the port)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", int(url.rsplit(":", 1)[1])))
        except OSError:
            return False
    return True


def shm_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"rlix-w-{pid}-")]


def run_with_fault(tmp_path: Path, pick, sig: int = signal.SIGKILL, heartbeat_timeout_s: float = 60,
                   **pb: object) -> tuple[dict, Killer]:
    path = fault_config(tmp_path, **pb)
    cfg = yaml.safe_load(open(path))
    cfg["heartbeat_timeout_s"] = heartbeat_timeout_s
    Path(path).write_text(yaml.safe_dump(cfg))
    killer = Killer(tmp_path / "run", pick, sig)
    killer.start()
    summary = run(path)
    killer.join(5)
    assert killer.killed is not None, "the fault was never injected"
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["pipelines"].keys() == {"pa", "pb"}
    pa = summary["pipelines"]["pa"]
    assert pa["steps"] == PA_STEPS and pa["state"] == "done" and not pa["failures"]  # untouched
    audits = summary["ledger_audits"]  # after each failure and at the end of the run
    assert audits and all(a["ok"] for a in audits), audits
    assert audits[-1]["after"] == "end of run" and audits[-1]["holders"] == []
    return summary, killer


def test_killed_shard_server_is_replaced_and_its_pipeline_goes_on(tmp_path, fresh_ray):
    def active_shard(procs: dict) -> int | None:
        """An active shard's server if there is one now, else any shard's (a sleeping shard's
        death is a fault too: it is started again when next given GPUs)."""
        known = [r for r in procs["shards"] if r in procs["shard_urls"]]  # not mid-start
        active = [str(r) for r in procs.get("active_shards", []) if str(r) in known]
        pick = active or known
        return procs["shards"][pick[0]] if pick else None

    summary, killer = run_with_fault(tmp_path, active_shard)
    pb = summary["pipelines"]["pb"]
    assert pb["state"] == "done" and pb["steps"] == PB_STEPS and pb["restarts"] == 0, (pb["state"], pb["steps"], pb.get("failures"))
    killed_rank = next(r for r, p in killer.processes["shards"].items() if p == killer.killed)
    rank = int(killed_rank)
    later = [e for e in pb["events"] if rank in e[2] and e[0] > killer.at]
    again = [e for e in later if e[1] in ("replace", "start")]
    served = [e for e in later if e[1] in ("wake", "activate")]
    guard = killer.processes["shard_guards"][killed_rank]
    deaths = pb["shard_deaths"]
    assert all(d["pid"] == guard for d in deaths), deaths  # no other death
    died = [e[0] for e in later if e[1] == "died"]
    if died:
        assert died[0] - killer.at < 10, later  # the death was seen soon
        # a wake or activation already under way at the kill can finish before the death is
        # seen (it names the old process); what counts is what the rank did after that
        served = [e for e in served if e[0] > died[0]]
    if served:
        # the rank served again: a new process (replaced where it was, or started where it was
        # next given GPUs) came before it did
        assert again and again[0][0] <= served[0][0], later
    else:
        # never given GPUs again before pb finished (the other pipeline held them): nothing to
        # replace; if the death was seen, it was forgotten because it held no GPU
        assert again or all(d.get("then", "").startswith("forgotten") for d in deaths), (later, deaths)
    assert pb["version_mismatches"] == []
    assert gone(killer.killed)
    assert port_free(killer.processes["shard_urls"][killed_rank])


@pytest.mark.slow  # ~70 s on the 2-core CI machine: runs in CI's slow step
def test_killed_trainer_fails_its_pipeline_which_resumes_from_its_checkpoint(tmp_path, fresh_ray):
    summary, killer = run_with_fault(tmp_path, lambda procs: procs.get("trainer"),
                                     restart="on_failure", max_restarts=1)
    pb = summary["pipelines"]["pb"]
    assert pb["restarts"] == 1 and pb["state"] == "done", pb.get("failures")
    assert "died" in pb["failures"][0]["reason"].lower() or "actor" in pb["failures"][0]["reason"]
    assert pb["steps"] == PB_STEPS and [r["step"] for r in _metrics(tmp_path)] == list(range(1, PB_STEPS + 1))
    assert pb["start_step"] >= 2  # resumed from a checkpoint, not from scratch
    assert gone(killer.killed) and shm_of(killer.killed) == []
    log = (tmp_path / "run" / "run.log").read_text()
    assert "pb: --resume: resuming from" in log and "restarting from its last checkpoint" in log


def test_killed_pipeline_actor_is_reported_failed_and_leaves_nothing(tmp_path, fresh_ray):
    summary, killer = run_with_fault(tmp_path, lambda procs: procs.get("pipeline"))
    pb = summary["pipelines"]["pb"]
    assert pb["state"] == "failed" and "\n" not in pb["error"] and pb["error"], pb
    assert KILL_AT_STEP <= pb["steps"] < PB_STEPS  # its summary, from its metrics
    procs = killer.processes
    for pid in [procs["pipeline"], procs["trainer"], *procs["shards"].values(), *procs["shard_guards"].values()]:
        assert gone(pid), f"pid {pid} of the dead pipeline is still alive"
    assert all(port_free(url) for url in procs["shard_urls"].values())
    assert shm_of(procs["trainer"]) == []
    after = next(a for a in summary["ledger_audits"] if a["after"] == "pb failed")
    assert after["ok"] and "pb" not in after["pipelines"] and "pb" not in after["holders"]
    # its GPUs went back to the pool within 10 s of the kill
    roles = {}
    for change in summary["role_changes"]:
        if change["at"] <= killer.at + 10:
            roles[change["gpu"]] = change["after"]
    assert not [g for g, what in roles.items() if what.startswith("pb/")], roles


def test_hung_pipeline_actor_is_failed_at_its_heartbeat_and_ended(tmp_path, fresh_ray):
    """SIGSTOP freezes pb's actor: no answer within the heartbeat, so it is failed as hung,
    killed, and its shards end with it."""
    summary, killer = run_with_fault(tmp_path, lambda procs: procs.get("pipeline"), sig=signal.SIGSTOP,
                                     heartbeat_timeout_s=4)
    pb = summary["pipelines"]["pb"]
    assert pb["state"] == "failed" and "PipelineHungError" in pb["error"] and "4 s" in pb["error"], pb
    procs = killer.processes
    for pid in [procs["pipeline"], *procs["shards"].values()]:
        assert gone(pid), f"pid {pid} of the hung pipeline is still alive"
    failed_at = pb["failures"][0]["at"]
    assert 4 <= failed_at - killer.at < 15


def _metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "pb" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # ~100 s on the 2-core CI machine: runs in CI's slow step
def test_ctrl_c_saves_checkpoints_and_summary_and_resume_says_where_it_starts(tmp_path):
    """Ctrl-C (SIGINT to the run's process group, as a terminal sends it) during `rlix run`:
    exit 130, every pipeline saved a checkpoint on the way out, summary.json says interrupted,
    no shard server is left. `--resume` then says what it resumes from (and, for a pipeline
    without a checkpoint, that there is none) and metrics.jsonl has each step once."""
    import subprocess
    import sys

    path = Path(fault_config(tmp_path, checkpoint_every=0))
    cfg = yaml.safe_load(path.read_text())
    for p in cfg["pipelines"]:
        p.update(steps=400, checkpoint_every=0)
    path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "rlix.cli", "run"]
    proc = subprocess.Popen([*cli, str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        deadline = time.monotonic() + 240
        def steps(name: str) -> int:
            metrics = run_dir / name / "metrics.jsonl"
            return len(metrics.read_text().splitlines()) if metrics.exists() else 0

        while time.monotonic() < deadline and not (steps("pa") >= 2 and steps("pb") >= 1):
            time.sleep(0.1)
        procs = json.loads((run_dir / "processes.json").read_text())
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and out.rstrip().endswith("rlix: interrupted"), out[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ending"] == "interrupted"
    saved = {}
    for name in ("pa", "pb"):
        newest = checkpoints.newest(run_dir / name / "checkpoint")
        assert newest is not None and newest.path.name == checkpoints.step_name(newest.step), name
        saved[name] = json.loads((newest.path / "trainer.json").read_text())["step"]
        assert saved[name] >= 1 and summary["pipelines"][name]["state"] == "stopped"
    for name, p in procs.items():
        assert all(gone(pid) for pid in p["shards"].values()), name

    # pb's checkpoint is removed: it must say it starts over; pa resumes where it stopped
    import shutil

    shutil.rmtree(run_dir / "pb" / "checkpoint")
    for p in cfg["pipelines"]:
        p["steps"] = saved["pa"] + 2 if p["name"] == "pa" else 2
    path.write_text(yaml.safe_dump(cfg))
    resumed = subprocess.run([*cli, str(path), "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"pa: --resume: resuming from {run_dir / 'pa' / 'checkpoint' / checkpoints.step_name(saved['pa'])} " \
        f"at step {saved['pa']}" in resumed.stdout
    assert f"pb: --resume: no checkpoint in {run_dir / 'pb' / 'checkpoint'}: starting at step 0" \
        in resumed.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "pa" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, saved["pa"] + 3))  # each step once: trimmed to the checkpoint


@pytest.mark.slow
def test_sigkilled_scheduler_is_restarted_and_both_pipelines_finish_every_step(tmp_path, fresh_ray):
    """The scheduler's worker is SIGKILLed mid-run: Ray restarts the actor, it carries on from
    its saved state, and neither pipeline notices beyond a pause: every step of both is trained
    once, the ledger passes its audits, and the GPU role log read by the run has no gap."""
    from rlix.scheduler.service import get_scheduler

    path = fault_config(tmp_path)
    killer = Killer(tmp_path / "run", lambda procs: ray.get(get_scheduler().pid.remote(), timeout=30))
    killer.start()
    summary = run(path)
    killer.join(5)
    assert killer.killed is not None, "the fault was never injected"
    for name, steps in (("pa", PA_STEPS), ("pb", PB_STEPS)):
        s = summary["pipelines"][name]
        assert s["state"] == "done" and s["steps"] == steps and not s["failures"], (name, s.get("failures"))
        rows = [json.loads(line) for line in (tmp_path / "run" / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), name  # each step once
    audits = summary["ledger_audits"]
    assert audits and all(a["ok"] for a in audits), audits
    assert audits[-1]["after"] == "end of run" and audits[-1]["restarts"] == 1
    changes = summary["role_changes"]
    seqs = [c["seq"] for c in changes]
    assert seqs == list(range(1, len(seqs) + 1)), seqs  # no gap, no repeat across the restart
    roles: dict[int, str] = {}
    for c in changes:  # each change follows on from its GPU's previous role: one holder at a time
        assert c["before"] == roles.get(c["gpu"], "idle"), c
        roles[c["gpu"]] = c["after"]
    assert any(c["at"] > killer.at for c in changes), "no GPU moved after the restart"
    assert gone(killer.killed)
    log = (tmp_path / "run" / "run.log").read_text()
    assert "failed" not in log and "Ray restarted it (restart 1)" in log, log[-3000:]


@pytest.mark.slow  # a whole two-pipeline run with a restart: CI's slow step
def test_a_killed_fsdp_rank_fails_its_pipeline_which_resumes_from_its_sharded_checkpoint(tmp_path, fresh_ray):
    """pb trains with FSDP2 over 2 ranks; its rank 1 is SIGKILLed by PID after a few steps: the
    pipeline notices (every rank is pinged), fails, ends its other rank and resumes from its
    torch.distributed.checkpoint on 2 new ranks; pa never notices."""
    def rank_1(procs: dict) -> int | None:
        ranks = procs.get("trainer_ranks") or []
        return ranks[1] if len(ranks) > 1 else None

    summary, killer = run_with_fault(tmp_path, rank_1, restart="on_failure", max_restarts=1, train_gpus=2,
                                     train={"fsdp": True})
    pb = summary["pipelines"]["pb"]
    assert pb["restarts"] == 1 and pb["state"] == "done", pb.get("failures")
    assert pb["steps"] == PB_STEPS and [r["step"] for r in _metrics(tmp_path)] == list(range(1, PB_STEPS + 1))
    assert pb["start_step"] >= 2  # resumed from a checkpoint, not from scratch
    assert pb["checksum_mismatches"] == [] and pb["version_mismatches"] == []
    assert gone(killer.killed) and all(gone(pid) for pid in killer.processes["trainer_ranks"])
    assert shm_of(killer.processes["trainer_ranks"][0]) == []  # rank 0's cache went with it
