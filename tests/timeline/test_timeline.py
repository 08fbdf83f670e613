"""The run timeline: the Chrome trace is in the trace event format, and it reconciles with the
scheduler's role log: every GPU-second of the run is accounted for exactly once (per GPU the
holdings tile the run, the parts tile each holding, and the account adds up to GPUs x span),
for a hand-made role log and for a real run's (tests/timeline/data: `rlix run` on two simulated
nodes of 2 GPUs, two pipelines, 4 steps each, shrunk to the fields the timeline reads)."""

from __future__ import annotations

import json
import math
import struct
import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from chrome_trace_format import TraceFormatError, validate  # noqa: E402

from rlix.cli import main  # noqa: E402
from rlix.timeline import (  # noqa: E402
    CHART_FILE,
    FREE,
    HELD,
    TRACE_FILE,
    account_lines,
    build_timeline,
    chrome_trace,
    draw_png,
    gpu_account,
    run_fields,
    write_timeline,
)
from rlix.timeline.model import infer_reason, parse_role, tile  # noqa: E402

DATA = Path(__file__).parent / "data"
REAL = DATA / "two_nodes_summary.json"
T0 = 1_000.0


def real_summary() -> dict:
    return json.loads(REAL.read_text())


def change(seq, at, gpu, before, after, reason=None):
    c = {"seq": seq, "at": T0 + at, "gpu": gpu, "before": before, "after": after}
    if reason:
        c["reason"] = reason
    return c


def synthetic() -> dict:
    """2 nodes x 2 GPUs over [0, 100] s. a: shard 0 on GPU 0 from 1 s (active at 3 s after a
    2 s wake-sync), trains on GPU 1 from 40 to 60 s; b: shard 0 on GPU 2 from 1 s, preempted at
    20 s by a's shard 1; node 1 (GPUs 2, 3) leaves at 80 s; GPU 3 is never held."""
    roles = [
        change(1, 1, 0, "idle", "a/generate#0", "expand"),
        change(2, 1, 2, "idle", "b/generate#0", "expand"),
        change(3, 20, 2, "b/generate#0", "a/generate#1", "expand"),
        change(4, 40, 1, "idle", "a/train", "grant"),
        change(5, 60, 1, "a/train", "idle", "release"),
        change(6, 80, 2, "a/generate#1", "idle", "lost"),
        change(7, 90, 0, "a/generate#0", "idle", "unregister"),
    ]
    # step 1 from 2 s: generate 2-38, wait GPUs 38-42, reload 42-43, train 43-53, cache + audit
    # 53-56 (version 1), offload 56-57, then the refit 57-59 beside the release 57-60
    step = {"step": 1, "reward": 0.5, "generate_s": 36.0, "wait_gpus_s": 4.0, "reload_s": 1.0,
            "train_s": 10.0, "cache_s": 2.0, "audit_s": 1.0, "offload_s": 1.0, "release_s": 3.0,
            "sync_s": 2.0, "step_s": 58.0, "finished_at": T0 + 60.0}
    events_a = [[T0 + 3.0, "sync", [0], 0, 2.0], [T0 + 3.0, "activate", [0], 0, 0.0],
                [T0 + 21.0, "wake", [1], None, 1.0], [T0 + 21.0, "activate", [1], 0, 0.0],
                [T0 + 59.0, "refit", [0, 1], 1, 2.0]]
    events_b = [[T0 + 2.0, "activate", [0], 0, 0.0], [T0 + 20.5, "sleep", [0], None, 0.5]]
    return {"config": "synthetic", "wall_s": 100.0,
            "run": run_fields(T0, T0 + 100.0, [0, 0, 1, 1]),
            "role_changes": roles,
            "lost_nodes": [{"node_id": "n1", "gpus": [2, 3], "at": T0 + 80.0}],
            "pipelines": {"a": {"records": [step], "events": events_a},
                          "b": {"records": [], "events": events_b}}}


