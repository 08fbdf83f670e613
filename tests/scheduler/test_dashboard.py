"""The scheduler's dashboard without a browser: the JSON it serves over a SchedulerCore driven by
hand (pipelines table, GPU segments, pipelines that leave or fail, lost GPUs), its routes, the
HTTP server (start, answer, stop, a taken port), the scheduler actor serving it, and the config
field. The page in a real browser: test_dashboard_browser.py (marker `browser`)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before Ray is imported anywhere

import httpx
import pytest

from rlix.scheduler.core import SchedulerCore
from rlix.scheduler.dashboard import (
    PALETTE,
    DashboardFeed,
    DashboardServer,
    DashboardState,
    colours,
    parse_role,
    route,
)
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Progress, Topology


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(nodes=(2, 2)):
    clock = Clock()
    core = SchedulerCore(Topology(nodes), PlannerParams(dwell_s=0.0), clock=clock)
    feed = DashboardFeed(clock=clock)
    feed.start(core)
    return core, clock, feed


def step(core, feed, clock, t, *calls):
    """Advance the clock to `t`, make the calls, plan, refresh the feed (what AsyncScheduler does)."""
    clock.t = t
    for call in calls:
        call()
    core.replan()
    feed.refresh(core)


def tiles(row, window_s):
    """The row's segments cover [-window_s, 0] with no gap or overlap."""
    segs = row.segments
    assert segs[0].start_s == pytest.approx(-window_s) and segs[-1].end_s == pytest.approx(0.0)
    for a, b in zip(segs, segs[1:]):
        assert a.end_s == pytest.approx(b.start_s)
    return segs


def test_table_and_timeline_follow_the_ledger():
    core, clock, feed = make()
    core.register(PipelineSpec("a", priority=1, train_gpus=2, max_shards=4))
    core.register(PipelineSpec("b", train_gpus=1, max_shards=2, seqs_per_shard=4))
    step(core, feed, clock, 100.0)  # both generate on every GPU
    step(core, feed, clock, 110.0, lambda: core.submit_request("a", "train", 2))
    step(core, feed, clock, 120.0, lambda: core.report_progress(Progress("b", remaining=5, target=64, step=3)))
    clock.t = 125.0  # no refresh since 120: what depends on time is computed when asked

    state = feed.state(60)
    assert isinstance(state, DashboardState) and state.gpus_total == 4 and state.gpus_idle == 0
    rows = {r.name: r for r in state.pipelines}
    assert list(rows) == ["a", "b"]
    a, b = rows["a"], rows["b"]
    assert a.state == "train" and a.priority == 1 and len(a.train_gpus) == 2 and a.demand_shards == 4
    assert b.state == "generating" and b.step == 3 and (b.remaining, b.target) == (5, 64)
    assert b.demand_shards == 2  # ceil(5 / 4)
    assert a.colours == colours(0) and b.colours == colours(1)
    assert sorted(a.train_gpus + a.generate_gpus + b.train_gpus + b.generate_gpus) == [0, 1, 2, 3]

    for row in state.gpus:
        segs = tiles(row, 60)
        assert segs[0].role == "idle" and segs[0].reason is None  # before the first plan (at -25 s)
        assert segs[1].start_s == pytest.approx(-25.0) and segs[1].reason == "expand"
        assert (segs[-1].pipeline, segs[-1].role) == (row.pipeline, row.role)
    trained = [g for g in state.gpus if g.role == "train"]
    assert {g.gpu for g in trained} == set(a.train_gpus)
    for g in trained:  # a shard until the grant 15 s ago, then a's training stage
        assert g.segments[-1].start_s == pytest.approx(-15.0) and g.segments[-1].reason == "grant"
        assert g.segments[-2].role == "generate"
    assert state.role_seq == core.role_seq and state.role_seq > 4

    # a narrower window clips; segments ending before it are gone
    narrow = feed.state(10)
    for row in narrow.gpus:
        tiles(row, 10)
    assert all(s.reason is None for row in narrow.gpus for s in row.segments[:1])


def test_a_waiting_request_shows_its_wait_growing():
    core, clock, feed = make(nodes=(2,))
    core.register(PipelineSpec("a", train_gpus=2, max_shards=2))
    core.register(PipelineSpec("b", train_gpus=2, max_shards=2))
    step(core, feed, clock, 100.0)
    step(core, feed, clock, 101.0, lambda: core.submit_request("a", "train", 2))
    step(core, feed, clock, 102.0, lambda: core.submit_request("b", "train", 2))
    rows = {r.name: r for r in feed.state().pipelines}
    # neither is granted yet: each would take the other's last shard (the rollout floor) until aged
    assert [rows[n].state for n in "ab"] == ["waiting", "waiting"]
    assert (rows["a"].waiting_for, rows["a"].waiting_gpus) == ("train", 2)
    assert (rows["a"].waiting_s, rows["b"].waiting_s) == pytest.approx((1.0, 0.0))
    clock.t = 109.5  # no refresh: the waits grow all the same
    rows = {r.name: r for r in feed.state().pipelines}
    assert (rows["a"].waiting_s, rows["b"].waiting_s) == pytest.approx((8.5, 7.5))


