"""What a step reports besides its reward: the batch's RL statistics, the readable samples
(samples.jsonl, the console's table, the trackers' text), the console's step lines (each step
once, in order, also across polls that skip steps, the end of the run and a resume), the
summary's reward windows and dropped reasons, and `rlix status` piped at full width."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from rlix.cluster.status_view import PIPED_WIDTH, status_console
from rlix.pipeline.reporting.batch_stats import batch_stats
from rlix.pipeline.reporting.samples import (
    SAMPLES_FILE, append_samples, console_lines, keep_until, markdown_table, pick, read_samples, single_line)
from rlix.pipeline.rollout.types import Group, Trajectory
from rlix.training.types import TrainSample


def trajectory(gid: str, i: int, reward: float, n: int, version: int, finish: str = "stop") -> Trajectory:
    return Trajectory(f"{gid}-{i}", gid, [1, 2], list(range(3, 3 + n)), [-1.0] * n, reward, version,
                      [version], finish)


def batch() -> tuple[list[Group], list[TrainSample]]:
    groups = [Group("g0", "say a\nthen b", [trajectory("g0", 0, 1.0, 4, 3), trajectory("g0", 1, 0.0, 8, 2, "length")]),
              Group("g1", "say c", [trajectory("g1", 0, 0.5, 2, 3), trajectory("g1", 1, 0.5, 6, 3)])]
    advantages = [1.0, -1.0, 0.0, 0.0]
    samples = [TrainSample(t.prompt_ids, t.response_ids, t.behaviour_logprobs, a, t.version)
               for t, a in zip([t for g in groups for t in g.trajectories], advantages)]
    return groups, samples


def test_batch_stats_lengths_truncation_rewards_advantages_and_staleness():
    groups, samples = batch()
    stats = batch_stats(groups, samples, trained_version=3)
    assert stats.response_len_mean == 5.0 and stats.response_len_max == 8
    assert stats.response_truncated_frac == 0.25  # one of four stopped by its token limit
    assert (stats.reward_min, stats.reward_max) == (0.0, 1.0)
    assert (stats.advantage_mean, stats.advantage_min, stats.advantage_max) == (0.0, -1.0, 1.0)
    assert stats.advantage_std == pytest.approx(0.5 ** 0.5)
    assert stats.staleness_mean == 0.25 and stats.staleness_max == 1  # one sample of version 2


def test_samples_are_taken_across_groups_decoded_and_kept_until_a_resume(tmp_path):
    groups, samples = batch()
    rows = pick(7, groups, samples, 3, decode=lambda ids: " ".join(map(str, ids)))
    assert [(r.group_id, r.reward, r.advantage) for r in rows] == [("g0", 1.0, 1.0), ("g1", 0.5, 0.0),
                                                                     ("g0", 0.0, -1.0)]
    assert rows[0].prompt == "say a\nthen b" and rows[0].response == "3 4 5 6" and rows[0].response_tokens == 4
    assert rows[2].finish_reason == "length" and rows[2].version == 2 and rows[2].step == 7
    assert pick(7, groups, samples, 0, decode=str) == []
    assert len(pick(7, groups, samples, 64, decode=str)) == 4  # no more than the batch holds

    path = tmp_path / SAMPLES_FILE
    append_samples(path, rows)
    append_samples(path, pick(8, groups, samples, 2, decode=str))
    with path.open("a") as fh:
        fh.write('{"step": 9, "prom')  # a kill mid-line
    assert [r["step"] for r in read_samples(path)] == [7, 7, 7, 8, 8]
    keep_until(path, 7)  # resumed from step 7's checkpoint: 8 is trained again
    assert [r["step"] for r in read_samples(path)] == [7, 7, 7]
    assert json.loads(path.read_text().splitlines()[0])["response"] == "3 4 5 6"
    keep_until(path, 0)  # a fresh start
    assert read_samples(path) == []


def test_console_table_is_short_and_trackers_get_markdown():
    groups, samples = batch()
    long = "x" * 500
    rows = pick(1, groups, samples, 2, decode=lambda ids: long + "|tail")
    lines = console_lines([r.as_dict() for r in rows])
    assert len(lines) == 4  # header, its rule and two rows
    assert all(len(line) <= 140 for line in lines)
    assert "say a⏎then b" in lines[2] and "…" in lines[2] and "tail" not in lines[2]
    assert single_line("a\nb", 10) == "a⏎b" and single_line("abcdef", 4) == "abc…"
    assert single_line("a\x0bb\u2028c\td", 20) == "a\\x0bb\\u2028c d"  # nothing a terminal breaks a line on
    md = markdown_table(rows)
    assert md.splitlines()[0].startswith("| reward |") and len(md.splitlines()) == 4
    assert "\\|tail" in md  # a pipe in a text does not split the table's cell


def test_tensorboard_gets_the_samples_as_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # deferred: slow

    from rlix.config.models import LoggingConfig
    from rlix.pipeline.reporting.experiment_log import open_experiment_log

    groups, samples = batch()
    exp = open_experiment_log(LoggingConfig(tensorboard=True), pipeline="p", pipeline_dir=tmp_path)
    exp.log_samples(1, pick(1, groups, samples, 2, decode=lambda ids: "hello"))
    exp.log({"step": 1, "reward": 0.5, "tokens_per_s": 10.0, "kl": None, "train_s": 1.0, "finished_at": 1.0})
    exp.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    text = acc.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| reward |" in text and "hello" in text
    tags = acc.Tags()["scalars"]
    assert "train/tokens_per_s" in tags and "time/train_s" in tags and not any("kl" in t for t in tags)


class FakeProgress:
    """A pipeline actor's `progress` answers, with the steps its runner finished by then."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.done = 0

    def answer(self, since: int | None) -> dict:
        rows = [] if since is None else [
            {"step": s, "reward": s / 100, "step_s": 1.0, "response_len_mean": 4.0,
             "samples": [{"reward": 1.0, "advantage": 0.5, "response_tokens": 3, "finish_reason": "stop",
                          "prompt": "p", "response": f"r{s}"}] if s % 10 == 0 else []}
            for s in range(since + 1, self.done + 1)]
        return {"step": self.done, "steps": self.steps, "reward": None, "active_shards": [0], "new_steps": rows}