def assert_tiles(tl) -> None:
    """Per GPU the holdings tile [start, end]; per holding its parts tile it."""
    for g in tl.gpus:
        hs = tl.holdings[g]
        assert hs[0].start == tl.start and hs[-1].end == tl.end, g
        for a, b in zip(hs, hs[1:]):
            assert a.end == b.start, (g, a, b)
        for h in hs:
            assert h.end >= h.start
            assert h.parts[0].start == h.start and h.parts[-1].end == h.end, h
            for a, b in zip(h.parts, h.parts[1:]):
                assert a.end == b.start and a.category != b.category, h


def assert_account_adds_up(account: dict, gpus: int, span: float, tol: float = 1e-6) -> None:
    """`tol`: 1e-6 s unrounded; an account rounded to ms is off by up to 0.5 ms a figure."""
    total = math.fsum([account["idle_s"], account["lost_s"],
                       *(row["held"] for row in account["pipelines"].values())])
    assert account["gpu_s"] == pytest.approx(gpus * span, rel=1e-12, abs=tol * 10)
    assert total == pytest.approx(gpus * span, rel=1e-9, abs=tol * (3 + 6 * len(account["pipelines"])))
    for row in account["pipelines"].values():
        assert math.fsum(row[c] for c in HELD) == pytest.approx(row["held"], abs=tol * 6)
        assert all(row[c] >= 0 for c in HELD)


def trace_account(trace: dict) -> tuple[dict, dict]:
    """From the trace alone: per GPU thread the tiling of its holdings, and the seconds per
    (pipeline, category) of the parts."""
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    holdings, seconds = defaultdict(list), defaultdict(float)
    for e in trace["traceEvents"]:
        if e["ph"] != "X" or not threads[(e["pid"], e["tid"])].startswith("GPU "):
            continue
        if e["cat"] == "gpu":
            holdings[threads[(e["pid"], e["tid"])]].append((e["ts"], e["ts"] + e["dur"]))
        else:
            seconds[(e["args"]["pipeline"], e["args"]["category"])] += e["dur"] / 1e6
    return holdings, seconds


def check_trace_reconciles(summary: dict) -> dict:
    tl = build_timeline(summary)
    trace = chrome_trace(tl, "test")
    validate(trace)
    validate(json.loads(json.dumps(trace)))  # as written
    assert_tiles(tl)
    account = gpu_account(tl)
    assert_account_adds_up(account, len(tl.gpus), tl.span_s)

    # the trace itself: each GPU's holdings tile [0, span], no gap, no overlap
    holdings, seconds = trace_account(trace)
    span_us = tl.span_s * 1e6
    assert sorted(holdings) == sorted(f"GPU {g}" for g in tl.gpus)
    for name, spans in holdings.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == pytest.approx(span_us, abs=1e-2), name
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start == pytest.approx(end, abs=1e-2), name
        assert math.fsum(e - s for s, e in spans) == pytest.approx(span_us, abs=1e-1)
    # ... and its parts add up to the account
    for p, row in account["pipelines"].items():
        for c in HELD:
            assert seconds.get((p, c), 0.0) == pytest.approx(row[c], abs=1e-6), (p, c)
    for c in FREE:
        assert seconds.get((None, c), 0.0) == pytest.approx(account[f"{c}_s"], abs=1e-6)

    # the role log, change by change: a holding starts where each change is, in its new role
    starts = {(h.gpu, h.start): h for hs in tl.holdings.values() for h in hs}
    for c in summary["role_changes"]:
        at = min(max(c["at"], tl.start), tl.end)
        h = starts.get((c["gpu"], at))
        if h is None:  # only a change undone at the same instant leaves no holding
            assert any(o["gpu"] == c["gpu"] and o["at"] == c["at"] and o is not c
                       for o in summary["role_changes"]), c
            continue
        assert h.role in (c["after"], "lost"), (c, h)
        assert h.reason == (c.get("reason") or infer_reason(c["before"], c["after"]))
    return account