def test_pipelines_that_leave_or_fail_stay_listed_with_nothing_held():
    core, clock, feed = make()
    for name in ("a", "b", "c"):
        core.register(PipelineSpec(name, train_gpus=1, max_shards=2))
    step(core, feed, clock, 100.0)
    clock.t = 105.0
    core.unregister("a")
    core.unregister("b", "failure")
    feed.refresh(core, failures=[{"pipeline": "b", "reason": "coordinator actor died", "at": 105.0}])
    rows = {r.name: r for r in feed.state().pipelines}
    assert list(rows) == ["c", "a", "b"]
    assert rows["a"].state == "left" and rows["a"].error is None
    assert rows["b"].state == "failed" and rows["b"].error == "coordinator actor died"
    for name in ("a", "b"):
        assert rows[name].train_gpus == rows[name].generate_gpus == [] and rows[name].demand_shards is None
    # an old failure of a pipeline that came back and then left in peace does not count
    step(core, feed, clock, 110.0, lambda: core.register(PipelineSpec("b", train_gpus=1, max_shards=2)))
    clock.t = 115.0
    core.unregister("b")
    feed.refresh(core, failures=[{"pipeline": "b", "reason": "coordinator actor died", "at": 105.0}])
    rows = {r.name: r for r in feed.state().pipelines}
    assert rows["b"].state == "left"
    # the departed GPUs' segments end with the reason they were given back
    reasons = {s.reason for g in feed.state().gpus for s in g.segments}
    assert {"unregister", "failure"} <= reasons


def test_lost_gpus_are_shown_lost():
    core, clock, feed = make()
    core.register(PipelineSpec("a", train_gpus=1, max_shards=4))
    step(core, feed, clock, 100.0)
    clock.t = 110.0
    core.gpus_lost([2, 3])
    step(core, feed, clock, 110.0)
    clock.t = 120.0
    state = feed.state(60)
    assert state.gpus_lost == 2
    for g in state.gpus:
        segs = tiles(g, 60)
        if g.gpu in (2, 3):
            assert g.role == "lost" and segs[-1].role == "lost" and segs[-1].start_s == pytest.approx(-10.0)
        else:
            assert g.role != "lost"


def test_off_until_started_and_old_changes_dropped():
    clock = Clock()
    core = SchedulerCore(Topology((2,)), PlannerParams(dwell_s=0.0), clock=clock)
    feed = DashboardFeed(clock=clock, keep_s=30.0)
    core.register(PipelineSpec("a", train_gpus=1, max_shards=2))
    core.replan()
    feed.refresh(core)  # not started: nothing kept
    assert feed.state().pipelines == [] and feed.state().gpus == []
    feed.start(core)
    assert [r.name for r in feed.state().pipelines] == ["a"]
    clock.t = 200.0
    core.submit_request("a", "train", 1)
    core.replan()
    feed.refresh(core)
    assert all(c["at"] >= 170.0 for c in feed._frame.changes)  # the ones at 100 are past keep_s
    state = feed.state(1000)  # asked for more than is kept: capped
    assert state.window_s == 30.0
    for g in state.gpus:
        tiles(g, 30.0)


def test_parse_role_and_palette_match_the_png_chart():
    from rlix.timeline.chart import pipeline_colours, shade  # deferred: imports matplotlib

    assert parse_role("idle") == (None, "idle", None)
    assert parse_role("p/x/train") == ("p/x", "train", None)
    assert parse_role("p/generate#3") == ("p", "generate", 3)
    names = [f"p{i}" for i in range(len(PALETTE) + 2)]
    chart = pipeline_colours(names)

    def hexed(rgb):
        return "#" + "".join(f"{round(c * 255):02x}" for c in rgb)

    for i, name in enumerate(names):
        assert colours(i).train == hexed(shade(chart[name], "train"))
        assert colours(i).generate == hexed(shade(chart[name], "generate"))


def test_routes():
    core, clock, feed = make()
    core.register(PipelineSpec("a", train_gpus=1, max_shards=4))
    step(core, feed, clock, 100.0)
    page = route("/", feed.state)
    assert page.status == 200 and page.content_type.startswith("text/html")
    html = page.body.decode()
    assert "/api/state" in html
    # nothing loaded from elsewhere: the machines it runs on may have no network
    assert "src=\"http" not in html and "href=\"http" not in html and "@import" not in html
    state = route("/api/state?window_s=30", feed.state)
    assert state.status == 200 and DashboardState.model_validate_json(state.body).window_s == 30.0
    assert [p["name"] for p in __import__("json").loads(route("/api/pipelines", feed.state).body)] == ["a"]
    assert len(__import__("json").loads(route("/api/gpus", feed.state).body)) == 4
    assert route("/nope", feed.state).status == 404
    for bad in ("abc", "-1", "0", "inf", "nan"):
        answer = route(f"/api/state?window_s={bad}", feed.state)
        assert answer.status == 400 and b"window_s" in answer.body, bad