def supervisor(tmp_path, said: list[str], bars: list[tuple]):  # type: ignore[no-untyped-def]
    from rlix.supervise import Supervisor  # deferred: imports Ray's module (no cluster is started)

    return Supervisor([SimpleNamespace(name="p")], mode="rlix", run_dir=tmp_path, api_key="k",  # type: ignore[list-item]
                      devices=None, scheduler=None, say=said.append, heartbeat_timeout_s=1.0,  # type: ignore[arg-type]
                      setup_timeout_s=1.0, all_gpus=[0], on_step=lambda *a: bars.append(a))


def step_numbers(said: list[str]) -> list[int]:
    return [int(line.split("step ", 1)[1].split("/")[0]) for line in said if line.startswith("p: step ")]


def test_every_step_is_printed_once_in_order_whatever_the_polls_see(tmp_path):
    said: list[str] = []
    bars: list[tuple] = []
    sup = supervisor(tmp_path, said, bars)
    slot = sup.slots["p"]
    slot.seen_step = 0  # set up, starting at step 0
    pipe = FakeProgress(25)
    asked = slot.seen_step
    for done in (1, 2, 5, 5, 9, 14, 16, 17, 21, 23):  # polls land between steps, several apart
        pipe.done = done
        sup._show(slot, pipe.answer(asked))
        asked = slot.seen_step
    pipe.done = 25
    sup._show(slot, pipe.answer(20))  # an answer asked before the last one came: repeats 21-23
    assert step_numbers(said) == list(range(1, 26))
    assert [b[1] for b in bars] == list(range(1, 26))
    assert "p: step 25/25 reward 0.250 len 4.0 (1.0s)" in "\n".join(said)
    # step 10's samples under its line, as a short table
    at = next(i for i, line in enumerate(said) if line.startswith("p: step 10/"))
    assert said[at + 1].split() == ["reward", "adv", "tokens", "end", "prompt", "response"]
    assert said[at + 3].split()[-1] == "r10"


def test_a_resume_does_not_print_the_checkpoints_step_again(tmp_path):
    said: list[str] = []
    sup = supervisor(tmp_path, said, [])
    slot = sup.slots["p"]
    slot.seen_step = 12  # what _poll_setup sets from a resume at step 12
    pipe = FakeProgress(20)
    pipe.done = 12
    sup._show(slot, pipe.answer(slot.seen_step))
    assert step_numbers(said) == []
    pipe.done = 14
    sup._show(slot, pipe.answer(slot.seen_step))
    assert step_numbers(said) == [13, 14]