def test_synthetic_role_log_reconciles_and_is_classified_as_by_hand():
    summary = synthetic()
    account = check_trace_reconciles(summary)
    a, b = account["pipelines"]["a"], account["pipelines"]["b"]
    assert account["gpu_s"] == 400.0
    # a: GPU 0 [1, 90] (89 s): wake-sync [1, 3] (sync), refit [57, 59] (sync), else generate;
    # GPU 2 [20, 80] (60 s): b's sleep [20, 20.5] and a's wake [20, 21] (switch), refit (sync);
    # GPU 1 [40, 60] (20 s): waiting 40-42, reload 42-43 (switch), train 43-53, cache + audit
    # 53-56 (sync), offload 56-57 (switch), waiting 57-60
    assert a["held"] == pytest.approx(89 + 60 + 20)
    assert a["train"] == pytest.approx(10.0)
    assert a["sync"] == pytest.approx(2 + 2 + 2 + 3)
    assert a["switch"] == pytest.approx(1 + 1 + 1)
    assert a["waiting"] == pytest.approx(2 + 3)
    assert a["generate"] == pytest.approx(89 - 4 + 60 - 3)
    # b: GPU 2 [1, 20]: active from 2 s
    assert b["held"] == pytest.approx(19.0)
    assert (b["switch"], b["generate"]) == (pytest.approx(1.0), pytest.approx(18.0))
    # idle: GPU 0 [0, 1] + [90, 100], GPU 1 [0, 40] + [60, 100], GPU 2 [0, 1], GPU 3 [0, 80]
    assert account["idle_s"] == pytest.approx(11 + 80 + 1 + 80)
    assert account["lost_s"] == pytest.approx(20 + 20)  # GPUs 2 and 3 from 80 s


def test_real_two_node_run_reconciles_every_gpu_second():
    summary = real_summary()
    account = check_trace_reconciles(summary)
    assert account["gpus"] == 4  # the GPUs the role log names (the summary has no `run`)
    # the summary's own span: its last timestamp and wall_s before it
    assert account["span_s"] == pytest.approx(summary["wall_s"], abs=0.01)
    rows = account["pipelines"]
    assert set(rows) == {"nodes-p1", "nodes-p2"}
    for name, row in rows.items():
        assert row["train"] > 0 and row["generate"] > 0 and row["sync"] > 0, (name, row)
    # the supervisor's own count (sampled roughly every poll) is of the same size as what the
    # role log adds up to
    for name, row in rows.items():
        assert row["held"] == pytest.approx(summary["pipelines"][name]["gpu_seconds"], rel=0.35)


def test_real_run_with_its_run_block_uses_the_nodes_and_the_span():
    summary = real_summary()
    last = max(c["at"] for c in summary["role_changes"])
    summary["run"] = run_fields(last - 80.0, last + 1.0, [0, 0, 1, 1, 1])  # a fifth GPU, never held
    account = check_trace_reconciles(summary)
    assert account["gpus"] == 5 and account["span_s"] == pytest.approx(81.0)
    tl = build_timeline(summary)
    names = {e["args"]["name"] for e in chrome_trace(tl)["traceEvents"] if e["name"] == "process_name"}
    assert names == {"node 0", "node 1", "pipelines"}
    assert [h.role for h in tl.holdings[4]] == ["idle"]


def test_versions_phases_and_shard_events_are_on_the_pipeline_tracks():
    tl = build_timeline(real_summary())
    trace = chrome_trace(tl)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e["name"] == "thread_name"}
    versions = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "i" and e["cat"] == "version":
            versions[threads[(e["pid"], e["tid"])]].append(e["args"]["version"])
    assert versions == {"nodes-p1 steps": [1, 2, 3, 4], "nodes-p2 steps": [1, 2, 3, 4]}
    phases = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "phase"}
    assert {"generate", "train", "cache", "sync"} <= phases
    kinds = {e["args"]["kind"] for e in trace["traceEvents"] if e.get("cat") == "shard"
             and e["ph"] == "X"}
    assert {"refit", "sync", "sleep", "audit"} <= kinds
    reasons = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "role change"}
    assert reasons == {"expand", "grant", "release", "preemption"}  # inferred: the log predates them


