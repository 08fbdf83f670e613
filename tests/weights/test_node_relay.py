"""Cross-node weight sync: the relay into a node's replica cache (pure, over localhost), and a
NodeCacheActor on another node of a 2-node Ray cluster filled from a real TrainerActor."""

from __future__ import annotations

import asyncio

import contextlib
import socket
import threading
import time

import pytest
import torch

from rlix.errors import WeightCacheError, WeightChecksumError, WeightLayoutError, WeightTransferError
from rlix.weights.cache import BucketCache
from rlix.weights.nodes.relay import OK, RelayReceiver, encode_header, send_version
from rlix.weights.wire import bucket_checksum


def state(seed: int, n: int = 6, numel: int = 1 << 18) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(n)}
    out["norm.bias"] = torch.randn(100, generator=gen).bfloat16()
    return out


def trainer_cache(*versions: int, **kw) -> BucketCache:  # type: ignore[no-untyped-def]
    sd = state(0, **kw)
    cache = BucketCache.for_model(sd, bucket_bytes=1 << 20, host="shm")  # ~6 MiB, 7 buckets
    for v in versions:
        cache.build_latest(v, state(v, **kw))
    return cache


class Receiving:
    """A RelayReceiver's receive() running on a thread of its own; result() re-raises its error."""

    def __init__(self, receiver: RelayReceiver, target, **kw) -> None:  # type: ignore[no-untyped-def]
        self.out: dict = {}

        def run() -> None:
            try:
                self.out["ok"] = receiver.receive(target, **kw)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                self.out["err"] = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 30):  # type: ignore[no-untyped-def]
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "receive() did not return"
        if "err" in self.out:
            raise self.out["err"]
        return self.out["ok"]


def relay(cache: BucketCache, version: int, target, **kw):  # type: ignore[no-untyped-def]
    with RelayReceiver("127.0.0.1", 0, timeout_s=10) as rx:
        job = Receiving(rx, target, version=version)
        sent_s = send_version(cache, version, "127.0.0.1", rx.port, timeout_s=10, **kw)
        replica, got = job.result()
    assert sent_s > 0
    return replica, got


def replica_factory(made: list):  # type: ignore[no-untyped-def]
    def make(layout):  # type: ignore[no-untyped-def]
        made.append(BucketCache(layout, host="shm"))
        return made[-1]
    return make


# -- pure: two caches in one process --------------------------------------------------------
def test_relay_fills_a_replica_with_the_same_bytes_and_promotes_it():
    made: list[BucketCache] = []
    with trainer_cache(1, 2) as src:
        replica, got = relay(src, 1, replica_factory(made), checksums=True)
        try:
            assert len(made) == 1 and replica is made[0]  # created from the sender's layout
            assert replica.layout.layout_id == src.layout.layout_id
            assert got.version == 1 and got.bytes == src.layout.total_bytes and got.verified
            assert replica.checksums(1) == src.checksums(1)
            assert replica.active_version == 1 and replica.latest_version == 1
            # the next version goes into the same replica (no factory call), unverified this time
            replica, got = relay(src, 2, replica)
            assert not got.verified and replica.versions() == (1, 2) and replica.active_version == 2
            assert replica.checksums(2) == src.checksums(2) != src.checksums(1)
        finally:
            for c in made:
                c.close()