def test_the_last_steps_are_caught_up_when_the_run_ends_between_polls(tmp_path):
    said: list[str] = []
    sup = supervisor(tmp_path, said, [])
    slot = sup.slots["p"]
    slot.seen_step = 3
    pipe = FakeProgress(6)
    pipe.done = 6

    class Remote:
        def remote(self, since):  # type: ignore[no-untyped-def]
            return pipe.answer(since)

    slot.actor = SimpleNamespace(progress=Remote())
    import rlix.supervise as supervise

    real_get = supervise.ray.get
    supervise.ray.get = lambda value, timeout=None: value  # the fake actor answers at once
    try:
        sup._catch_up(slot)
    finally:
        supervise.ray.get = real_get
    assert step_numbers(said) == [4, 5, 6]


def test_reward_windows_never_overlap():
    from rlix.pipeline.runner import reward_windows  # deferred: imports torch

    assert reward_windows([]) == (None, None) and reward_windows([0.3]) == (None, None)
    assert reward_windows([0.0, 1.0]) == (0.0, 1.0)
    assert reward_windows([0.0, 0.5, 1.0]) == (0.0, 1.0)  # the middle step in neither
    assert reward_windows([float(i) for i in range(12)]) == (2.0, 9.0)  # 5 steps each


def test_summary_table_says_why_trajectories_were_dropped_and_na_for_short_runs():
    from rlix.run import summary_table  # deferred: imports Ray's module (no cluster)
    from rlix.run_summary import RunSummary

    accounting = {"started": 100, "trained": 24, "dropped": {"stale": 60, "failed": 16}, "buffered": 0}
    summary = RunSummary.model_validate({"config": "c", "mode": "rlix", "wall_s": 1.0, "ending": "finished",
                                         "pipelines": {
        "long": {"pipeline": "long", "steps": 6, "reward_first5": 0.1, "reward_last5": 0.4, "reward_window": 3,
                 "accounting": accounting, "gpu_seconds": 2.0},
        "one": {"pipeline": "one", "steps": 1, "reward_first5": None, "reward_last5": None, "reward_window": 0,
                "accounting": dict(accounting, dropped={}), "gpu_seconds": 1.0}}})
    lines = summary_table(summary)
    header = lines[1].split()
    assert header[:6] == ["pipeline", "steps", "reward", "first3", "reward", "last3"]
    long = next(line for line in lines if line.split()[:1] == ["long"])
    assert "76 (stale 60, failed 16)" in long and "+0.300" in long
    one = next(line.split() for line in lines if line.split()[:1] == ["one"])
    assert one[1:6] == ["1", "n/a", "n/a", "n/a", "0"]


def test_status_piped_is_not_cut_at_80_columns():
    from rich.table import Table

    out = io.StringIO()
    console = status_console(out)
    assert console.width == PIPED_WIDTH
    table = Table(title="t", title_justify="left")
    for i in range(12):
        table.add_column(f"column number {i}")
    table.add_row(*[f"value {i} " * 2 for i in range(12)])
    console.print(table)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) > 200  # whole rows, no wrapping
    assert all("column number 11" not in line or "column number 0" in line for line in lines)
    assert max(len(line) for line in lines) < PIPED_WIDTH  # only as wide as the cells


def test_wandb_gets_the_samples_as_a_table(tmp_path):
    pytest.importorskip("wandb")
    from rlix.config.models import LoggingConfig, WandbConfig
    from rlix.pipeline.reporting.experiment_log import open_experiment_log

    groups, samples = batch()
    cfg = LoggingConfig(wandb=WandbConfig(project="rlix-test", mode="offline"))
    exp = open_experiment_log(cfg, pipeline="p", pipeline_dir=tmp_path)
    wb = exp.loggers[0]
    run_dir = wb.run_dir
    exp.log_samples(1, pick(1, groups, samples, 2, decode=lambda ids: "hello"))
    exp.log({"step": 1, "reward": 0.5, "finished_at": 1.0})
    assert exp.loggers == [wb]  # neither call failed
    exp.close()
    tables = list(run_dir.glob("files/media/table/samples_*.table.json"))
    assert len(tables) == 1, list(run_dir.rglob("*"))
    data = json.loads(tables[0].read_text())
    assert data["columns"][:3] == ["step", "prompt", "response"] and data["data"][0][2] == "hello"
