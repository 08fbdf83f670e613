"""The coordinator against real engine servers and a real trainer actor: shards woken by the
scheduler get the newest version before any request reaches them; active ones are refitted in
flight; sleeping ones are not touched."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
import ray

from rlix.config.models import TrainConfig
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.fleet.local_launcher import LocalLauncher
from rlix.inference.router.router import Router
from rlix.inference.router.app import RouterServer
from rlix.pipeline.coordinator import ShardCoordinator
from rlix.weights.api import PublishedVersion
from rlix.weights.refit import WeightPath
from rlix.training.ranks import TrainerActor
from rlix.training.ranks import TrainerGroup
from rlix.training.types import TrainSample

KEY = "coordinator-test"


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


def batch(seed: int) -> list[TrainSample]:
    return [TrainSample([1, 2, 3], [4 + (seed + i) % 7, 5, 6], [-1.0, -1.2, -0.8], 1.0 if i % 2 else -1.0)
            for i in range(4)]


async def greedy(url: str) -> list[int]:
    async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        r = await http.post(f"{url}/inference/v1/generate", json={
            "token_ids": [5, 6, 7], "sampling_params": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("wake_in_sync", [False, True], ids=["wake-then-sync", "wake-in-sync"])
def test_wake_syncs_then_activates_and_publish_refits_only_active_shards(ray_local, tiny_model_dir, wake_in_sync):
    async def main(trainer, path) -> None:  # noqa: ANN001
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        client = RemoteInferenceClient(server.url, {}, KEY, "tiny")
        backend = make_backend(EngineBackendConfig(backend="embedded", model=str(tiny_model_dir),
                                                   served_model_name="tiny", max_model_len=128))
        fleet = ShardFleet(LocalLauncher(backend, KEY), router, client)

        coord = ShardCoordinator(fleet, path, wake_in_sync=wake_in_sync)
        try:
            await coord.start([0, 1], version=0)
            before = await greedy(fleet.shards[0].url)
            await fleet.sleep_partial([0, 1])
            ray.get(trainer.train_step.remote(batch(1)))
            await path.publish(1)
            coord.announce(1)
            await coord.resize_inference([], {0: [0]})
            assert fleet.active_ranks() == [0] and coord.versions == {0: 1, 1: 0}
            kinds = [e.kind for e in coord.stats.events if e.kind != "start"]
            # a stale shard is woken by its own sync call, or by a wake call before it
            assert kinds == (["sync", "activate"] if wake_in_sync else ["wake", "sync", "activate"])
            assert fleet.shards[0].asleep is False and fleet.shards[1].asleep is True
            after = await greedy(fleet.shards[0].url)
            assert after != before  # serving the trained weights
            ray.get(trainer.train_step.remote(batch(2)))
            await path.publish(2)
            assert await coord.publish(2) == [0]  # only the active shard is refitted
            assert coord.versions == {0: 2, 1: 0}
            await coord.resize_inference([0], {1: [1]})  # the scheduler moves the shard
            assert fleet.active_ranks() == [1] and coord.versions == {0: 2, 1: 2}
            assert await greedy(fleet.shards[1].url) != after  # rank 1 got version 2, not 1
            assert coord.history == {0: [0, 1, 2], 1: [0, 2]}
            assert coord.stats.version_mismatches == []
        finally:
            await fleet.shutdown()
            await server.stop()
            await client.aclose()

    _with_trainer(tiny_model_dir, main)


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    """The process has exited (a zombie not yet reaped by its parent counts as exited)."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        time.sleep(0.05)
    return False


def _embedded_fleet(model_dir, launcher_kw: dict | None = None, **fleet_kw):
    """Router, control client, local launcher and fleet over embedded shard processes."""
    router = Router(KEY)
    client = RemoteInferenceClient(None, {}, KEY, "tiny")
    backend = make_backend(EngineBackendConfig(backend="embedded", model=str(model_dir),
                                               served_model_name="tiny", max_model_len=128))
    launcher = LocalLauncher(backend, KEY, **(launcher_kw or {}))
    return router, client, launcher, ShardFleet(launcher, router, client, **fleet_kw)


def _with_trainer(model_dir, main) -> None:  # noqa: ANN001
    """asyncio.run(main(trainer, path)) with a trainer actor and the weight path over it (the
    pipeline's), closed and killed afterwards."""
    trainer = TrainerActor.options(max_concurrency=2).remote(str(model_dir), TrainConfig(lr=0.05),
                                                             seed=0)

    async def run() -> None:
        path = WeightPath(TrainerGroup([trainer]), api_key=KEY)
        try:
            await main(trainer, path)
        finally:
            await path.close()

    try:
        asyncio.run(run())
    finally:
        ray.get(trainer.close.remote())
        ray.kill(trainer)


