"""GPU placement and the memory-safe hand-off, on CPU with Ray's fake GPUs.

A placed process must see exactly the GPU the scheduler gave it (read from its own /proc
environment, not from what we meant to set); Ray must not hand rlix's GPUs to anyone else while
they are reserved; a shard moved to another GPU is a new process there; a shard that cannot
confirm its release is killed, by PID, and named with its GPU; a grant is delivered only after
the previous holder's release confirmation came back.
"""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import time

import pytest
import ray

from rlix import env
from rlix.errors import ConfigError, GpuMemoryError
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import Placed, ShardFleet
from rlix.inference.fleet.local_launcher import LocalLauncher
from rlix.inference.router.router import Router
from rlix.placement import GpuReservation
from rlix.scheduler.async_scheduler import AsyncScheduler
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Progress, Topology

KEY = "placement-test"


@pytest.fixture(scope="module")
def ray_two_gpus():
    ray.shutdown()
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Probe:
    def visible(self) -> str | None:
        return env.visible_devices()


@ray.remote(num_cpus=0, num_gpus=1)
def wants_a_whole_gpu() -> str | None:
    return env.visible_devices()


def test_reservation_places_actors_on_their_gpu_and_keeps_ray_from_giving_it_away(ray_two_gpus):
    reservation = GpuReservation.reserve(Topology.uniform(1, 2))
    try:
        assert [s.gpu for s in reservation.slots] == [0, 1]
        assert sorted(s.physical for s in reservation.slots) == ["0", "1"]
        assert not reservation.has_cuda  # fake GPUs: no /dev/nvidia* here
        for g in (0, 1):
            probe = Probe.options(**reservation.actor_options([g])).remote()
            assert ray.get(probe.visible.remote()) == reservation.slot(g).physical
            assert reservation.visible_devices([g]) == reservation.slot(g).physical
            ray.kill(probe)
        # both GPUs are held by rlix's placement groups: a task outside them cannot get one
        outsider = wants_a_whole_gpu.remote()
        ready, _ = ray.wait([outsider], timeout=3)
        assert ready == []
    finally:
        reservation.release()
    assert ray.get(outsider, timeout=60) in ("0", "1")  # released: Ray may hand it out again


@pytest.mark.gpu
def test_a_cpu_run_on_a_gpu_host_may_have_more_fake_gpus_than_the_host_has(ray_two_gpus):
    """Ray is told of 2 GPUs on a host with one NVIDIA device: a CUDA run is refused naming
    the device count; a CPU run (fake GPUs) reserves both and places nothing on CUDA."""
    devices = len(glob.glob("/dev/nvidia[0-9]*"))
    if devices >= 2:
        pytest.skip("needs a host with fewer NVIDIA devices than the 2 GPUs Ray is told of")
    with pytest.raises(ConfigError, match=f"which has {devices} NVIDIA device"):
        GpuReservation.reserve(Topology.uniform(1, 2))
    reservation = GpuReservation.reserve(Topology.uniform(1, 2), fake=True)
    try:
        assert [s.gpu for s in reservation.slots] == [0, 1]
        assert not reservation.has_cuda
    finally:
        reservation.release()


def _fleet(model_dir, placement, release_timeout_s=None) -> ShardFleet:
    backend = make_backend(EngineBackendConfig(backend="embedded", model=str(model_dir),
                                               served_model_name="tiny", max_model_len=64))
    launcher = LocalLauncher(backend, KEY, placement=placement)
    client = RemoteInferenceClient(None, {}, KEY, "tiny")
    return ShardFleet(launcher, Router(KEY), client, drain_before_sleep=False,
                      release_timeout_s=release_timeout_s, holder="pipeline tiny")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too: it only waits for its parent's wait()
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(") ", 1)[1][0] != "Z"


