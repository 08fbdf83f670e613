"""summary.json through `RunSummary`: a real run's summary (tests/data/run_summary.json: an
`rlix run` of four long-tail pipelines on 8 GPUs and one agentic pipeline, each trimmed to a
few rows, plus a pipeline that failed before its summary, as the supervisor writes it) is read,
written and read back unchanged; a key or type that does not fit is refused naming the field.
No Ray is started (rlix.run and rlix.supervise import Ray's module only)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlix.errors import ConfigError
from rlix.run_summary import SUMMARY_FILE, PipelineSummary, RunSummary, ShardEvent, StepRow, load_summary

DATA = Path(__file__).parent / "data" / "run_summary.json"


def raw() -> dict:
    return json.loads(DATA.read_text())


def written(tmp_path: Path, data: dict) -> Path:
    (tmp_path / SUMMARY_FILE).write_text(json.dumps(data))
    return tmp_path


def test_a_real_summary_is_written_and_read_back_unchanged(tmp_path):
    summary = RunSummary.model_validate_json(DATA.read_text())
    summary.write(tmp_path / SUMMARY_FILE)
    again = load_summary(tmp_path)
    assert again == summary
    # the file keeps the keys and shape it had: what scripts index as a dict
    assert json.loads((tmp_path / SUMMARY_FILE).read_text()) == raw() == summary.to_dict()
    tail = again.pipelines["tail-0"]
    assert tail.records[0].finished_at is not None and tail.collector is not None
    assert tail.events[0].kind and isinstance(tail.events[0].ranks, list)
    assert again.pipelines["agent-0"].env is not None
    assert again.gpu_account is not None and set(again.gpu_account.pipelines) == {"tail-0", "agent-0"}


def test_a_failed_pipelines_small_summary_validates_and_stays_small():
    failed = raw()["pipelines"]["tail-9"]
    summary = PipelineSummary.model_validate(failed)
    assert summary.failed and summary.error == failed["error"] and summary.reward_first5 is None
    assert summary.failures[0].then == "no restart left (0 used)"
    assert summary.model_dump(mode="json", exclude_unset=True) == failed  # nothing added


def test_the_supervisors_summary_of_a_pipeline_that_never_gave_one(tmp_path):
    from rlix.supervise import Supervisor  # deferred: imports Ray's module (no cluster is started)

    said: list[str] = []
    sup = Supervisor([SimpleNamespace(name="p")], mode="rlix", run_dir=tmp_path, api_key="k",  # type: ignore[list-item]
                     devices=None, scheduler=None, say=said.append, heartbeat_timeout_s=1.0,  # type: ignore[arg-type]
                     setup_timeout_s=1.0, all_gpus=[0])
    slot = sup.slots["p"]
    slot.state = "failed"
    slot.failures.append({"reason": "boom", "at": 1.0, "step": None})
    summary = sup.summaries()["p"]
    assert summary.failed and summary.error == "boom" and summary.failures[0].reason == "boom"
    assert set(summary.model_dump(exclude_unset=True)) == {
        "pipeline", "steps", "rewards", "gpu_seconds", "state", "restarts", "failures", "error"}
    # a runner's summary that drifted from the model is said (the field named); the metrics stand in
    drifted = sup._typed_summary(slot, {"pipeline": "p", "steps": 2, "rewards": [], "stepz": 1})
    assert drifted.steps == 0 and any("stepz" in line and "unknown field" in line for line in said), said


@pytest.mark.parametrize("edit,names", [
    (lambda d: d["pipelines"]["tail-0"].update(stepz=3), ["pipelines.tail-0.stepz", "unknown field"]),
    (lambda d: d["pipelines"]["tail-0"].update(steps="many"), ["pipelines.tail-0.steps", "'many'"]),
    (lambda d: d["pipelines"]["tail-0"]["records"][0].update(train_s="slow"), ["records[0].train_s"]),
    (lambda d: d["role_changes"][0].pop("gpu"), ["role_changes[0].gpu", "Field required"]),
    (lambda d: d["pipelines"]["tail-0"]["events"].append([1.0, "wake", [0], 1, 0.5, "extra"]),
     ["events[6]", "[at, kind, ranks, version, seconds]"]),
    (lambda d: d.update(endings="finished"), ["endings", "unknown field"]),
])
def test_a_summary_that_does_not_fit_is_refused_naming_the_field(tmp_path, edit, names):
    data = raw()
    edit(data)
    with pytest.raises(ConfigError) as err:
        load_summary(written(tmp_path, data))
    message = str(err.value)
    assert "not a run summary" in message and "\n" not in message
    for name in names:
        assert name in message, message


def test_nan_and_infinity_are_written_as_json_dumps_writes_them(tmp_path):
    data = raw()
    data["pipelines"]["tail-0"]["records"][0]["loss"] = math.nan
    data["pipelines"]["tail-0"]["records"][1]["loss"] = math.inf
    summary = RunSummary.model_validate(data)
    summary.write(tmp_path / SUMMARY_FILE)
    assert '"loss": NaN' in (tmp_path / SUMMARY_FILE).read_text()
    back = load_summary(tmp_path).pipelines["tail-0"].records
    assert math.isnan(back[0].loss) and back[1].loss == math.inf


def test_short_shard_events_read_with_defaults_and_write_whole():
    event = ShardEvent.model_validate([5.0, "activate", [0]])
    assert (event.version, event.seconds) == (None, 0.0)
    assert event.model_dump() == [5.0, "activate", [0], None, 0.0]


def test_step_rows_have_the_fields_step_records_have():
    pytest.importorskip("torch")
    from rlix.pipeline.async_grpo import StepRecord  # deferred: imports torch

    assert [f.name for f in dataclasses.fields(StepRecord)] == list(StepRow.model_fields)


def test_the_summary_table_and_memory_ledger_read_the_model():
    from rlix.run import memory_ledger, summary_table  # deferred: imports Ray's module (no cluster)

    summary = RunSummary.model_validate(raw())
    lines = summary_table(summary)
    assert lines[0].startswith(f"summary ({summary.mode}, {summary.wall_s}s)")
    row = next(line.split() for line in lines if line.split()[:1] == ["tail-9"])
    assert row[1:6] == ["1", "-", "-", "-", "-"]  # failed before its summary: no rewards to show
    assert any(line.strip().startswith("tail-9 FAILED: tail-9: its actor died") for line in lines)
    ledger = memory_ledger(summary.pipelines)
    rows = [r for rs in ledger.values() for r in rs]
    assert rows and all(set(r) >= {"pipeline", "event", "holder", "at"} for r in rows)
    assert any("graph_captures" in r for r in rows)  # an engine's own report, kept
    wrote = [{"pipeline": n, **r} for n, p in raw()["pipelines"].items() for r in p.get("gpu_memory", [])]
    assert all(r in wrote for r in rows)  # each row as the pipeline wrote it, nothing added
    for rs in ledger.values():
        assert [r["at"] for r in rs] == sorted(r["at"] for r in rs)


def test_a_run_level_part_that_does_not_fit_leaves_it_out_and_the_summary_is_still_written(tmp_path):
    """The summary is written whatever the ending: a role log entry of another shape (a
    scheduler of another version) is said, naming the field, and left out, not raised from the
    run's `finally`."""
    from rlix.run import _write_summary

    data = raw()
    supervisor = SimpleNamespace(
        summaries=lambda: {n: PipelineSummary.model_validate(p) for n, p in data["pipelines"].items()},
        role_changes=[{"seq": 1, "at": 0.0, "gpu": 0, "before": "idle", "after": "x", "colour": "red"}],
        lost_nodes=[], ledger_audits=[])
    said: list[str] = []
    summary = _write_summary("c.yaml", "rlix", tmp_path, supervisor, "finished", 1.0, said.append)  # type: ignore[arg-type]
    assert summary.role_changes == [] and set(summary.pipelines) == set(data["pipelines"])
    assert load_summary(tmp_path).pipelines.keys() == summary.pipelines.keys()
    assert any("role_changes" in line and "colour" in line for line in said)


def test_every_shape_the_coordinator_writes_a_shard_death_in_validates():
    """A death (exit code and log tail), a hung shard killed, and one forgotten because it held
    no GPU (`then`): a fault run's summary is typed like any other, not replaced by its metrics."""
    deaths = [{"rank": 0, "pid": 11, "exit_code": -9, "at": 1.0, "assigned": True, "what": "died",
               "log_tail": "..."},
              {"rank": 1, "pid": 12, "exit_code": None, "at": 2.0, "assigned": True, "what": "hung", "hung": True},
              {"rank": 2, "pid": 13, "exit_code": 1, "at": 3.0, "assigned": False, "what": "died",
               "log_tail": "", "then": "forgotten (it held no GPU)"}]
    summary = PipelineSummary.model_validate({"pipeline": "p", "shard_deaths": deaths})
    assert [d.then for d in summary.shard_deaths] == [None, None, "forgotten (it held no GPU)"]
