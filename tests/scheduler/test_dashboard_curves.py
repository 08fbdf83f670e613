"""The dashboard's curves and job queue without a browser: series read from a metrics.jsonl the
test writes (reward always, eval series only once rows carry them), bounded in points, series
and bytes read, followed as rows are appended and after a resume rewrites the file; the routes'
answers and their bounds; the cluster head's job rows. The page drawing them in a browser:
test_dashboard_browser.py (marker `browser`)."""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before Ray is imported anywhere

import httpx

from rlix.scheduler import curves as curves_mod
from rlix.scheduler.core import SchedulerCore
from rlix.scheduler.curves import KEEP_POINTS, MAX_SERIES, CurvesState, JobRow, JobsState, MetricsCurves, plotted
from rlix.scheduler.dashboard import DashboardFeed, DashboardServer, route
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Topology


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def rows(steps, eval_every: int | None = None, **extra) -> list[dict]:
    """metrics.jsonl rows as a pipeline writes them: reward and other numbers per step, and
    eval/pass@1 every `eval_every` steps."""
    out = []
    for s in steps:
        row = {"step": s, "reward": round(s / 100, 4), "reward_std": 0.1, "loss": 1.0 - s / 1000,
               "finished_at": 1.7e9 + s, "timings": {"train_s": 0.5}, **extra}
        if eval_every and s % eval_every == 0:
            row["eval/pass@1"] = round(0.2 + s / 200, 4)
            row["eval/pass@4"] = round(0.3 + s / 200, 4)
        out.append(row)
    return out


def append(path, rows_, tail: str = "") -> None:
    with path.open("a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows_) + tail)


def series(state: CurvesState, pipeline: str) -> dict[str, tuple[list[int], list[float]]]:
    (p,) = [p for p in state.pipelines if p.name == pipeline]
    return {s.name: (s.steps, s.values) for s in p.series}


def test_plotted_series_are_reward_and_every_eval_metric():
    assert curves_mod.PLOTTED == ("reward", "eval/*")
    assert plotted("reward") and plotted("eval/pass@1") and plotted("eval/greedy/accuracy")
    assert not plotted("reward_std") and not plotted("loss") and not plotted("evaluation")


def test_reward_always_eval_only_when_rows_have_it_followed_as_rows_come(tmp_path):
    clock = Clock()
    curves = MetricsCurves(clock)
    path = tmp_path / "p" / "metrics.jsonl"
    curves.watch("p", path)
    # not written yet (no step finished): no series, no error
    state = curves.state()
    assert state.pipelines[0].series == [] and state.pipelines[0].error is None and state.plotted == ["reward", "eval/*"]

    path.parent.mkdir()
    append(path, rows(range(1, 6)))
    clock.t += 1
    got = series(curves.state(), "p")
    assert list(got) == ["reward"]  # no eval rows yet: no eval series
    assert got["reward"] == ([1, 2, 3, 4, 5], [0.01, 0.02, 0.03, 0.04, 0.05])

    # appended rows (evaluation every 2 steps from step 6), one cut short at the end: read once
    # whole, and not before the file is looked at again (MIN_READ_S)
    append(path, rows(range(6, 11), eval_every=2), tail='{"step": 11, "rew')
    assert list(series(curves.state(), "p")) == ["reward"]  # too soon after the last read
    clock.t += 1
    got = series(curves.state(), "p")
    assert list(got) == ["reward", "eval/pass@1", "eval/pass@4"]
    assert got["reward"][0] == list(range(1, 11))
    assert got["eval/pass@1"] == ([6, 8, 10], [0.23, 0.24, 0.25])
    with path.open("a") as fh:  # the cut line finished
        fh.write('ard": 0.5}\n')
    clock.t += 1
    got = series(curves.state(), "p")
    assert got["reward"] == (list(range(1, 12)), [s / 100 for s in range(1, 11)] + [0.5])
    p = curves.state().pipelines[0]
    assert p.rows == 11 and p.last_step == 11


def test_bounded_points_series_and_reads(tmp_path, monkeypatch):
    clock = Clock()
    curves = MetricsCurves(clock)
    path = tmp_path / "metrics.jsonl"
    append(path, rows(range(1, KEEP_POINTS + 51)))
    curves.watch("p", path)
    steps, _ = series(curves.state(points=KEEP_POINTS), "p")["reward"]
    assert steps == list(range(51, KEEP_POINTS + 51))  # the newest KEEP_POINTS kept
    steps, values = series(curves.state(points=10), "p")["reward"]
    assert steps == list(range(KEEP_POINTS + 41, KEEP_POINTS + 51)) and len(values) == 10
    assert curves.state(points=10**9).points == KEEP_POINTS  # asked for more: the most kept

    # a row with many eval metrics grows no more than MAX_SERIES series; odd values are skipped
    wide = {"step": KEEP_POINTS + 51, "reward": float("nan"), **{f"eval/m{i:03d}": i for i in range(100)},
            "eval/flag": True, "eval/text": "x"}
    append(path, [wide])
    clock.t += 1
    got = series(curves.state(), "p")
    assert len(got) == MAX_SERIES and "eval/flag" not in got and "eval/text" not in got
    assert got["reward"][0][-1] == KEEP_POINTS + 50  # nan is not a point

    # a long file is read from its tail, and each refresh reads at most READ_BYTES
    monkeypatch.setattr(curves_mod, "TAIL_BYTES", 4000)
    monkeypatch.setattr(curves_mod, "READ_BYTES", 3000)
    big = tmp_path / "big.jsonl"
    append(big, rows(range(1, 1001)))
    curves.watch("big", big)
    first = series(curves.state(), "big")["reward"][0]
    assert first and first[0] > 900 and len(first) < 40  # only part of the last 4000 bytes so far
    clock.t += 1
    second = series(curves.state(), "big")["reward"][0]
    assert second[-1] == 1000 and second == list(range(second[0], 1001))  # the rest, in order

    # a line over MAX_LINE_BYTES is skipped, the rows after it are read
    monkeypatch.setattr(curves_mod, "MAX_LINE_BYTES", 500)
    append(big, [{"step": 1001, "reward": 1.0, "pad": "x" * 600}, *rows([1002])])
    clock.t += 1
    assert series(curves.state(), "big")["reward"][0][-2:] == [1000, 1002]


def test_a_rewritten_file_is_read_again_and_an_unreadable_one_says_why(tmp_path):
    clock = Clock()
    curves = MetricsCurves(clock)
    path = tmp_path / "metrics.jsonl"
    append(path, rows(range(1, 21)))
    curves.watch("p", path)
    assert series(curves.state(), "p")["reward"][0][-1] == 20
    # a resume from step 12 rewrites the file (steps past the checkpoint dropped), then trains on
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows(range(1, 13))))
    tmp.replace(path)
    append(path, [{**r, "reward": 0.9} for r in rows(range(13, 15))])
    clock.t += 1
    steps, values = series(curves.state(), "p")["reward"]
    assert steps == list(range(1, 15)) and values[-2:] == [0.9, 0.9]

    path.unlink()
    path.mkdir()  # not a file: an error, no crash
    clock.t += 1
    state = curves.state()
    assert state.pipelines[0].error and "metrics.jsonl" in state.pipelines[0].error