def test_a_placed_shard_sees_only_its_gpu_and_a_move_leaves_its_engine_resident(tiny_model_dir):
    """A rank moved to another GPU gets a process there (none waited there), while its old one
    stays alive and asleep on GPU 1; moved back, it wakes that one: no third process."""
    physical = {0: "0", 1: "1"}  # what a reservation maps rlix GPUs to on this node

    def placement(gpus):
        return {env.VISIBLE_DEVICES_VAR: ",".join(physical[g] for g in gpus)}

    async def main() -> None:
        fleet = _fleet(tiny_model_dir, placement)
        try:
            assert (await fleet.place({0: [1]})).started == [0]
            first = fleet.pids()[0]
            assert env.process_visible_devices(first) == "1"
            assert await fleet.place({0: [1]}) == Placed([], [])  # already there: the same process
            assert fleet.pids()[0] == first
            await fleet.sleep_partial([0])
            assert (await fleet.place({0: [0]})).started == [0]  # moved: a new process on GPU 0
            second = fleet.pids()[0]
            assert second != first and _alive(first), "the old engine stays, asleep, on GPU 1"
            assert env.process_visible_devices(second) == "0"
            assert list(fleet.resident_pids().values()) == [first]
            await fleet.sleep_partial([0])
            assert await fleet.place({0: [1]}) == Placed([], [0])  # back: the resident engine
            assert fleet.pids()[0] == first and fleet.shards[0].asleep is True
            assert list(fleet.resident_pids().values()) == [second] and _alive(second)
            await fleet.expand([0])  # it wakes (level 1 on CPU: its own weights) and is routed to
            assert fleet.shards[0].asleep is False and fleet.active_ranks() == [0]
            assert not (await fleet.client.is_sleeping([0]))[0]
            assert [(p["rank"], p["gpus"], p["visible_devices"]) for p in fleet.placements] == \
                [(0, [1], "1"), (0, [0], "0")]
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()
        assert not _alive(first) and not _alive(second), "shutdown ends resident engines too"

    asyncio.run(main())


def test_engines_started_at_setup_wait_asleep_and_placing_a_rank_wakes_one(tiny_model_dir):
    """prestart: one engine per GPU, started together and put to sleep; placing ranks there
    takes them (no process start after set-up); a resident engine that dies is forgotten and
    a rank placed there later starts a process, counted as a start after set-up."""
    def placement(gpus):
        return {env.VISIBLE_DEVICES_VAR: ",".join(str(g) for g in gpus)}

    async def main() -> None:
        fleet = _fleet(tiny_model_dir, placement)
        try:
            engines = await fleet.prestart([(0,), (1,)])
            assert sorted(e.gpus for e in engines) == [(0,), (1,)] and len(fleet.resident) == 2
            probe = fleet.client.with_shards({e.key: e.url for e in engines})
            try:
                assert all((await probe.is_sleeping()).values())
            finally:
                await probe.aclose()
            fleet.setup_done = True
            pids = fleet.resident_pids()
            assert await fleet.place({0: [1]}) == Placed([], [0])
            assert fleet.pids()[0] == pids[fleet.shards[0].key]
            await fleet.expand([0])
            assert fleet.active_ranks() == [0]
            # the engine waiting on GPU 0 dies: forgotten; rank 1 placed there starts one
            dead = next(k for k in fleet.resident)
            os.kill(fleet.launcher.server_pids()[dead], signal.SIGKILL)
            assert _wait_dead(fleet.launcher.pids()[dead])
            assert await fleet.dead_ranks() == [] and fleet.resident == {}
            assert (await fleet.place({1: [0]})).started == [1]
            assert fleet.starts_after_setup == 1
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()

    asyncio.run(main())


def test_a_rank_placed_where_another_rank_sleeps_takes_its_engine_not_a_new_process(tiny_model_dir):
    """Ranks are labels: rank 1 placed on GPU 0, where rank 0 was just put to sleep, wakes rank
    0's engine (a second process on that GPU took ~13 s on an H200); rank 0, placed later on GPU
    1, takes the engine waiting there. An awake rank's engine is never taken."""
    def placement(gpus):
        return {env.VISIBLE_DEVICES_VAR: ",".join(str(g) for g in gpus)}

    async def main() -> None:
        fleet = _fleet(tiny_model_dir, placement)
        try:
            await fleet.prestart([(0,), (1,)])
            fleet.setup_done = True
            pids = fleet.resident_pids()
            assert await fleet.place({0: [0]}) == Placed([], [0])
            engine0 = fleet.pids()[0]
            await fleet.expand([0])
            assert (await fleet.place({1: [1]})).resident == [1]
            await fleet.expand([1])
            await fleet.sleep_partial([0])
            assert await fleet.place({2: [0]}) == Placed([], [2])  # rank 0's engine, asleep there
            assert fleet.pids()[2] == engine0 and 0 not in fleet.shards
            assert fleet.starts_after_setup == 0
            # rank 1 is awake on GPU 1: its engine is not taken; rank 0 gets a process there
            assert (await fleet.place({0: [1]})).started == [0]
            assert fleet.pids()[1] in pids.values() and fleet.starts_after_setup == 1
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()

    asyncio.run(main())