def test_dead_shard_is_replaced_synced_and_reactivated_or_forgotten(ray_local, tiny_model_dir):
    """SIGKILL a shard server by its PID: an assigned (active) shard gets a new process, synced
    to the latest version and routed to again; a sleeping one is forgotten and started when it
    is given GPUs again. A rank that keeps dying fails the coordinator."""
    import os
    import signal

    from rlix.errors import ShardDiedError

    async def main(trainer, path) -> None:  # noqa: ANN001
        router, client, launcher, fleet = _embedded_fleet(tiny_model_dir)
        coord = ShardCoordinator(fleet, path, wake_in_sync=True, max_restarts=2)
        try:
            await coord.start([0, 1], version=0)
            await fleet.sleep_partial([1])
            await coord.resize_inference([], {0: [0]})  # the scheduler gives rank 0 a GPU
            ray.get(trainer.train_step.remote(batch(1)))
            await path.publish(1)
            await coord.publish(1)
            trained = await greedy(fleet.shards[0].url)
            assert await coord.replace_dead() == []  # all alive: nothing happens

            server, guard = launcher.server_pids()[0], launcher.pids()[0]
            log_dir = launcher.procs[0].log_path.parent
            os.kill(server, signal.SIGKILL)
            assert _wait_gone(guard)  # the guard exits with its server
            assert await coord.replace_dead() == [0]
            assert fleet.active_ranks() == [0] and launcher.server_pids()[0] != server
            assert coord.versions[0] == 1 and coord.history[0][-1] == 1
            assert await greedy(fleet.shards[0].url) == trained  # serves version 1, not the disk's 0
            assert not log_dir.exists()  # the dead process's private log dir is gone
            assert (await router.shards())[0]["state"] == "active"
            assert coord.stats.deaths[0]["exit_code"] is not None and coord.stats.replacements[0]["version"] == 1

            os.kill(launcher.server_pids()[1], signal.SIGKILL)  # asleep, holds no GPU
            assert _wait_gone(launcher.pids()[1])
            assert await coord.replace_dead() == [1]
            assert 1 not in fleet.shards and coord.stats.deaths[-1]["then"].startswith("forgotten")
            await coord.resize_inference([0], {1: [1]})  # given GPUs again: a new process, synced
            assert fleet.active_ranks() == [1] and coord.versions[1] == 1

            # dead while the scheduler takes it back: released by its death, no error
            os.kill(launcher.server_pids()[1], signal.SIGKILL)
            assert _wait_gone(launcher.pids()[1])
            out = await coord.resize_inference([1], {0: [0]})
            assert out["slept"][1]["died"] is True and 1 not in fleet.shards  # dropped, not assigned
            assert fleet.active_ranks() == [0] and coord.versions[0] == 1  # rank 0 started again

            # dead when a new version is published: the refit goes on without it; it is
            # replaced at the new version
            os.kill(launcher.server_pids()[0], signal.SIGKILL)
            assert _wait_gone(launcher.pids()[0])
            ray.get(trainer.train_step.remote(batch(2)))
            await path.publish(2)
            assert await coord.publish(2) == []
            assert await coord.replace_dead() == [] and coord.versions[0] == 2
            assert fleet.active_ranks() == [0] and coord.history[0][-1] == 2

            os.kill(launcher.server_pids()[0], signal.SIGKILL)  # rank 0's third death: over the limit
            assert _wait_gone(launcher.pids()[0])
            with pytest.raises(ShardDiedError, match="shard 0 of shard .* died"):
                await coord.replace_dead()
            assert coord.failed.is_set()
        finally:
            await fleet.shutdown()
            await client.aclose()

    _with_trainer(tiny_model_dir, main)


@pytest.mark.parametrize("restart_on_move", [True, False])
def test_a_dead_shard_given_other_gpus_is_recorded_and_started_anew(ray_local, tiny_model_dir, restart_on_move):
    """Placed shards: one whose process died while asleep is moved to other GPUs. The death is
    recorded (not hidden by the move's restart, nor kept where moves keep the process) and a new
    process serves on the new GPUs at the latest version."""
    import os
    import signal

    async def main(trainer, path) -> None:  # noqa: ANN001
        router, client, launcher, fleet = _embedded_fleet(
            tiny_model_dir, {"placement": lambda gpus: {"RLIX_TEST_GPUS": ",".join(map(str, gpus))}},
            restart_on_move=restart_on_move)
        coord = ShardCoordinator(fleet, path, wake_in_sync=True, placed=True)
        try:
            await path.publish(0)
            await coord.resize_inference([], {0: [0]})
            assert fleet.active_ranks() == [0] and fleet.shards[0].gpus == (0,)
            await coord.resize_inference([0], {})  # taken back: asleep
            server, guard = fleet.server_pids()[0], fleet.pids()[0]
            os.kill(server, signal.SIGKILL)
            assert _wait_gone(guard)
            await coord.resize_inference([], {0: [1]})  # given other GPUs
            assert [d["pid"] for d in coord.stats.deaths] == [guard]
            assert fleet.active_ranks() == [0] and fleet.shards[0].gpus == (1,)
            assert fleet.server_pids()[0] != server and launcher.procs[fleet.shards[0].key].alive()
            assert coord.versions[0] == 0 and await greedy(fleet.shards[0].url)
        finally:
            await fleet.shutdown()
            await client.aclose()

    _with_trainer(tiny_model_dir, main)