def test_a_stream_cut_short_is_a_typed_error_and_the_replica_keeps_its_version():
    with trainer_cache(1, 2) as src, BucketCache(src.layout, host="shm") as replica:
        relay(src, 1, replica)
        before = replica.checksums(1)
        with RelayReceiver("127.0.0.1", 0, timeout_s=10) as rx:
            job = Receiving(rx, replica, version=2)
            # a sender that dies half way: header, the go-ahead, half the bytes, gone
            with socket.create_connection(("127.0.0.1", rx.port), timeout=10) as sock:
                sock.sendall(encode_header(src.layout, 2))
                assert sock.recv(5)[0] == OK
                half = src.buckets(2)[0].numpy().tobytes()[: src.layout.bucket_sizes[0] // 2]
                sock.sendall(half)
            with pytest.raises(WeightTransferError) as err:
                job.result()
        msg = str(err.value)
        assert rx.address in msg and "closed" in msg and "bucket 0" in msg and "intact" in msg
        assert replica.versions() == (1,) and replica.active_version == 1
        assert replica.checksums(1) == before  # still serves its previous version
        with replica.lease(1) as buckets:
            assert [bucket_checksum(b) for b in buckets] == src.checksums(1)
        relay(src, 2, replica)  # and takes the next complete stream
        assert replica.checksums(2) == src.checksums(2)


def test_a_stalled_sender_times_out_and_nothing_waits_forever():
    with trainer_cache(1) as src, BucketCache(src.layout, host="shm") as replica:
        with RelayReceiver("127.0.0.1", 0, timeout_s=0.5) as rx:
            # nobody connects: accept gives up
            t0 = time.monotonic()
            with pytest.raises(WeightTransferError, match="no sender connected"):
                rx.receive(replica, accept_timeout_s=0.3)
            assert time.monotonic() - t0 < 5
            job = Receiving(rx, replica, version=1)
            with socket.create_connection(("127.0.0.1", rx.port), timeout=10) as sock:
                sock.sendall(encode_header(src.layout, 1))
                assert sock.recv(5)[0] == OK
                sock.sendall(b"\0" * 1000)  # ... and then nothing
                with pytest.raises(WeightTransferError, match="timed out at bucket 0"):
                    job.result(10)
        assert replica.versions() == ()
        # cancel() ends a receive blocked on accept at once
        with RelayReceiver("127.0.0.1", 0, timeout_s=60) as rx:
            job = Receiving(rx, replica)
            time.sleep(0.1)
            rx.cancel()
            with pytest.raises(WeightTransferError, match="cancelled"):
                job.result(5)


def test_a_receiver_that_dies_mid_stream_fails_the_sender():
    with trainer_cache(1, numel=1 << 20) as src:  # 24 MiB
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]

            def dying_receiver() -> None:
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(10)
                    conn.recv(1 << 16)
                    conn.sendall(b"\0\0\0\0\0")  # status OK, no reason
                    conn.recv(1 << 20)
            t = threading.Thread(target=dying_receiver, daemon=True)
            t.start()
            with pytest.raises(WeightTransferError, match=f"127.0.0.1:{port} failed at"):
                send_version(src, 1, "127.0.0.1", port, timeout_s=10)
            t.join(10)
        with pytest.raises(WeightTransferError, match="cannot connect"):
            send_version(src, 1, "127.0.0.1", port, timeout_s=2)  # nobody listens there now
        # the lease was released: the version can be rebuilt
        src.build_latest(1, state(3, numel=1 << 20))


def test_a_layout_mismatch_is_refused_on_both_ends_before_any_bytes():
    with trainer_cache(1) as src, trainer_cache(1, n=5) as other:
        assert other.layout.layout_id != src.layout.layout_id
        with BucketCache(other.layout, host="shm") as replica:
            relay(other, 1, replica)
            with RelayReceiver("127.0.0.1", 0, timeout_s=10) as rx:
                job = Receiving(rx, replica, version=1)
                with pytest.raises(WeightLayoutError, match="receiver refused"):
                    send_version(src, 1, "127.0.0.1", rx.port, timeout_s=10)
                with pytest.raises(WeightLayoutError, match=rf"{rx.address}.*layout {src.layout.layout_id}"):
                    job.result()
            assert replica.versions() == (1,) and replica.checksums(1) == other.checksums(1)
            # a version other than the one asked for is refused too
            with RelayReceiver("127.0.0.1", 0, timeout_s=10) as rx:
                job = Receiving(rx, replica, version=7)
                with pytest.raises(WeightTransferError, match="version 7 was asked for"):
                    send_version(other, 1, "127.0.0.1", rx.port, timeout_s=10)
                with pytest.raises(WeightTransferError):
                    job.result()


def test_corrupted_bytes_fail_the_checksum_and_leave_the_version_absent():
    with trainer_cache(1) as src, BucketCache(src.layout, host="shm") as replica:
        with RelayReceiver("127.0.0.1", 0, timeout_s=10) as rx:
            job = Receiving(rx, replica, version=1)
            sums = src.checksums(1)
            with socket.create_connection(("127.0.0.1", rx.port), timeout=10) as sock:
                sock.sendall(encode_header(src.layout, 1, [s ^ 1 for s in sums]))
                assert sock.recv(5)[0] == OK
                with contextlib.suppress(OSError):  # the receiver stops reading at bucket 0
                    for b in src.buckets(1):
                        sock.sendall(b.numpy().tobytes())
                with pytest.raises(WeightChecksumError, match="bucket 0 checksum"):
                    job.result()
        assert replica.versions() == ()