def test_engines_started_in_the_background_are_waited_for_never_doubled(tiny_model_dir):
    """prestart_later: set-up goes on while the engines start; a rank placed on a GPU whose
    engine is still starting waits for it (one process there, no start after set-up); a
    shutdown during a background start ends that process too."""
    def placement(gpus):
        return {env.VISIBLE_DEVICES_VAR: ",".join(str(g) for g in gpus)}

    async def main() -> None:
        fleet = _fleet(tiny_model_dir, placement)
        try:
            fleet.prestart_later([(0,), (1,)])
            fleet.setup_done = True
            assert fleet.resident == {}  # returned at once: nothing started yet
            assert await fleet.place({0: [1]}) == Placed([], [0])  # waited for the engine on GPU 1
            await fleet._started_on((0,))  # the other background start, however long it takes here
            assert fleet.starts_after_setup == 0 and len(fleet.placements) == 2
            fleet.prestart_later([(1,), (0,)])  # nothing new: both GPUs have their engine
            assert fleet._starting == {}
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()
        assert fleet.launcher.pids() == {}

        fleet = _fleet(tiny_model_dir, placement)
        try:
            fleet.prestart_later([(0,)])
            await asyncio.sleep(0.5)  # its process runs, not yet healthy
            guards = list(fleet.launcher.pids().values())
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()
        assert guards and fleet.launcher.pids() == {}
        assert all(_wait_dead(pid) for pid in guards), "a start cut by shutdown leaves no process"

    asyncio.run(main())


def test_background_engines_start_once_the_set_up_ones_are_up(tiny_model_dir):
    """prestart(now, background=...): the background engines start when the ones set-up waits
    for are up, and set-up does not wait for them; a background set on a GPU set-up starts
    anyway is left to it (one process there); a rank placed on one waits for it."""
    def placement(gpus):
        return {env.VISIBLE_DEVICES_VAR: ",".join(str(g) for g in gpus)}

    async def main() -> None:
        fleet = _fleet(tiny_model_dir, placement)
        try:
            engines = await fleet.prestart([(0,)], background=[(0,), (1,)])
            assert [e.gpus for e in engines] == [(0,)]
            assert list(fleet._starting) == [(1,)] and fleet.starting_on((1,)) and not fleet.starting_on((0,))
            fleet.setup_done = True
            assert await fleet.place({0: [1]}) == Placed([], [0])  # the background engine
            assert fleet.starts_after_setup == 0 and len(fleet.placements) == 2
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()

    asyncio.run(main())