def test_a_shard_moved_back_wakes_its_resident_engine_and_is_synced_to_the_latest_version(ray_local, tiny_model_dir):
    """Placed shards: rank 0 serves on GPU 0, moves to GPU 1 (a process starts there: none
    waited), a new version is published while it is away, and it moves back: it takes the
    engine left asleep on GPU 0 (no third process), which is synced to the new version before
    it is routed to."""
    async def main(trainer, path) -> None:  # noqa: ANN001
        router, client, launcher, fleet = _embedded_fleet(
            tiny_model_dir, {"placement": lambda gpus: {"RLIX_TEST_GPUS": ",".join(map(str, gpus))}},
            restart_on_move=True)
        coord = ShardCoordinator(fleet, path, wake_in_sync=True, placed=True)
        try:
            await path.publish(0)
            await coord.resize_inference([], {0: [0]})
            on_gpu0 = fleet.pids()[0]
            await coord.resize_inference([0], {0: [1]})
            on_gpu1 = fleet.pids()[0]
            assert on_gpu1 != on_gpu0 and list(fleet.resident_pids().values()) == [on_gpu0]
            await path.publish(1)
            coord.announce(1)
            await coord.resize_inference([0], {0: [0]})
            assert fleet.pids()[0] == on_gpu0 and list(fleet.resident_pids().values()) == [on_gpu1]
            assert fleet.active_ranks() == [0] and coord.versions[0] == 1
            assert [e.kind for e in coord.stats.events if e.kind in ("start", "rebind")] == ["start", "start", "rebind"]
            assert len(fleet.placements) == 2 and await greedy(fleet.shards[0].url)
        finally:
            await fleet.shutdown()
            await client.aclose()

    _with_trainer(tiny_model_dir, main)