def test_server_starts_answers_stops_and_a_taken_port_is_an_error():
    core, clock, feed = make()
    core.register(PipelineSpec("a", train_gpus=1, max_shards=4))
    step(core, feed, clock, 100.0)
    server = DashboardServer(feed.state)
    port = server.serve(0)
    try:
        answer = httpx.get(f"http://127.0.0.1:{port}/api/state", timeout=10)
        assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
        assert answer.json()["pipelines"][0]["name"] == "a"
        assert "<svg" not in answer.text and httpx.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/api/state?window_s=x", timeout=10).status_code == 400
        # the port is taken while it serves
        with pytest.raises(OSError):
            DashboardServer(feed.state).serve(port)
    finally:
        server.close()
    assert server.port is None
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/api/state", timeout=2)
    again = DashboardServer(feed.state)  # stopped: the port can be served again (a restart)
    assert again.serve(port) == port
    again.close()


def test_async_scheduler_refreshes_the_feed_at_every_change():
    from rlix.scheduler.async_scheduler import AsyncScheduler  # deferred: asyncio machinery

    async def body():
        s = AsyncScheduler(Topology((2,)), PlannerParams(dwell_s=0.0))
        s.dashboard.start(s.core)

        async def resize(remove, add):
            return None

        s.register(PipelineSpec("a", train_gpus=1, max_shards=2), resize)
        seq = s.dashboard.state().role_seq
        assert [r.name for r in s.dashboard.state().pipelines] == ["a"] and seq > 0
        granted = await asyncio.wait_for(s.request("a", "train", 1), 5)
        state = s.dashboard.state()
        assert state.role_seq > seq and {g.gpu for g in state.gpus if g.role == "train"} == set(granted)
        s.pipeline_failed("a", "test")
        assert s.dashboard.state().pipelines[0].state == "failed"
        await s.close()

    asyncio.run(body())


@pytest.fixture
def local_ray():
    import ray  # deferred: only this test needs Ray

    ray.init(num_cpus=1, num_gpus=2, include_dashboard=False, namespace="rlix-dashboard-test",
             logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def test_scheduler_actor_serves_the_dashboard_and_reports_a_taken_port(local_ray):
    from rlix.scheduler.service import start_scheduler  # deferred: imports Ray

    sched = start_scheduler(Topology((2,)), PlannerParams(), dashboard_port=0)
    endpoint = local_ray.get(sched.dashboard_endpoint.remote())
    assert endpoint["error"] is None and endpoint["url"].startswith("http://127.0.0.1:")
    assert local_ray.get(sched.metrics_endpoint.remote())["url"] is None  # not asked for
    state = httpx.get(endpoint["url"] + "api/state", timeout=10).json()
    assert state["gpus_total"] == 2 and state["pipelines"] == []
    assert "rlix scheduler" in httpx.get(endpoint["url"], timeout=10).text
    local_ray.kill(sched)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sched = start_scheduler(Topology((2,)), PlannerParams(), dashboard_port=port)
        endpoint = local_ray.get(sched.dashboard_endpoint.remote())
        assert endpoint["url"] is None and endpoint["error"].startswith(f"cannot listen on 127.0.0.1:{port}")
        local_ray.get(sched.ping.remote())  # the scheduler works without its page
        local_ray.kill(sched)


def test_config_field_is_checked_by_rlix_check(tmp_path):
    from pydantic import ValidationError

    from rlix.config.models import SchedulerConfig

    assert SchedulerConfig(dashboard_port=0, metrics_port=0).dashboard_port == 0
    assert SchedulerConfig().dashboard_port is None
    with pytest.raises(ValidationError, match="dashboard_port"):
        SchedulerConfig(dashboard_port=70000)
    path = tmp_path / "run.yaml"
    path.write_text("cluster: {nodes: 1, gpus_per_node: 2}\n"
                    "scheduler: {metrics_port: 9100, dashboard_port: 9100}\n"
                    "pipelines:\n  - {name: a, model: tiny, task: {name: pattern, patterns: [z]}}\n")
    out = subprocess.run([sys.executable, "-m", "rlix.cli", "check", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "scheduler.dashboard_port" in lines[0] and "metrics_port" in lines[0]


def test_rlix_up_checks_its_port_flags_before_starting_anything(tmp_path, monkeypatch):
    from rlix.cluster.commands import up  # deferred: the shared cluster's commands import Ray
    from rlix.errors import ConfigError

    monkeypatch.setenv("RLIX_CACHE_DIR", str(tmp_path / "cache"))
    base = dict(num_gpus=1, num_cpus=1, gpu_slices=1, quotas=[], default_quota=None, address=None,
                dwell_s=0.0, aging_s=1.0)
    with pytest.raises(ConfigError, match="--dashboard-port 70000"):
        up(**base, dashboard_port=70000)
    with pytest.raises(ConfigError, match="--metrics-port and --dashboard-port are both 9100"):
        up(**base, metrics_port=9100, dashboard_port=9100)
    assert not (tmp_path / "cache" / "cluster").exists()  # nothing was started