def _wait_dead(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_move_between_slices_of_one_gpu_keeps_the_process(tiny_model_dir):
    """gpu_slices: 2 (rlix GPUs 0, 1 are device 0; 2, 3 device 1): a shard moved to the other
    slice of its device sees the same device and keeps its process; to another device, a new one."""
    def placement(gpus):
        return {env.VISIBLE_DEVICES_VAR: ",".join(str(g // 2) for g in gpus), env.GPU_MEMORY_SHARE_VAR: "0.5"}

    async def main() -> None:
        fleet = _fleet(tiny_model_dir, placement)
        try:
            assert (await fleet.place({0: [0]})).started == [0]
            first = fleet.pids()[0]
            await fleet.sleep_partial([0])
            assert await fleet.place({0: [1]}) == Placed([], [])  # the other slice of device 0: same process
            assert fleet.pids()[0] == first and fleet.shards[0].gpus == (1,)
            assert (await fleet.place({0: [2]})).started == [0]  # device 1: a new process
            assert fleet.pids()[0] != first and _alive(first)  # the old one waits, asleep
            assert env.process_visible_devices(fleet.pids()[0]) == "1"
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()

    asyncio.run(main())


def test_a_shard_that_cannot_confirm_its_release_is_killed_named_and_forgotten(tiny_model_dir):
    """A hang is handled like a death, not as a failed hand-off: the shard is killed by its PID
    (its GPU is free for the next holder), named in the answer and the memory log, and its rank
    starts anew when it is given GPUs again."""
    async def main() -> None:
        fleet = _fleet(tiny_model_dir, lambda gpus: {env.VISIBLE_DEVICES_VAR: "0"}, release_timeout_s=2.0)
        try:
            await fleet.place({0: [0]})
            await fleet.activate([0])
            pid = fleet.server_pids()[0]
            os.kill(pid, signal.SIGSTOP)  # hung: it will never answer the sleep
            t0 = time.monotonic()
            answer = (await fleet.sleep_partial([0]))[0]
            took = time.monotonic() - t0
            assert 2.0 <= took < 20, took
            assert answer["died"] and answer["pid"] == pid
            message = answer["hung"]
            assert "shard 0 of pipeline tiny on GPU 0" in message and f"pid {pid}" in message
            assert "within 2 s" in message and "hung, killed" in message
            assert fleet.memory_log[-1]["hung"] == message and fleet.memory_log[-1]["gpus"] == [0]
            assert not _alive(pid)  # killed by its PID: the GPU is free for the next holder
            assert 0 not in fleet.shards and 0 not in fleet.pids() and fleet.launcher.pids() == {}
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()

    asyncio.run(main())


def test_a_sleeping_shard_reports_what_it_still_holds(tiny_model_dir):
    async def main() -> None:
        fleet = _fleet(tiny_model_dir, lambda gpus: {env.VISIBLE_DEVICES_VAR: "1"})
        try:
            await fleet.place({0: [1]})
            phases = (await fleet.sleep_partial([0], level=2))[0]
            assert phases["memory"]["reserved"] == 0 and phases["memory"]["device_free"] is None
            row = fleet.memory_log[-1]
            assert row["event"] == "release" and row["gpus"] == [1]
            assert row["holder"] == "shard 0 of pipeline tiny on GPU 1"
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()

    asyncio.run(main())


def test_a_grant_waits_for_the_previous_holders_release_confirmation():
    """B's shard holds the only GPU; A asks to train there. The grant must not come before B's
    coordinator answered the shrink (its release confirmation), however long that takes."""
    timeline: list[tuple[str, float]] = []

    async def main() -> None:
        # b's only shard is its rollout floor: A's training request takes the GPU once it has
        # waited aging_s (1 s here, not the default minute)
        sched = AsyncScheduler(Topology.uniform(1, 1), PlannerParams(aging_s=1.0))

        async def b_resize(remove, add):
            if remove:
                await asyncio.sleep(0.6)  # sleeping and measuring take a while
                timeline.append(("b released", time.monotonic()))
            return {}

        async def a_resize(remove, add):
            return {}

        sched.register(PipelineSpec("b", max_shards=1), b_resize)
        sched.report_progress(Progress("b", remaining=8, target=8, step=0))
        await sched.settle()
        assert sched.core.shard_gpus("b") == {0: (0,)}
        sched.register(PipelineSpec("a", max_shards=1), a_resize)
        granted = await sched.request("a", "train", 1)
        timeline.append(("a granted", time.monotonic()))
        assert granted == [0]
        await sched.close()

    asyncio.run(main())
    assert [name for name, _ in timeline] == ["b released", "a granted"]
    assert timeline[1][1] >= timeline[0][1]


def test_a_wake_that_runs_out_of_gpu_memory_ends_the_pipeline_naming_gpu_and_shard(tiny_model_dir):
    """The sync that wakes a placed shard fails with the engine's out-of-memory error: the
    coordinator ends its process by PID, keeps a GpuMemoryError naming the shard and its GPU as
    the pipeline's failure, and raises it to the scheduler's call."""
    from rlix.pipeline.coordinator import ShardCoordinator

    class OutOfMemory:
        async def refit(self, version, targets, wake=()):  # noqa: ANN001, ANN202
            raise RuntimeError("shard 0: update failed: CUDA out of memory. Tried to allocate 2.00 GiB")

    async def main() -> None:
        fleet = _fleet(tiny_model_dir, lambda gpus: {env.VISIBLE_DEVICES_VAR: "1"})
        coord = ShardCoordinator(fleet, OutOfMemory(), wake_in_sync=True, placed=True)
        try:
            coord.announce(1)  # a newer version than the shard's disk weights: it must sync
            with pytest.raises(GpuMemoryError) as err:
                await coord.resize_inference([], {0: [1]})
            pid = fleet.placements[-1]["pid"]
            assert "shard 0 of pipeline tiny on GPU 1 ran out of GPU memory" in str(err.value)
            assert coord.failure is err.value and coord.failed.is_set()
            assert not _alive(pid) and 0 not in fleet.shards
        finally:
            await fleet.shutdown()
            await fleet.client.aclose()

    asyncio.run(main())
