"""`rlix run` with agent environments (CPU, 2 fake GPUs): multi-turn episodes over HTTP.

1. examples/agentic_two_pipelines.yaml, both pipelines recording their rollouts: rewards rise;
   every training sample holds >= 3 sampled turns, and each sampled span is exactly what the
   shards' engines recorded sampling (ids and logprobs) right after exactly the tokens before
   it (a preempted turn: its aborted part, then the re-dispatched rest), with the loss mask
   covering those spans and nothing else.
2. A resources server SIGKILLed by its PID mid-run: the supervisor restarts it, the episodes it
   broke are retried or counted with a reason, both pipelines finish every step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from rlix.inference.server.generation_log import read_generations
from rlix.run import run

pytestmark = pytest.mark.slow  # whole runs: ~4 and ~2 min on 2 cores (CI's slow step)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agentic_two_pipelines.yaml"


def example(tmp_path: Path, steps: int, **env: object) -> tuple[str, dict]:
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["run_dir"] = str(tmp_path / "run")
    for p in cfg["pipelines"]:
        p["steps"] = steps
        p["record_rollouts"] = True
        p["env"] = {**p["env"], "tool_latency_s": 0.05, **env}
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path), cfg


def engine_sampled(records: dict[tuple, list], prefix: list[int], ids: list[int], lps: list[float]) -> bool:
    """`ids` (with `lps`) is what the engines sampled right after exactly `prefix`: one record,
    or a chain of them when a preempted request was re-dispatched (its first part recorded as
    aborted, the rest generated from the prompt plus that part)."""
    if not ids:
        return True
    for got, got_lps in records.get(tuple(prefix), []):
        n = len(got)
        if n and got == ids[:n] and got_lps == pytest.approx(lps[:n], abs=1e-6) and \
                engine_sampled(records, prefix + got, ids[n:], lps[n:]):
            return True
    return False


def sampled_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for j, m in enumerate([*mask, 0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            spans.append((start, j))
            start = None
    return spans


def test_two_agentic_pipelines_learn_on_the_engines_exact_tokens(tmp_path, fresh_ray):
    path, cfg = example(tmp_path, steps=20)
    summary = run(path, mode=None)
    for spec in cfg["pipelines"]:
        name = spec["name"]
        p = summary["pipelines"][name]
        assert p["state"] == "done" and p["steps"] == 20, (name, p.get("error"))
        assert p["reward_last5"] > p["reward_first5"], (name, p["rewards"])
        acc = p["accounting"]
        assert acc["started"] == acc["trained"] + sum(acc["dropped"].values()) + acc["buffered"]
        assert set(acc["dropped"]) <= {"stale", "shutdown", "unused at shutdown"}, acc["dropped"]
        # 3 turns per episode, the first two answered by the check tool
        assert p["collector"]["tool_calls"] * 3 >= p["collector"]["episode_turns"] * 2 > 0
        # the engines' own records, keyed by the exact prompt they were given
        sampled: dict[tuple, list] = {}
        for g in read_generations(tmp_path / "run" / name / "generations"):
            sampled.setdefault(tuple(g["prompt_token_ids"]), []).append((g["token_ids"], g["logprobs"]))
        rows = [json.loads(line) for line in (tmp_path / "run" / name / "batches.jsonl").read_text().splitlines()]
        assert len(rows) == 20 * spec["rollout"]["groups_per_step"] * spec["rollout"]["group_size"]
        for row in rows:
            mask, resp, lps = row["loss_mask"], row["response_ids"], row["behaviour_logprobs"]
            assert len(mask) == len(resp) == len(lps)
            spans = sampled_spans(mask)
            assert len(spans) >= 3, spans  # three policy turns, context between them
            for s, e in spans:
                assert engine_sampled(sampled, row["prompt_ids"] + resp[:s], resp[s:e], lps[s:e]), (name, s, e)
            assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)


class KillResources(threading.Thread):
    """Once `pipeline` has trained `at_step` steps and its engines are sampling turns again (its
    generation log grows: episodes are in flight, each turn followed by a call to the resources
    server), SIGKILL its resources server by PID. Killed while the collector waits for training,
    no episode would notice the restart."""

    def __init__(self, run_dir: Path, pipeline: str, at_step: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.pipeline, self.at_step = run_dir, pipeline, at_step
        self.killed: int | None = None

    def run(self) -> None:
        deadline = time.monotonic() + 300
        metrics, procs = self.run_dir / self.pipeline / "metrics.jsonl", self.run_dir / "processes.json"
        generations = self.run_dir / self.pipeline / "generations"
        sampled_at_step: int | None = None
        while time.monotonic() < deadline and self.killed is None:
            time.sleep(0.02)
            try:
                steps = len(metrics.read_text().splitlines())
                pid = json.loads(procs.read_text())[self.pipeline]["env"]["resources"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if steps < self.at_step:
                continue
            sampled = sum(f.stat().st_size for f in generations.glob("generations-*.jsonl"))
            if sampled_at_step is None:
                sampled_at_step = sampled
            elif sampled > sampled_at_step:
                os.kill(pid, signal.SIGKILL)
                self.killed = pid


def test_a_killed_resources_server_is_restarted_and_training_goes_on(tmp_path, fresh_ray):
    # tools that take 0.5 s: an episode in flight is then most likely inside a resources call
    # when the kill lands (at 0.05 s the episodes in flight could all miss the dead window)
    path, cfg = example(tmp_path, steps=6, episode_retries=3, tool_latency_s=0.5)
    killer = KillResources(tmp_path / "run", "agent-7", at_step=2)
    killer.start()
    summary = run(path, mode=None)
    killer.join(1)
    assert killer.killed is not None
    with pytest.raises(ProcessLookupError):
        os.kill(killer.killed, 0)
    for name, p in summary["pipelines"].items():
        assert p["state"] == "done" and p["steps"] == 6, (name, p.get("error"))
    hit = summary["pipelines"]["agent-7"]
    assert any("resources" in r for r in hit["env"]["restarts"]), hit["env"]
    assert summary["pipelines"]["agent-z"]["env"]["restarts"] == []  # the other pipeline's is untouched
    # the episodes in flight at the kill were retried (or, failing again, counted with the reason)
    failed = [r for r in hit["accounting"]["dropped"] if r.startswith("episode failed")]
    assert hit["collector"]["retries"] > 0 or failed, hit["collector"]
