"""ShardFleet logic without processes or Ray: a fake launcher and mock shard HTTP."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rlix.errors import EngineStateError
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.router.router import Router


class FakeLauncher:
    def __init__(self, fail: set[int] = frozenset()) -> None:
        self.running: dict[int, int] = {}
        self.fail = fail

    async def start(self, rank: int) -> str:
        if rank in self.fail:
            raise EngineStateError(f"shard {rank} did not start")
        self.running[rank] = 1000 + rank
        return f"http://shard{rank}"

    async def stop(self, rank: int) -> None:
        self.running.pop(rank, None)

    def pids(self) -> dict[int, int]:
        return dict(self.running)


def _fleet(launcher, supports_sleep=True, busy_polls=2, drain_timeout_s=5.0):
    calls: list[tuple[str, str]] = []
    polls = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        calls.append((host, path + ("?" + request.url.query.decode() if request.url.query else "")))
        if path == "/metrics":
            polls["n"] += 1
            running = 1 if polls["n"] <= busy_polls else 0  # a straggler, then drained
            return httpx.Response(200, text=f'vllm:num_requests_running{{engine="0"}} {running}\n'
                                             'vllm:num_requests_waiting{engine="0"} 0\n')
        if path == "/wake_up":
            return httpx.Response(200, json={"status": "awake", "tags": None})
        return httpx.Response(200, json={"status": "ok"})

    router = Router("k")
    client = RemoteInferenceClient(None, {}, "k")
    fleet = ShardFleet(launcher, router, client, supports_sleep=supports_sleep, drain_timeout_s=drain_timeout_s,
                       poll_s=0)
    return fleet, router, client, calls, handler


def _install(client, handler):
    """Answer the client's shard calls with `handler` (an httpx-style request -> response)."""

    async def request(method, base, target, body, headers):  # type: ignore[no-untyped-def]
        r = handler(httpx.Request(method, base + target, content=body, headers=headers))
        return r.status_code, r.content

    client._request = request


def test_preempt_marks_aborts_drains_then_sleeps():
    async def main():
        fleet, router, client, calls, handler = _fleet(FakeLauncher())
        _install(client, handler)
        await fleet.start([0, 1])
        assert router.table.active_ranks() == [0, 1]
        report = (await fleet.sleep_partial([1]))[1]
        states = {s["rank"]: s["state"] for s in await router.shards()}
        assert states == {0: "active", 1: "preempted"}
        await fleet.expand([1])
        assert router.table.active_ranks() == [0, 1]
        await fleet.shutdown()
        return report, calls, fleet

    report, calls, fleet = asyncio.run(main())
    shard1 = [p for h, p in calls if h == "shard1"]
    # abort, then polls (re-aborting the straggler), then sleep; wake on expand
    assert shard1[0] == "/abort_requests" and shard1[-2].startswith("/sleep?level=1")
    assert shard1.count("/abort_requests") == 3 and shard1[-1] == "/wake_up"
    assert report["forced"] is False and report["to_asleep_ms"] >= report["before_sleep_ms"]
    assert not fleet.launcher.running and not fleet.shards


def test_backend_without_sleep_pauses_instead():
    async def main():
        fleet, router, client, calls, handler = _fleet(FakeLauncher(), supports_sleep=False, busy_polls=0)
        _install(client, handler)
        await fleet.start([0])
        await fleet.sleep_partial([0])
        await fleet.wake_up_partial([0])
        await fleet.activate([0])
        return calls

    paths = [p for _, p in asyncio.run(main())]
    assert "/pause?mode=abort" in paths and "/resume" in paths and not any(p.startswith("/sleep") for p in paths)


def test_failed_start_leaves_nothing_behind():
    async def main():
        launcher = FakeLauncher(fail={2})
        fleet, router, client, calls, handler = _fleet(launcher)
        await fleet.start([0])
        with pytest.raises(EngineStateError, match="did not start"):
            await fleet.start([1, 2])
        return launcher, fleet, await router.shards()

    launcher, fleet, shards = asyncio.run(main())
    assert sorted(launcher.running) == [0] and sorted(fleet.shards) == [0] and [s["rank"] for s in shards] == [0]