def test_feed_answers_the_table_pipelines_curves_and_the_routes_bound_their_input(tmp_path):
    clock = Clock()
    core = SchedulerCore(Topology((2,)), PlannerParams(dwell_s=0.0), clock=clock)
    feed = DashboardFeed(clock=clock)
    feed.start(core)
    for name in ("b", "a"):
        path = tmp_path / name / "metrics.jsonl"
        path.parent.mkdir()
        append(path, rows(range(1, 4), eval_every=2 if name == "a" else None))
        feed.curves.watch(name, path)
        core.register(PipelineSpec(name, train_gpus=1, max_shards=1))
    feed.curves.watch("elsewhere", tmp_path / "x.jsonl")  # not in the table: not answered
    core.replan()
    feed.refresh(core)

    answer = route("/api/curves?points=2", feed.state, feed.curve_state, feed.jobs)
    assert answer.status == 200 and answer.content_type == "application/json"
    state = CurvesState.model_validate_json(answer.body)
    assert [p.name for p in state.pipelines] == ["b", "a"]  # the table's order
    assert list(series(state, "b")) == ["reward"] and list(series(state, "a")) == ["reward", "eval/pass@1", "eval/pass@4"]
    assert series(state, "a")["reward"][0] == [2, 3] and series(state, "a")["eval/pass@1"][0] == [2]
    assert CurvesState.model_validate_json(route("/api/curves", feed.state, feed.curve_state).body).points == 500
    for bad in ("0", "-1", "abc", str(KEEP_POINTS + 1), "9" * 40, "1.5", "%EF%BC%91"):
        bad_answer = route(f"/api/curves?points={bad}", feed.state, feed.curve_state)
        assert bad_answer.status == 400 and b"points" in bad_answer.body, bad
    # a server given no curves or jobs answers them empty
    assert CurvesState.model_validate_json(route("/api/curves", feed.state).body).pipelines == []
    assert JobsState.model_validate_json(route("/api/jobs", feed.state).body).cluster is False

    # under `rlix run` no head feeds the queue
    jobs = JobsState.model_validate_json(route("/api/jobs", feed.state, feed.curve_state, feed.jobs).body)
    assert jobs.cluster is False and jobs.jobs == []


def job(name: str, group: str, at: float, **kw) -> JobRow:
    state = {"waiting": "queued", "running": "running", "ended": "done"}[group]
    return JobRow(name=name, user="u", state=state, group=group, pipelines=["p"], min_gpus=1, max_gpus=2,
                  queue_position=kw.get("queue_position"), reason="", submitted_at=at, started_at=None,
                  ended_at=kw.get("ended_at"))