def test_write_version_keeps_build_latest_slot_rules():
    with trainer_cache(1) as src, BucketCache(src.layout, host="shm") as replica:
        def copy_of(v: int):  # type: ignore[no-untyped-def]
            return lambda buckets: [d.copy_(s) for d, s in zip(buckets, src.buckets(v))]
        replica.write_version(1, copy_of(1))
        replica.promote_active(1)

        def broken(buckets):  # type: ignore[no-untyped-def]
            buckets[0].fill_(7)
            raise OSError("connection reset")
        with pytest.raises(OSError):
            replica.write_version(2, broken)
        assert replica.versions() == (1,) and replica.latest_version == 1
        assert replica.checksums(1) == src.checksums(1)
        with pytest.raises(WeightCacheError, match="active version"):
            replica.write_version(1, copy_of(1))
        with replica.lease(1):  # a slot being synced is never reused
            replica.write_version(2, copy_of(1))
            replica.promote_active(2)
            with pytest.raises(WeightCacheError, match="sync"):
                replica.write_version(3, copy_of(1))
        assert replica.versions() == (1, 2)


# -- Ray: a replica on another node of a 2-node cluster -------------------------------------
@pytest.fixture
def two_nodes(request):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 1}, "include_dashboard": False})
    request.addfinalizer(cluster.shutdown)
    cluster.add_node(num_cpus=2, resources={"node_b": 1})
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    request.addfinalizer(ray.shutdown)  # runs first: finalizers run last in, first out
    cluster.wait_for_nodes()
    return cluster


@pytest.mark.slow
def test_a_node_cache_on_another_node_holds_the_trainers_bytes(two_nodes, tiny_model_dir):
    import ray

    from rlix.config.models import TrainConfig
    from rlix.training.ranks import TrainerActor
    from rlix.training.ranks import TrainerGroup
    from rlix.weights.api import ShardTarget
    from rlix.weights.nodes.node_cache import NodeCacheActor, NodeReplicaRoute
    from rlix.weights.refit import WeightPath

    from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
    from rlix.inference.fleet.shard_process import ShardProcess

    # an engine server on "node B" (this host), synced from the replica over shared memory
    shard = ShardProcess(make_backend(EngineBackendConfig(
        backend="embedded", model=str(tiny_model_dir), served_model_name="tiny", max_model_len=256)), "key")
    shard.start()
    trainer = TrainerActor.options(resources={"node_a": 0.01}).remote(
        str(tiny_model_dir), TrainConfig(micro_batch_size=4), cpu_threads=1)
    node = NodeCacheActor.options(resources={"node_b": 0.01}).remote(io_timeout_s=20)
    try:
        info = ray.get(trainer.publish.remote(1), timeout=120)
        assert ray.get(trainer.node_id.remote()) != ray.get(node.node_id.remote())
        got = ray.get(node.ensure.remote(1, trainer), timeout=60)
        assert got.transferred and got.version == 1 and got.bytes == info.bytes and got.seconds > 0
        trainer_sums = ray.get(trainer.__ray_call__.remote(lambda self: self.trainer.cache.checksums(1)))
        assert ray.get(node.checksums.remote(1)) == trainer_sums
        again = ray.get(node.ensure.remote(1, trainer), timeout=30)
        assert not again.transferred and ray.get(node.versions.remote()) == (1,)
        # two concurrent asks for a new version: one transfer
        ray.get(trainer.publish.remote(2), timeout=60)
        both = ray.get([node.ensure.remote(2, trainer), node.ensure.remote(2, trainer)], timeout=60)
        assert sorted(r.transferred for r in both) == [False, True]
        assert ray.get(node.versions.remote()) == (1, 2)
        # a version the trainer does not hold: its typed error, promptly, and nothing changes
        with pytest.raises(WeightCacheError, match="not in the cache"):
            ray.get(node.ensure.remote(9, trainer, timeout_s=30), timeout=30)
        assert ray.get(node.versions.remote()) == (1, 2)
        assert ray.get(node.pid.remote()) != ray.get(trainer.pid.remote())
        # the pipeline's weight path refits this node's shard through a replica here (its
        # route fills it), as it refits the trainer's node's shards from the trainer's cache
        shard.wait_ready(120)
        node_b = ray.get(node.node_id.remote())
        route = NodeReplicaRoute(node_b, trainer)

        async def refit():  # noqa: ANN202
            path = WeightPath(TrainerGroup([trainer]), api_key="key", trainer_node=ray.get(trainer.node_id.remote()),
                              replica_for=lambda n: route)
            try:
                await path.publish(3)
                return await path.refit(3, {0: ShardTarget(shard.url, node_b)})
            finally:
                await path.close()

        report = asyncio.run(refit())
        assert report.route == "node" and report.ranks == [0] and report.bytes == info.bytes
        assert report.reported == {0: 3}
        assert [(r["node"], r["version"]) for r in route.replications] == [(node_b, 3)]
    finally:
        shard.stop()
        ray.get([node.close.remote(), trainer.close.remote()], timeout=30)
