"""How fast a two-pipeline `rlix run` (CPU, 2 fake GPUs, tiny model) recovers from a SIGKILL.

Pipeline pb loses, once pb has trained 3 steps, in three runs:
  shard     an active shard server  -> `shard_replace_s`: kill to the new process serving
                                       (detected, started, synced to the latest version, active)
  trainer   its trainer actor's worker (restart: on_failure)
                                    -> `trainer_failed_s`: kill to pb reported failed;
                                       `trainer_resumed_step_s`: kill to pb's first step after its
                                       restart from the checkpoint
  pipeline  its pipeline actor's worker (no restart)
                                    -> `pipeline_failed_s`: kill to pb reported failed;
                                       `gpus_back_s`: kill to no GPU held by pb in the ledger
                                       (goal <= 10 s: `gpus_back_vs_goal` = gpus_back_s / 10);
                                       `processes_gone_s`: kill to every process of pb gone
In every run pa must train all its steps (`other_pipeline_complete` counts the runs where it did).

    .venv/bin/python bench/faults.py [--rounds N]
Ends by printing one JSON line of the figures (medians over rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench  # noqa: E402

STEPS, KILL_AT = 8, 3


def config(workdir: Path, **pb: object) -> Path:
    pipe = {"model": "tiny", "min_shards": 1, "max_shards": 2, "checkpoint_every": 2,
            "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 4, "group_size": 4, "max_new_tokens": 8, "concurrency": 4}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 2}, "scheduler": {"dwell_s": 0.2, "aging_s": 5},
           "run_dir": str(workdir / "run"),
           "pipelines": [{**pipe, "name": "pa", "seed": 1, "steps": STEPS},
                         {**pipe, "name": "pb", "seed": 2, "steps": STEPS, **pb}]}
    path = workdir / "faults.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Killer(threading.Thread):
    """SIGKILLs pb's process `pick(processes)` once pb has KILL_AT steps, then times how long its
    processes take to go."""

    def __init__(self, run_dir: Path, pick) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.pick = run_dir, pick
        self.at = 0.0
        self.procs: dict = {}
        self.all_gone_s: float | None = None

    def run(self) -> None:
        metrics, procs = self.run_dir / "pb" / "metrics.jsonl", self.run_dir / "processes.json"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                pb = json.loads(procs.read_text()).get("pb")
                steps = len(metrics.read_text().splitlines())
            except (OSError, ValueError):
                continue
            pid = self.pick(pb) if pb and steps >= KILL_AT else None
            if pid is None:
                continue
            self.procs, self.at = pb, time.time()
            os.kill(pid, signal.SIGKILL)
            break
        watched = [pb.get("pipeline"), pb.get("trainer"), *pb.get("shards", {}).values()] if self.procs else []
        while self.procs and time.monotonic() < deadline and any(running(p) for p in watched if p):
            time.sleep(0.05)
        self.all_gone_s = time.time() - self.at if self.procs else None


def one(kind: str, workdir: Path) -> dict:
    from rlix.run import run

    picks = {
        "shard": lambda p: next((p["shards"][str(r)] for r in p.get("active_shards", [])
                                 if str(r) in p["shards"]), None),
        "trainer": lambda p: p.get("trainer"),
        "pipeline": lambda p: p.get("pipeline"),
    }
    path = config(workdir, **({"restart": "on_failure", "max_restarts": 1} if kind == "trainer" else {}))
    killer = Killer(workdir / "run", picks[kind])
    killer.start()
    summary = run(str(path), out=sys.stderr)
    killer.join(30)
    pa, pb = summary["pipelines"]["pa"], summary["pipelines"]["pb"]
    out: dict = {"other_pipeline_complete": int(pa["steps"] == STEPS and pa["state"] == "done")}
    if kind == "shard":
        out["shard_replace_s"] = pb["shard_replacements"][0]["at"] - killer.at
    elif kind == "trainer":
        out["trainer_failed_s"] = pb["failures"][0]["at"] - killer.at
        rows = [json.loads(x) for x in (workdir / "run" / "pb" / "metrics.jsonl").read_text().splitlines()]
        out["trainer_resumed_step_s"] = min(r["finished_at"] for r in rows if r["finished_at"] > killer.at) - killer.at
    else:
        out["pipeline_failed_s"] = pb["failures"][0]["at"] - killer.at
        held = {}
        back = None
        for change in summary["role_changes"]:
            held[change["gpu"]] = change["after"]
            if change["at"] >= killer.at and back is None and not any(w.startswith("pb/") for w in held.values()):
                back = change["at"] - killer.at
        out["gpus_back_s"] = back
        out["processes_gone_s"] = killer.all_gone_s
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    import ray

    samples: dict[str, list[float]] = {}
    kinds = ("shard", "trainer", "pipeline")
    with Bench("faults", total=len(kinds) * args.rounds) as bench:
        for r in range(args.rounds):
            for kind in kinds:
                bench.phase(f"round {r + 1}: kill the {kind}")
                with bench.aside(), tempfile.TemporaryDirectory(prefix=f"rlix-faults-{kind}-") as d:
                    figures = one(kind, Path(d))  # the run draws its own bars
                    ray.shutdown()
                bench.log(f"round {r + 1} {kind}: {figures}")
                bench.advance()
                for k, v in figures.items():
                    if v is not None:
                        samples.setdefault(k, []).append(float(v))
    result = {k: round(statistics.median(v), 2) for k, v in samples.items()}
    result["other_pipeline_complete"] = sum(samples["other_pipeline_complete"])
    result["runs"] = 3 * args.rounds
    if "gpus_back_s" in result:
        result["gpus_back_vs_goal"] = round(result["gpus_back_s"] / 10.0, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
