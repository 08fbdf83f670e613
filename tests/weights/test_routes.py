"""The weight routes against their Protocol, and WeightPath's choice among them, without Ray or
servers: each route says which shards it reaches and leases a version only while it holds it;
the path sends each shard one call through the first route that reaches it, refuses a cache no
shard can read, and names every shard a refit could not move."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

import pytest

from rlix.errors import WeightCacheError, WeightSyncError
from rlix.weights.api import PublishedVersion, ShardTarget, VersionRefs, WeightRoute
from rlix.weights.nodes.node_cache import NodeReplicaRoute
from rlix.weights.refit import DeviceCopyRoute, HostCacheRoute, WeightPath


def refs(version: int, transport: str = "shm", layout: str = "L1") -> VersionRefs:
    messages = tuple({"version": version, "bucket": i, "nbytes": 100, "shm": "seg", "offset": 100 * i}
                     for i in range(3))
    return VersionRefs(version, '{"layout": 1}', layout, transport, messages)


def published(version: int, device: Mapping[int, VersionRefs] | None = None,
              host: VersionRefs | None | str = "shm") -> PublishedVersion:
    return PublishedVersion(version, 3, 300, 0.01, [version], refs(version) if host == "shm" else None,
                            device_refs=dict(device or {}))


class Publisher:
    def __init__(self) -> None:
        self.device: dict[int, VersionRefs] = {}
        self.host: str | None = "shm"
        self.calls: list[tuple[int, bool]] = []

    async def publish(self, version: int, audit: bool = False, on_device: bool = False) -> PublishedVersion:
        self.calls.append((version, on_device))
        return published(version, {r: refs(version, "cuda_ipc") for r in self.device} if on_device else {},
                         self.host)


class Endpoint:
    """A shard's one-call endpoint, in memory: what it was sent, and the version it serves."""

    one_call = True
    log: list[tuple] = []

    def __init__(self, url: str, api_key: str, name: str | None = None) -> None:
        self.url, self.name = url.rstrip("/"), name
        self.last_phases_ms: dict[str, float] = {}

    async def init_transfer(self, info: dict) -> dict:
        if "refuse" in self.url:
            raise RuntimeError("layout refused by the test")
        Endpoint.log.append(("init", self.url, info["layout"], info["transport"]))
        return {}

    async def sync(self, version, layout_id, transfer, messages, wake_up=False) -> int:  # noqa: ANN001
        Endpoint.log.append(("sync", self.url, version, transfer["transport"], len(messages), wake_up))
        self.last_phases_ms = {"total": 1.0}
        return version - 1 if "stale" in self.url else version

    async def aclose(self) -> None:
        return None


@pytest.fixture()
def path() -> WeightPath:
    Endpoint.log = []
    p = WeightPath(Publisher(), api_key="k", trainer_node="node-a")
    p.endpoint_type = Endpoint  # type: ignore[assignment]  # the shards, in memory
    return p


def test_every_route_satisfies_the_protocol_and_says_which_shards_it_reaches() -> None:
    host, device = HostCacheRoute("node-a"), DeviceCopyRoute(1, refs(4, "cuda_ipc"))
    node = NodeReplicaRoute("node-b", trainer=None)
    for route in (host, device, node):
        assert isinstance(route, WeightRoute), route
    assert (host.name, device.name, node.name) == ("host", "device", "node")
    assert host.wake_tags is None and node.wake_tags is None and device.wake_tags == ["weights"]
    here, there, beside = ShardTarget("u"), ShardTarget("u", "node-b"), ShardTarget("u", "node-a", beside=1)
    assert host.reaches(here, 4) and host.reaches(beside, 4) and not host.reaches(there, 4)
    assert node.reaches(there, 4) and not node.reaches(here, 4)
    assert device.reaches(beside, 4) and not device.reaches(beside, 5) and not device.reaches(here, 4)
    assert not device.reaches(ShardTarget("u", beside=0), 4)  # another rank's GPU


def test_the_host_route_leases_only_what_it_holds_and_a_build_waits_for_readers_of_the_older_slot() -> None:
    async def main() -> None:
        host = HostCacheRoute()
        host.add(refs(1))
        host.add(refs(2))
        host.add(refs(3))  # the cache keeps two: version 1's slot was reused
        assert host.versions() == [2, 3]
        with pytest.raises(WeightCacheError, match="not in the trainer's cache"):
            async with host.lease(1):
                pass
        async with host.lease(3) as got:  # the newest: a build never overwrites it
            assert got.version == 3
            await asyncio.wait_for(host.vacate(), 1)
        reading = host.lease(2)
        await reading.__aenter__()  # a refit still reads version 2, whose slot the next build takes
        waiter = asyncio.ensure_future(host.vacate())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await reading.__aexit__(None, None, None)
        await asyncio.wait_for(waiter, 1)

    asyncio.run(main())