def test_the_queue_is_bounded_waiting_first_then_running_then_newest_ended():
    feed = DashboardFeed(clock=Clock())
    ended = [job(f"e{i}", "ended", i, ended_at=1000 + i) for i in range(curves_mod.MAX_ENDED_JOBS + 30)]
    feed.set_jobs([job("r1", "running", 5), job("w2", "waiting", 7, queue_position=2), *ended,
                   job("w1", "waiting", 9, queue_position=1)])
    answer = JobsState.model_validate_json(route("/api/jobs", feed.state, feed.curve_state, feed.jobs).body)
    assert answer.cluster is True
    names = [j.name for j in answer.jobs]
    assert names[:3] == ["w1", "w2", "r1"]
    assert len(names) == 3 + curves_mod.MAX_ENDED_JOBS and names[3] == f"e{len(ended) - 1}"  # newest ended first


def test_head_turns_registry_rows_into_queue_rows():
    from rlix.cluster.head import job_row  # deferred: imports Ray
    from rlix.cluster.jobs import Job, PipelineNeeds

    needs = [PipelineNeeds("p1", train_gpus=1, tp=1, min_shards=1, max_shards=2),
             PipelineNeeds("p2", train_gpus=1, tp=2, min_shards=0, max_shards=1)]
    for state, group in (("queued", "waiting"), ("admitted", "running"), ("running", "running"),
                         ("failed", "ended"), ("cancelled", "ended"), ("done", "ended")):
        row = {**Job("j", "alice", needs, state=state, reason="r" * 1000).row(),
               "queue_position": 1 if state == "queued" else None}
        got = job_row(row)
        assert (got.group, got.state, got.user, got.pipelines) == (group, state, "alice", ["p1", "p2"])
        assert (got.min_gpus, got.max_gpus) == (1 + 2, 3 + 3) and len(got.reason) < 400


def test_server_serves_curves_and_jobs(tmp_path):
    clock = Clock()
    core = SchedulerCore(Topology((2,)), PlannerParams(dwell_s=0.0), clock=clock)
    feed = DashboardFeed(clock=clock)
    feed.start(core)
    path = tmp_path / "metrics.jsonl"
    append(path, rows(range(1, 4)))
    feed.curves.watch("a", path)
    core.register(PipelineSpec("a", train_gpus=1, max_shards=1))
    core.replan()
    feed.refresh(core)
    server = DashboardServer(feed.state, feed.curve_state, feed.jobs)
    port = server.serve(0)
    try:
        got = httpx.get(f"http://127.0.0.1:{port}/api/curves?points=2", timeout=10)
        assert got.status_code == 200
        assert got.json()["pipelines"][0]["series"][0] == {"name": "reward", "steps": [2, 3], "values": [0.02, 0.03]}
        assert httpx.get(f"http://127.0.0.1:{port}/api/curves?points=0", timeout=10).status_code == 400
        assert httpx.get(f"http://127.0.0.1:{port}/api/jobs", timeout=10).json()["cluster"] is False
        assert httpx.post(f"http://127.0.0.1:{port}/api/curves", timeout=10).status_code == 405
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=10).text
        assert "/api/curves" in page and "/api/jobs" in page and "src=\"http" not in page
    finally:
        server.close()


def test_scheduler_actor_draws_a_registered_pipelines_metrics_and_the_pushed_queue(tmp_path):
    """Through Ray: the path named at registration is what /api/curves reads; the jobs a head
    pushes are what /api/jobs lists."""
    import ray  # deferred: only this test needs Ray

    from rlix.scheduler.service import start_scheduler

    @ray.remote(num_cpus=0)
    class Coordinator:
        async def resize_inference(self, remove, add):
            return None

    ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, namespace="rlix-dashboard-curves-test",
             logging_level="ERROR", log_to_driver=False)
    try:
        sched = start_scheduler(Topology((2,)), PlannerParams(), dashboard_port=0)
        url = ray.get(sched.dashboard_endpoint.remote())["url"]
        path = tmp_path / "a" / "metrics.jsonl"
        ray.get(sched.register.remote(PipelineSpec("a", train_gpus=1, max_shards=1), Coordinator.remote(),
                                      setting_up=True, metrics_path=str(path)))
        assert httpx.get(url + "api/curves", timeout=10).json()["pipelines"][0]["series"] == []
        path.parent.mkdir()
        append(path, rows(range(1, 4), eval_every=3))
        time.sleep(curves_mod.MIN_READ_S)
        got = httpx.get(url + "api/curves", timeout=10).json()["pipelines"][0]["series"]
        assert [(s["name"], s["steps"]) for s in got] == [("reward", [1, 2, 3]), ("eval/pass@1", [3]),
                                                          ("eval/pass@4", [3])]
        before = httpx.get(url + "api/jobs", timeout=10).json()
        assert before["cluster"] is False and before["jobs"] == []  # no head has pushed any
        ray.get(sched.show_jobs.remote([job("j1", "waiting", 1.0, queue_position=1)]))
        jobs = httpx.get(url + "api/jobs", timeout=10).json()
        assert jobs["cluster"] is True and [j["name"] for j in jobs["jobs"]] == ["j1"]
        ray.kill(sched)
    finally:
        ray.shutdown()
