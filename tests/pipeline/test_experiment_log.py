"""Experiment logging: TensorBoard event files read back with tensorboard's EventAccumulator (the
right scalars per step, every step once after a resume), wandb offline writing its run dir
without a network, and a tracker that fails dropped without failing the step."""

from __future__ import annotations

import json
import time

import pytest

from rlix.config.models import LoggingConfig, WandbConfig
from rlix.pipeline.reporting.experiment_log import ExperimentLog, open_experiment_log, scalars_of


def row(step: int, reward: float) -> dict:
    """A metrics.jsonl row as StepRecord.as_dict() writes it (a few of its fields)."""
    return {"step": step, "reward": reward, "reward_std": 0.1, "samples": 64, "tokens": 1000 + step,
            "loss": -reward, "train_s": 0.5 * step, "step_s": 1.0 * step, "finished_at": 1.7e9 + step}


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # deferred: slow

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_of_a_row():
    got = scalars_of({**row(3, 0.25), "flag": True, "note": "x"})
    assert got["train/reward"] == 0.25 and got["train/tokens"] == 1003 and got["time/step_s"] == 3.0
    assert not {"train/step", "train/finished_at", "train/flag", "train/note"} & set(got)


def test_tensorboard_event_files_hold_each_step_once(tmp_path):
    pdir = tmp_path / "run" / "p"
    elog = open_experiment_log(LoggingConfig(tensorboard=True), pipeline="p", pipeline_dir=pdir)
    for step in (1, 2, 3):
        elog.log(row(step, step / 10))
    elog.close()
    got = read_scalars(pdir / "tensorboard")
    assert got["train/reward"] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert got["train/loss"] == [(1, -0.1), (2, -0.2), (3, -0.3)]
    assert got["time/step_s"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert got["train/tokens"] == [(1, 1001.0), (2, 1002.0), (3, 1003.0)]

    time.sleep(1.1)  # a new event file sorts after the first one (names carry the second)
    # resumed from a checkpoint at step 2: step 3 is trained again, with another reward
    elog = open_experiment_log(LoggingConfig(tensorboard=True), pipeline="p", pipeline_dir=pdir, start_step=2)
    for step in (3, 4):
        elog.log(row(step, step / 100))
    elog.close()
    got = read_scalars(pdir / "tensorboard")
    assert got["train/reward"] == [(1, 0.1), (2, 0.2), (3, 0.03), (4, 0.04)]


def test_wandb_offline_writes_its_run_dir(tmp_path):
    pytest.importorskip("wandb")
    pdir = tmp_path / "run" / "p"
    cfg = LoggingConfig(wandb=WandbConfig(project="rlix-test", mode="offline"))
    elog = open_experiment_log(cfg, pipeline="p", pipeline_dir=pdir, config={"name": "p"})
    assert [lg.name for lg in elog.loggers] == ["wandb"]
    wb = elog.loggers[0]
    run_dir = wb.run_dir
    for step in (1, 2):
        elog.log(row(step, step / 10))
    elog.close()
    assert run_dir.parent == pdir / "wandb" and run_dir.name.startswith("offline-run-")
    assert run_dir.name.endswith(wb.run_id)
    data = run_dir / f"run-{wb.run_id}.wandb"
    assert data.is_file() and data.stat().st_size > 0
    assert json.loads((pdir / "wandb" / "rlix_run.json").read_text()) == {"id": wb.run_id, "last_step": 2}

    # a resume continues the same wandb run and skips the steps it holds already
    elog = open_experiment_log(cfg, pipeline="p", pipeline_dir=pdir, start_step=1)
    again = elog.loggers[0]
    assert again.run_id == wb.run_id
    elog.log(row(2, 0.5))
    elog.log(row(3, 0.6))
    elog.close()
    assert json.loads((pdir / "wandb" / "rlix_run.json").read_text())["last_step"] == 3
    # a start from step 0 (no checkpoint) is a new wandb run
    elog = open_experiment_log(cfg, pipeline="p", pipeline_dir=pdir)
    assert elog.loggers[0].run_id != wb.run_id
    elog.close()


def test_a_failing_tracker_is_dropped():
    class Broken:
        name = "broken"

        def log(self, step, scalars, walltime=None):
            raise OSError("disk full")

        def close(self):
            raise AssertionError("a dropped tracker is not closed")

    class Kept:
        name = "kept"
        steps: list[int] = []
        closed = False

        def log(self, step, scalars, walltime=None):
            self.steps.append(step)

        def close(self):
            self.closed = True

    kept = Kept()
    elog = ExperimentLog([Broken(), kept])
    elog.log(row(1, 0.1))
    elog.log(row(2, 0.2))
    elog.close()
    assert kept.steps == [1, 2] and kept.closed and not elog


def test_nothing_chosen_opens_nothing(tmp_path):
    assert not open_experiment_log(None, pipeline="p", pipeline_dir=tmp_path)
    off = LoggingConfig(wandb=WandbConfig(mode="disabled"))
    assert not open_experiment_log(off, pipeline="p", pipeline_dir=tmp_path)
    assert not list(tmp_path.iterdir())