def test_a_run_without_role_changes_is_all_idle_and_still_valid():
    summary = {"wall_s": 10.0, "run": run_fields(T0, T0 + 10.0, [0, 0]), "role_changes": [],
               "pipelines": {"solo": {"records": [], "events": []}}}
    account = check_trace_reconciles(summary)
    assert account["idle_s"] == pytest.approx(20.0)
    assert account["pipelines"]["solo"]["held"] == 0.0
    empty = build_timeline({"role_changes": []})
    validate(chrome_trace(empty))
    assert gpu_account(empty)["gpu_s"] == 0


def test_tile_prefers_higher_priority_marks_and_keeps_exact_boundaries():
    parts = tile(0.0, 10.0, "generate", [(2.0, 5.0, "switch", 1), (4.0, 6.0, "sync", 3),
                                          (-1.0, 0.5, "sync", 3), (9.5, 12.0, "switch", 1)])
    assert [(p.start, p.end, p.category) for p in parts] == [
        (0.0, 0.5, "sync"), (0.5, 2.0, "generate"), (2.0, 4.0, "switch"), (4.0, 6.0, "sync"),
        (6.0, 9.5, "generate"), (9.5, 10.0, "switch")]
    assert parse_role("x/y/generate#3") == ("x/y", "generate", 3)
    with pytest.raises(ValueError):
        parse_role("nonsense")


def test_the_validator_catches_what_viewers_reject():
    good = chrome_trace(build_timeline(synthetic()))
    validate(good)
    x = next(i for i, e in enumerate(good["traceEvents"]) if e["ph"] == "X")
    for breakage, match in [
        (lambda t: t["traceEvents"][x].pop("dur"), "dur"),
        (lambda t: t["traceEvents"][x].update(ph="Q"), "ph"),
        (lambda t: t["traceEvents"][x].update(ts="0"), "ts"),
        (lambda t: t["traceEvents"][x].update(tid=1.5), "integers"),
        (lambda t: t["traceEvents"][x].update(ts=float("nan")), "JSON"),
        (lambda t: t["traceEvents"].append({"ph": "M", "name": "thread_name", "pid": 1, "tid": 1,
                                            "args": {}}), "args.name"),
        (lambda t: t["traceEvents"].append({"ph": "X", "name": "x", "pid": 99, "tid": 1, "ts": 0,
                                            "dur": 1}), "process_name"),
        (lambda t: t["traceEvents"].append(dict(t["traceEvents"][x], ts=t["traceEvents"][x]["ts"] + 1,
                                                dur=t["traceEvents"][x]["dur"] + 5)), "overlaps"),
        (lambda t: t.pop("traceEvents"), "traceEvents"),
    ]:
        bad = json.loads(json.dumps(good))
        breakage(bad)
        with pytest.raises(TraceFormatError, match=match):
            validate(bad)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_the_chart_is_a_png_of_a_sensible_size(tmp_path):
    path = draw_png(build_timeline(real_summary()), tmp_path / "t.png", "two nodes")
    width, height = png_size(path)
    assert 1000 <= width <= 2000 and 400 <= height <= 1500, (width, height)
    assert path.stat().st_size > 20_000  # drawn, not blank
    big = synthetic()
    big["run"]["gpu_nodes"] = [n for n in range(8) for _ in range(8)]
    width2, height2 = png_size(draw_png(build_timeline(big), tmp_path / "big.png"))
    assert width2 == width and height2 > height  # more GPUs: taller


def test_write_timeline_writes_both_files_and_returns_the_rounded_account(tmp_path):
    account = write_timeline(tmp_path, synthetic())
    validate(json.loads((tmp_path / TRACE_FILE).read_text()))
    png_size(tmp_path / CHART_FILE)
    assert account["pipelines"]["a"]["train"] == 10.0
    lines = account_lines(account)
    assert lines[0].startswith("GPU time (s) over 4 GPU(s) x 100.0 s = 400.0 GPU-s")
    assert any(line.split()[:2] == ["a", "169.0"] for line in lines), lines
    assert any(line.split()[:2] == ["(lost)", "40.0"] for line in lines), lines