def test_the_device_route_leases_its_own_version_only() -> None:
    async def main() -> None:
        device = DeviceCopyRoute(0, refs(7, "cuda_ipc"))
        async with device.lease(7) as got:
            assert got.transport == "cuda_ipc"
        with pytest.raises(WeightCacheError, match="holds version 7, not 8"):
            async with device.lease(8):
                pass

    asyncio.run(main())


def test_the_path_sends_each_shard_one_call_through_the_route_that_reaches_it(path: WeightPath) -> None:
    async def main() -> None:
        path.trainer.device = {0: True}  # type: ignore[attr-defined]
        await path.publish(5, on_device=True)
        assert path.device_ranks == [0]
        report = await path.refit(5, {0: ShardTarget("http://s0", beside=0), 1: ShardTarget("http://s1")},
                                  wake=[0, 1])
        assert report.ranks == [0, 1] and report.reported == {0: 5, 1: 5} and report.route == "device+host"
        syncs = sorted(e for e in Endpoint.log if e[0] == "sync")
        # the shard beside the trainer wakes its weights only; the other wakes everything
        assert syncs == [("sync", "http://s0", 5, "cuda_ipc", 3, ["weights"]), ("sync", "http://s1", 5, "shm", 3, True)]
        assert report.bytes == 2 * 300 and report.shard_phases_ms == {0: {"total": 1.0}, 1: {"total": 1.0}}
        # the layout goes once per shard; a new process at the same rank (new URL) gets it again
        Endpoint.log.clear()
        await path.publish(6)
        assert path.device_ranks == []  # no copy kept this time
        await path.refit(6, {1: ShardTarget("http://s1")})
        await path.refit(6, {1: ShardTarget("http://s1-new")})
        assert [e[:2] for e in Endpoint.log if e[0] == "init"] == [("init", "http://s1-new")]

    asyncio.run(main())


def test_a_refit_names_every_shard_it_could_not_move_and_the_ones_it_moved(path: WeightPath) -> None:
    async def main() -> None:
        await path.publish(2)
        with pytest.raises(WeightSyncError) as err:
            await path.refit(2, {0: ShardTarget("http://ok"), 1: ShardTarget("http://refuse"),
                                 2: ShardTarget("http://stale"), 3: ShardTarget("http://far", node="node-z")})
        assert err.value.succeeded == [0]
        assert set(err.value.failed) == {1, 2, 3}
        assert "layout refused" in err.value.failed[1] and "applied version 1, expected 2" in err.value.failed[2]
        assert err.value.failed[3] == "no weight route reaches it"  # another node, and no replicas here
        with pytest.raises(WeightCacheError, match="version 9 is not in the trainer's cache"):
            await path.refit(9, {0: ShardTarget("http://ok")})

    asyncio.run(main())


def test_publishing_a_cache_no_shard_can_read_is_refused_with_the_room_dev_shm_needs(path: WeightPath) -> None:
    async def main() -> None:
        path.trainer.host = None  # type: ignore[attr-defined]  # /dev/shm could not hold it
        with pytest.raises(WeightCacheError, match=r"not in shared memory .*give /dev/shm that much room"):
            await path.publish(1)

    asyncio.run(main())


def test_shards_on_other_nodes_go_through_that_nodes_replica_route(path: WeightPath) -> None:
    made: list[str] = []

    class Replica:
        name, wake_tags = "node", None

        def __init__(self, node: str) -> None:
            self.node = node

        def reaches(self, target: ShardTarget, version: int) -> bool:
            return target.node == self.node

        @contextlib.asynccontextmanager
        async def lease(self, version: int):  # noqa: ANN201
            yield refs(version)

        async def close(self) -> None:
            return None

    def replica_for(node: str) -> Replica:
        made.append(node)
        return Replica(node)

    async def main() -> None:
        path._replica_for = replica_for  # type: ignore[assignment]
        await path.publish(3)
        targets = {0: ShardTarget("http://a", "node-a"), 1: ShardTarget("http://b1", "node-b"),
                   2: ShardTarget("http://b2", "node-b"), 3: ShardTarget("http://c", "node-c")}
        report = await path.refit(3, targets)
        await path.refit(3, {1: ShardTarget("http://b1", "node-b")})
        assert report.ranks == [0, 1, 2, 3] and report.route == "host+node"
        assert made == ["node-b", "node-c"]  # one replica per node, made once

    asyncio.run(main())