def test_preempt_without_drain_marks_then_sleeps_with_abort_in_one_call():
    async def main():
        fleet, router, client, calls, handler = _fleet(FakeLauncher())
        fleet.drain_before_sleep = False
        _install(client, handler)
        await fleet.start([0, 1])
        report = (await fleet.sleep_partial([1]))[1]
        states = {s["rank"]: s["state"] for s in await router.shards()}
        return report, calls, states

    report, calls, states = asyncio.run(main())
    assert states == {0: "active", 1: "preempted"}  # marked first: nothing new reaches it
    assert [p for h, p in calls if h == "shard1"] == ["/sleep?level=1&mode=abort"]
    assert report["abort_ms"] == 0 and report["drain_ms"] >= 0 and report["forced"] is False


def test_a_shard_that_does_not_drain_is_paused_by_force():
    """vLLM on CPU (no sleep): requests keep running past the drain timeout, so the pause
    (mode=abort) ends them: the forced path."""
    async def main():
        fleet, router, client, calls, handler = _fleet(FakeLauncher(), supports_sleep=False,
                                                       busy_polls=10**9, drain_timeout_s=0.05)
        _install(client, handler)
        await fleet.start([0])
        report = (await fleet.sleep_partial([0]))[0]
        await fleet.expand([0])
        return report, calls

    report, calls = asyncio.run(main())
    paths = [p for _, p in calls]
    assert report["forced"] is True and report["drain_ms"] >= 50
    assert paths.count("/abort_requests") >= 2  # stragglers re-aborted while draining
    assert "/pause?mode=abort" in paths and "/sleep" not in " ".join(paths)
    assert paths.index("/pause?mode=abort") > max(i for i, p in enumerate(paths) if p == "/metrics")
    assert paths[-1] == "/resume"


def _sleeping_with(memory_of):
    """A handler whose /sleep answers carry `memory_of(n)` (n: the how-many-th sleep)."""
    count = {"n": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/sleep":
            count["n"] += 1
            return httpx.Response(200, json={"status": "sleeping", "memory": memory_of(count["n"])})
        if request.url.path == "/metrics":
            return httpx.Response(200, text='vllm:num_requests_running{engine="0"} 0\n'
                                             'vllm:num_requests_waiting{engine="0"} 0\n')
        return httpx.Response(200, json={"status": "ok"})
    return handler, count


def test_a_sleeping_shards_residue_does_not_fail_its_hand_off_while_its_gpu_has_room() -> None:
    """684 MiB kept by a sleeping shard (over the old fixed 512 MiB allowance) on a GPU with room
    for what it freed: the shard lives on, asleep."""
    gib = 1 << 30
    memory = {"device": "cuda:0", "reserved": 684 << 20, "allocated": 0, "device_free": 70 * gib,
              "device_total": 80 * gib, "freed_bytes": 6 * gib, "at": 0.0}

    async def main():
        fleet, router, client, _, _ = _fleet(FakeLauncher())
        handler, count = _sleeping_with(lambda n: memory)
        _install(client, handler)
        await fleet.start([0])
        fleet.shards[0].gpus = (0,)
        await fleet.sleep_partial([0], level=2)
        return fleet, count

    fleet, count = asyncio.run(main())
    assert 0 in fleet.shards and fleet.shards[0].asleep is True
    assert count["n"] == 1  # held at once: not measured again


def test_a_shard_that_leaves_its_gpu_short_is_measured_again_then_killed_with_the_bytes_named(monkeypatch) -> None:
    import rlix.devices as devices
    monkeypatch.setattr(devices, "RELEASE_RETRY_S", 0.0)  # the retries' spacing is not what is tested
    gib = 1 << 30

    def memory(n: int) -> dict:  # keeps 6 GiB; the GPU has 2 GiB free where it freed 4
        return {"device": "cuda:0", "reserved": 6 * gib, "allocated": 0, "device_free": 2 * gib,
                "device_total": 80 * gib, "freed_bytes": 4 * gib if n == 1 else 0, "at": 0.0}

    async def main():
        from rlix.errors import GpuMemoryError
        launcher = FakeLauncher()
        fleet, router, client, _, _ = _fleet(launcher)
        handler, count = _sleeping_with(memory)
        _install(client, handler)
        await fleet.start([0])
        fleet.shards[0].gpus = (3,)
        with pytest.raises(GpuMemoryError) as err:
            await fleet.sleep_partial([0], level=2)
        return fleet, launcher, count, str(err.value)

    fleet, launcher, count, msg = asyncio.run(main())
    assert 0 not in fleet.shards and 0 not in launcher.running, "killed: its GPU is free"
    assert count["n"] == 4  # the sleep and three more measurements
    for part in ("GPU 3", "shard 0", "6144 MiB", "2.00 GiB", "needs 4.00 GiB"):
        assert part in msg, (part, msg)