def test_cli_timeline_redraws_from_summary_json(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(REAL.read_text())
    assert main(["timeline", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert str(run_dir / TRACE_FILE) in out and "GPU time (s) over 4 GPU(s)" in out
    validate(json.loads((run_dir / TRACE_FILE).read_text()))
    png_size(run_dir / CHART_FILE)


@pytest.mark.parametrize("setup,message", [
    (lambda d: None, "no such run directory"),
    (lambda d: d.mkdir(), "summary.json: not found"),
    (lambda d: (d.mkdir(), (d / "summary.json").write_text("{not json")), "not a readable summary"),
    (lambda d: (d.mkdir(), (d / "summary.json").write_text("[1, 2]")), "not a run summary"),
])
def test_cli_timeline_errors_are_one_line_with_exit_code_2(tmp_path, capsys, setup, message):
    run_dir = tmp_path / "run"
    setup(run_dir)
    assert main(["timeline", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlix: error: ") and message in err and "\n" not in err
    assert not (run_dir / TRACE_FILE).exists()


class FakeSupervisor:
    """What `rlix run`'s summary reads of its supervisor, from the real run's summary."""

    def __init__(self, summary: dict) -> None:
        self._summary = summary
        self.role_changes = summary["role_changes"]
        self.lost_nodes = summary["lost_nodes"]
        self.ledger_audits: list = []

    def summaries(self) -> dict:
        return self._summary["pipelines"]


def test_a_runs_summary_gets_its_span_account_and_timeline_files(tmp_path):
    from rlix.run import _write_summary  # deferred: imports Ray's module (no cluster is started)

    said: list[str] = []
    result = _write_summary("cfg.yaml", "rlix", tmp_path, FakeSupervisor(real_summary()), "finished",
                            80.0, said.append, gpu_nodes=[0, 0, 1, 1])
    written = json.loads((tmp_path / "summary.json").read_text())
    assert result.gpu_account is not None and written["gpu_account"] == result.gpu_account.model_dump()
    assert written["run"]["gpu_nodes"] == [0, 0, 1, 1]
    assert written["run"]["ended_at"] - written["run"]["started_at"] == pytest.approx(80.0)
    assert_account_adds_up(written["gpu_account"], 4, written["gpu_account"]["span_s"], tol=5e-4)
    validate(json.loads((tmp_path / TRACE_FILE).read_text()))
    png_size(tmp_path / CHART_FILE)
    assert any(line.startswith("GPU time (s) over 4 GPU(s)") for line in said), said
    assert main(["timeline", str(tmp_path)]) == 0  # redrawn from what the run wrote


def test_a_run_that_ended_before_anything_ran_still_gets_its_summary(tmp_path):
    from rlix.run import _write_summary  # deferred: imports Ray's module (no cluster is started)

    said: list[str] = []
    result = _write_summary("cfg.yaml", "rlix", tmp_path, None, "failed: boom", 3.0, said.append)
    assert result.gpu_account is not None and result.gpu_account.gpu_s == 0
    assert (tmp_path / TRACE_FILE).exists()
    assert any("who held which GPU is not known" in line for line in said)


def test_records_without_times_and_short_events_are_taken_as_they_come():
    summary = synthetic()
    summary["pipelines"]["a"]["records"].append({"step": 2, "train_s": 1.0})  # no finished_at
    summary["pipelines"]["b"]["events"].append([T0 + 5.0, "activate", [0]])  # no version, seconds
    account = check_trace_reconciles(summary)
    assert account["span_s"] == 100.0 and account["pipelines"]["a"]["train"] == pytest.approx(10.0)


def test_the_chart_leaves_out_a_long_setup_with_no_gpu_held():
    from rlix.timeline.chart import setup_cut  # deferred: imports matplotlib's colour maps

    real = build_timeline(real_summary())  # the first GPU is granted 20.6 s into 72.9 s
    first = min(h.start for hs in real.holdings.values() for h in hs if h.pipeline) - real.start
    assert 0 < setup_cut(real) < first and first - setup_cut(real) < 2.0
    assert setup_cut(build_timeline(synthetic())) == 0.0  # held from 1 s of 100: all drawn