def test_shard_server_ends_when_its_parent_is_sigkilled(tmp_path, tiny_model_dir):
    """A shard's owner killed with SIGKILL: the guard ends the server and removes its private
    log dir; the port is free again."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys

    script = tmp_path / "owner.py"
    script.write_text(f'''
import json, sys, time
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.shard_process import ShardProcess
p = ShardProcess(make_backend(EngineBackendConfig(backend="embedded", model={str(tiny_model_dir)!r},
                 served_model_name="tiny", max_model_len=128)), "k")
p.start(); p.wait_ready()
print(json.dumps({{"guard": p.pid, "server": p.server_pid(), "port": p.port,
                  "log_dir": str(p.log_path.parent)}}), flush=True)
time.sleep(600)
''')
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(owner.stdout.readline())
        assert os.path.isdir(info["log_dir"])
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        assert _wait_gone(info["server"]) and _wait_gone(info["guard"])
        assert not os.path.exists(info["log_dir"])
        with socket.socket() as s:  # the port is free
            s.bind(("127.0.0.1", info["port"]))
    finally:
        owner.kill()
        owner.wait(10)


class TrainerHere:
    """A PolicyTrainer in the test's process with its host cache: a `Publisher` for the weight
    path, as the pipeline's trainer group is. With `on_device`, the CPU stand-in for each
    trainer rank's GPU copy is the host cache itself (the device route then wakes the weights
    only, as it does on a GPU): `ranks` names the ranks said to hold one."""

    def __init__(self, model_dir) -> None:  # noqa: ANN001
        from rlix.training.trainer import PolicyTrainer

        self.trainer = PolicyTrainer(str(model_dir), lr=0.05)
        self.ranks = [0]

    async def publish(self, version: int, audit: bool = False, on_device: bool = False) -> PublishedVersion:
        published = self.trainer.publish(version)
        if on_device:
            return dataclasses.replace(published, device_refs={r: published.refs for r in self.ranks})
        return published

    def close(self) -> None:
        if self.trainer.cache is not None:
            self.trainer.cache.close()


@pytest.fixture()
def here(tiny_model_dir):
    t = TrainerHere(tiny_model_dir)
    yield t
    t.close()


def test_shards_synced_beside_the_trainer_wake_without_a_sync_or_drop_their_weights(ray_local, tiny_model_dir, here):
    """sync_beside_trainer against real engine servers (the CPU stand-in for the trainer's GPU
    copy: the host cache, with the same weights-only wake): the shards asleep on the trainer's
    GPUs get the new version while their KV cache stays asleep; the one the scheduler gives its
    GPU back wakes with no sync; the other is cooled (weights dropped) and synced at its wake."""
    here.ranks = [0, 1]
    routes: list[dict] = []

    class Recorded(WeightPath):
        async def refit(self, version, targets, wake=()):  # noqa: ANN001, ANN202
            report = await super().refit(version, targets, wake)
            routes.append({r: (t.beside, report.route) for r, t in targets.items()})
            return report

    path = Recorded(here, api_key=KEY)

    async def main() -> None:
        router, client, _, fleet = _embedded_fleet(tiny_model_dir)
        coord = ShardCoordinator(fleet, path, wake_in_sync=True, beside_trainer=True)
        http = httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        try:
            await path.publish(0)
            await coord.start([0, 1, 2], version=0)
            await coord.resize_inference([], {0: [0], 1: [1], 2: [2]})
            await coord.resize_inference([0, 1], {})  # the trainer takes GPUs 0 and 1
            here.trainer.train_step(batch(1))
            routes.clear()
            await path.publish(1, on_device=True)
            synced = await coord.sync_beside_trainer(1, trainer_gpus=[0, 1], device_ranks=path.device_ranks)
            # rank i -> the shard on GPU i, from rank i's copy
            assert synced == [0, 1] and routes == [{0: (0, "device"), 1: (1, "device")}]
            assert coord.versions == {0: 1, 1: 1, 2: 0} and coord.warm == {0, 1}
            for r in (0, 1):  # weights at version 1, KV cache still asleep, not routed
                url = fleet.shards[r].url
                assert (await http.get(f"{url}/is_sleeping")).json()["is_sleeping"]
                assert (await http.get(f"{url}/weight_info")).json()["weight_version"] == "1"
            assert fleet.active_ranks() == [2]
            coord.announce(1)
            n = len(coord.stats.events)
            await coord.resize_inference([], {0: [0]})  # the scheduler gives GPU 0 back
            assert [e.kind for e in coord.stats.events[n:]] == ["wake", "activate"]  # no sync
            assert coord.warm == {1}
            assert await coord.cool({0, 2}) == [1]  # GPU 1 went elsewhere: its weights dropped
            r1 = await http.get(f"{fleet.shards[1].url}/weight_checksums")
            assert r1.status_code == 400 and "not loaded" in r1.text
            assert coord.warm == set() and coord.versions[1] is None
            n = len(coord.stats.events)
            await coord.resize_inference([], {1: [1]})  # given a GPU later: synced at its wake
            assert [e.kind for e in coord.stats.events[n:]] == ["sync", "activate"]
            assert routes[-1] == {1: (None, "host")}
            assert coord.versions == {0: 1, 1: 1, 2: 0} and coord.stats.version_mismatches == []
            await path.publish(2)
            assert path.device_ranks == [] and await coord.sync_beside_trainer(2, [0, 1], []) == []  # no GPU copy
        finally:
            await path.close()
            await http.aclose()
            await fleet.shutdown()
            await client.aclose()

    asyncio.run(main())


def test_a_failed_sync_beside_the_trainer_leaves_the_shard_to_the_host_cache(ray_local, tiny_model_dir, here):
    """The device sync raises: nothing is lost; the shard is marked as holding nothing known
    (synced at its wake from the host cache) and its weights, if any came, are cooled when the
    scheduler does not give it its GPU."""
    class NoDeviceRoute(WeightPath):
        async def refit(self, version, targets, wake=()):  # noqa: ANN001, ANN202
            if any(t.beside is not None for t in targets.values()):
                raise RuntimeError("CUDA IPC unavailable")
            return await super().refit(version, targets, wake)

    path = NoDeviceRoute(here, api_key=KEY)

    async def main() -> None:
        _, client, _, fleet = _embedded_fleet(tiny_model_dir)
        coord = ShardCoordinator(fleet, path, wake_in_sync=True, beside_trainer=True)
        try:
            await path.publish(0)
            await coord.start([0], version=0)
            await coord.resize_inference([], {0: [0]})
            await coord.resize_inference([0], {})
            here.trainer.train_step(batch(1))
            await path.publish(1, on_device=True)
            assert await coord.sync_beside_trainer(1, [0], path.device_ranks) == []
            assert coord.versions[0] is None and coord.warm == {0}
            assert fleet.shards[0].asleep is None  # whatever it holds: any sleep asks it
            coord.announce(1)
            n = len(coord.stats.events)
            await coord.resize_inference([], {0: [0]})
            assert [e.kind for e in coord.stats.events[n:]] == ["sync", "activate"]
            assert coord.versions[0] == 1 and coord.warm == set()
        finally:
            await path.close()
            await fleet.shutdown()
            await client.aclose()

    asyncio.run(main())
