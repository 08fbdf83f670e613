"""Weight sync against the bounds measured in the same run.

CPU (always):
  shm_sync_vs_memcpy   cache -> receiver PROCESS over shared memory, a ~1 GB bf16 model shaped
                       like a transformer, vs one plain copy of the same bytes (torch copy_,
                       best of N each); 1.0 = as fast as a memcpy. Goal >= 0.5.
  per_tensor_overhead  the same sync for 10,000 small tensors vs a few large ones of the same
                       total bytes: time(many) / time(few) - 1 (0.05 = 5% slower). Goal <= 0.05.
                       The receiver keeps its weights in the bucket layout (one copy per bucket);
                       per_tensor_overhead_copying_engine is the same with an engine that stages
                       tensor by tensor through update_weights, as engines commonly do.
--gpu adds (Qwen2-1.5B shapes, bf16; --vocab to shrink the 151,936 vocabulary):
  h2d_sync_vs_pinned_copy         pinned cache -> in-process shard on cuda:0 vs one pinned
                                  host->GPU copy of the same bytes. Goal >= 0.8.
  peak_extra_gpu_bytes_vs_bucket  GPU memory the sync adds at its peak, in buckets. Goal <= 2.
  nccl_sync_vs_broadcast          buckets on cuda:0 (the trainer's packed weights before it
                                  offloads) -> shard process on cuda:1 over a per-sync NCCL
                                  group, vs a raw NCCL broadcast of the same bytes (2 GPUs):
                                  what the transport and protocol cost. Group setup and
                                  teardown are reported apart.
  nccl_cache_sync_vs_h2d_bound    host cache (pinned) -> the same shard: staged to cuda:0 then
                                  broadcast, vs max(pinned H2D copy, raw broadcast); a cache in
                                  host memory cannot beat its own host->GPU copy.
Cross-node (with the CPU part, not with --skip-cpu; alone with --only cross_node), on a 2-node
Ray cluster simulated on this host (ray.cluster_utils.Cluster), a --cross-mib cache of bf16
buckets on node A:
  cross_node_sync_vs_socket       NodeCacheActor.ensure on node B (the version streamed over TCP
                                  by rlix.weights.nodes.relay into B's replica cache) vs a plain socket
                                  copy of the same bytes between an actor on A and one on B
                                  (sendall from one buffer, recv_into one buffer, 1-byte ack).
                                  Medians of --cross-reps runs, the three ways alternating, each
                                  timed from this driver. Goal >= 0.7.
  cross_node_object_store_gbps    the same bytes through Ray's object store (ray.put on A, ray.get
                                  on B), for comparison.
The receiving engine (ModelEngine) stages each update into a second copy of its weights and
flips at finish, so the figures measure the sync (transfer, decode, staging copy), not an
engine's apply. All times are the best of --rounds warm syncs (the receiver has mapped the
cache's segment and allocated its staging); the first sync's time is reported apart.

    .venv/bin/python bench/weight_sync.py          # CPU, under 3 minutes on 2 cores
    python bench/weight_sync.py --gpu              # adds the GPU figures
    .venv/bin/python bench/weight_sync.py --only cross_node   # the cross-node part alone
Ends by printing one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
import tempfile
import time
from datetime import timedelta

import torch

from rlix import env
from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync, unpack

# the receiving side is test scaffolding (a minimal engine in a process of its own)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "weights"))
from model_engine import ModelEngine  # noqa: E402
from pipe_shard import PipeShard, write_spec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.benchkit import Bench  # noqa: E402

env.apply_nccl_defaults()  # this process and every process it starts


def transformer_specs(hidden: int, layers: int, inter: int, vocab: int, kv_dim: int,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Qwen2-like parameter shapes (tied embeddings), in checkpoint order."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"model.embed_tokens.weight": ((vocab, hidden), dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (("input_layernorm.weight", (hidden,)),
                            ("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.q_proj.bias", (hidden,)),
                            ("self_attn.k_proj.weight", (kv_dim, hidden)), ("self_attn.k_proj.bias", (kv_dim,)),
                            ("self_attn.v_proj.weight", (kv_dim, hidden)), ("self_attn.v_proj.bias", (kv_dim,)),
                            ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("post_attention_layernorm.weight", (hidden,)),
                            ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
                            ("mlp.down_proj.weight", (hidden, inter))):
            out[p + name] = (shape, dtype)
    out["model.norm.weight"] = ((hidden,), dtype)
    return out


def nbytes(specs: dict) -> int:  # type: ignore[type-arg]
    total = 0
    for shape, dtype in specs.values():
        n = dtype.itemsize
        for d in shape:
            n *= d
        total += n
    return total


def random_state(specs: dict, device: str = "cpu") -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    gen = torch.Generator(device=device).manual_seed(0)
    return {n: torch.randn(shape, generator=gen, device=device).to(dtype) for n, (shape, dtype) in specs.items()}


def best(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_seconds(total: int, rounds: int) -> float:
    src = torch.empty(total, dtype=torch.uint8).fill_(1)
    dst = torch.empty(total, dtype=torch.uint8).fill_(0)
    t = best(lambda: dst.copy_(src), rounds)
    del src, dst
    return t


def shm_sync_seconds(state: dict[str, torch.Tensor], bucket: int, rounds: int, tmp: str,
                     adopt: bool = True) -> tuple[float, dict]:  # type: ignore[type-arg]
    """Best sync time of `state` from a shm cache into a receiver process (after a warm-up)."""
    spec = write_spec(os.path.join(tmp, "spec.json"), {n: (tuple(t.shape), t.dtype) for n, t in state.items()})
    proc = PipeShard(spec, name="bench-shard", call_timeout=600, adopt_layouts=adopt)
    try:
        with BucketCache.for_model(state, bucket_bytes=bucket, host="shm") as cache:
            cache.build_latest(1, state)
            sync = WeightSync(cache, {0: proc.endpoint}, "shm")
            first = asyncio.run(sync.sync(1, [0]))  # maps the segment, allocates the staging
            times = [asyncio.run(sync.sync(1, [0])).seconds for _ in range(rounds)]
            info = {"buckets": cache.layout.num_buckets, "tensors": len(cache.layout.entries),
                    "first_sync_s": round(first.seconds + first.setup_seconds, 4)}
        return min(times), info
    finally:
        proc.close()


def cpu_figures(args: argparse.Namespace, tmp: str, bench: Bench) -> dict:  # type: ignore[type-arg]
    bench.phase("cpu: a ~1 GB model, memcpy")
    specs = transformer_specs(2048, 9, 5632, 32000, 2048)
    state = random_state(specs)
    total = nbytes(specs)
    t_copy = memcpy_seconds(total, args.rounds)
    bench.phase("cpu: a ~1 GB model, shm sync")
    t_sync, info = shm_sync_seconds(state, args.bucket_mib << 20, args.rounds, tmp)
    del state
    gc.collect()
    # per-tensor overhead: 10,000 small tensors vs 8 big ones, same bytes, same path
    bench.phase("cpu: 10,000 small tensors vs 8 large")
    n_small, per = 10_000, args.small_kib * 1024 // 2
    many = {f"layers.{i}.weight": torch.randn(per).bfloat16() for i in range(n_small)}
    few = {f"block.{i}.weight": torch.randn(n_small * per // 8).bfloat16() for i in range(8)}
    bucket = args.bucket_mib << 20
    t_many, _ = shm_sync_seconds(many, bucket, args.rounds, tmp)
    t_few, _ = shm_sync_seconds(few, bucket, args.rounds, tmp)
    # the same with a receiving engine that stages tensor by tensor (as engines that do not keep
    # their weights in bucket layout do): what per-tensor work costs on this machine
    bench.phase("cpu: the same, a copying engine")
    t_many_c, _ = shm_sync_seconds(many, bucket, args.rounds, tmp, adopt=False)
    t_few_c, _ = shm_sync_seconds(few, bucket, args.rounds, tmp, adopt=False)
    return {
        "shm_sync_vs_memcpy": round(t_copy / t_sync, 3),
        "per_tensor_overhead": round(t_many / t_few - 1, 3),
        "per_tensor_overhead_copying_engine": round(t_many_c / t_few_c - 1, 3),
        "many_tensors_copying_sync_s": round(t_many_c, 4), "few_tensors_copying_sync_s": round(t_few_c, 4),
        "cpu_model_bytes": total, "cpu_sync_s": round(t_sync, 4), "memcpy_s": round(t_copy, 4),
        "cpu_sync_gbps": round(total / t_sync / 1e9, 2), "cpu_buckets": info["buckets"],
        "cpu_tensors": info["tensors"], "cpu_first_sync_s": info["first_sync_s"],
        "small_tensors": n_small, "small_model_bytes": n_small * per * 2,
        "many_tensors_sync_s": round(t_many, 4), "few_tensors_sync_s": round(t_few, 4),
    }


def h2d_seconds(total: int, rounds: int) -> float:
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda:0")

    def copy() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    t = best(copy, rounds)
    del host, dev
    torch.cuda.empty_cache()
    return t


def gpu_local(cache: BucketCache, specs: dict, rounds: int) -> tuple[float, float]:  # type: ignore[type-arg]
    """(best sync seconds, peak extra bytes) cache -> in-process shard on cuda:0."""
    engine = ModelEngine({n: torch.zeros(s, dtype=d, device="cuda:0") for n, (s, d) in specs.items()})
    sync = WeightSync(cache, {0: InProcessEndpoint(ShardUpdater(engine, "cuda:0"))}, "local",
                      transport_options={"device": "cuda:0"})
    asyncio.run(sync.sync(1, [0]))  # warm-up: engine staging allocated once
    times, peaks = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(0)
        torch.cuda.reset_peak_memory_stats(0)
        times.append(asyncio.run(sync.sync(1, [0])).seconds)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated(0) - base)
    want = unpack(cache.layout, cache.buckets(1))
    for name in (next(iter(specs)), "model.norm.weight"):  # spot check: bit-identical
        if not torch.equal(engine.served()[name].cpu(), want[name]):
            raise SystemExit(f"GPU sync delivered wrong bytes for {name}")
    del engine, sync, want
    gc.collect()
    torch.cuda.empty_cache()
    return min(times), max(peaks)


def raw_broadcast_seconds(total: int, rounds: int) -> float:
    """Rank 0 here on cuda:0, rank 1 a helper process on cuda:1: broadcast `total` GPU bytes."""
    from rlix.weights.transport import nccl as nccl_mod

    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=120),
                                       wait_for_workers=False)
    helper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "bcast-peer",
                               "--port", str(store.port), "--bytes", str(total), "--rounds", str(rounds)],
                              env=env.nccl_child_env())
    try:
        torch.cuda.set_device(0)
        group = nccl_mod._make_group("nccl", torch.distributed.PrefixStore("raw", store), 0, 2, 120)
        buf = torch.empty(total, dtype=torch.uint8, device="cuda:0")
        nccl_mod._warm_up(group, torch.device("cuda:0"))

        def once() -> None:
            nccl_mod._broadcast(group, buf).wait()
            torch.cuda.synchronize()
        t = best(once, rounds)
        nccl_mod._destroy(group)
        del buf
        torch.cuda.empty_cache()
        helper.wait(120)
        return t
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()


def bcast_peer(args: argparse.Namespace) -> None:
    from rlix.weights.transport import nccl as nccl_mod

    torch.cuda.set_device(1)
    store = torch.distributed.TCPStore("127.0.0.1", args.port, 2, is_master=False, timeout=timedelta(seconds=120))
    group = nccl_mod._make_group("nccl", torch.distributed.PrefixStore("raw", store), 1, 2, 120)
    buf = torch.empty(args.bytes, dtype=torch.uint8, device="cuda:1")
    nccl_mod._warm_up(group, torch.device("cuda:1"))
    for _ in range(args.rounds):
        nccl_mod._broadcast(group, buf).wait()
        torch.cuda.synchronize()
    nccl_mod._destroy(group)


class DeviceBuckets:
    """The cache's buckets copied onto a GPU, offered to WeightSync like a cache."""

    def __init__(self, cache: BucketCache, version: int, device: str) -> None:
        self.layout = cache.layout
        self.shm_segments = None
        self._buckets = [b.to(device) for b in cache.buckets(version)]

    @contextlib.contextmanager
    def lease(self, version: int):  # type: ignore[no-untyped-def]
        yield self._buckets


def nccl_syncs(source, proc: PipeShard, rounds: int) -> tuple[list, int]:  # type: ignore[no-untyped-def]
    """Warm syncs' reports, and the receiver's peak extra GPU bytes over them."""
    sync = WeightSync(source, {0: proc.endpoint}, "nccl", transport_options={"device": "cuda:0"})
    asyncio.run(sync.sync(1, [0]))  # warm-up: layout adopted, staging allocated
    proc.call("cuda_memory", reset=True)
    base = proc.call("cuda_memory")[0]
    reports = [asyncio.run(sync.sync(1, [0])) for _ in range(rounds)]
    return reports, proc.call("cuda_memory")[1] - base


def gpu_figures(args: argparse.Namespace, tmp: str, bench: Bench) -> dict:  # type: ignore[type-arg]
    bench.phase("gpu: building the pinned cache")
    specs = transformer_specs(1536, 28, 8960, args.vocab, 256)
    total, bucket = nbytes(specs), args.gpu_bucket_mib << 20
    state = random_state(specs, "cuda:0")  # the trainer's weights, on its GPU
    cache = BucketCache.for_model(state, bucket_bytes=bucket, host="pinned")
    cache.build_latest(1, state)
    del state
    torch.cuda.empty_cache()
    out: dict = {"gpu_model_bytes": total, "gpu_params": total // 2, "gpu_bucket_bytes": bucket,
                 "gpu_buckets": cache.layout.num_buckets, "vocab": args.vocab}
    bench.phase("gpu: pinned copy, local sync")
    t_h2d = h2d_seconds(total, args.rounds)
    t_sync, peak = gpu_local(cache, specs, args.rounds)
    out.update(h2d_sync_vs_pinned_copy=round(t_h2d / t_sync, 3),
               peak_extra_gpu_bytes_vs_bucket=round(peak / bucket, 3), h2d_copy_s=round(t_h2d, 4),
               h2d_sync_s=round(t_sync, 4), h2d_gbps=round(total / t_h2d / 1e9, 1),
               h2d_sync_gbps=round(total / t_sync / 1e9, 1))
    bench.log(f"h2d: {json.dumps(out)}")
    if torch.cuda.device_count() >= 2:
        bench.phase("gpu: raw NCCL broadcast")
        t_bcast = raw_broadcast_seconds(total, args.rounds)
        bench.phase("gpu: NCCL syncs to the shard on cuda:1")
        spec = write_spec(os.path.join(tmp, "gpu_spec.json"), specs)
        proc = PipeShard(spec, device="cuda:1", name="nccl-shard", call_timeout=600)
        try:
            from_cache, peak_cache = nccl_syncs(cache, proc, args.rounds)
            on_gpu = DeviceBuckets(cache, 1, "cuda:0")
            from_gpu, peak_gpu = nccl_syncs(on_gpu, proc, args.rounds)
            recv_peak = max(peak_cache, peak_gpu)
            del on_gpu
            torch.cuda.empty_cache()
        finally:
            proc.close()
        t_nccl = min(r.seconds for r in from_gpu)
        t_cache = min(r.seconds for r in from_cache)
        out.update(nccl_sync_vs_broadcast=round(t_bcast / t_nccl, 3),
                   nccl_cache_sync_vs_h2d_bound=round(max(t_bcast, t_h2d) / t_cache, 3),
                   nccl_sync_s=round(t_nccl, 4), nccl_cache_sync_s=round(t_cache, 4),
                   nccl_broadcast_s=round(t_bcast, 4),
                   nccl_group_setup_s=round(min(r.setup_seconds for r in from_gpu), 3),
                   nccl_sender_teardown_s=round(min(r.teardown_seconds for r in from_gpu), 3),
                   nccl_receiver_peak_extra_vs_bucket=round(recv_peak / bucket, 3))
    else:
        out["nccl_sync_vs_broadcast"] = None
        out["nccl_note"] = "needs 2 GPUs"
    cache.close()
    return out


# -- cross-node: a replica on node B filled from a cache on node A --------------------------
def _cross_node_actors():  # type: ignore[no-untyped-def]
    """The bench's actors, defined on first use so that the CPU/GPU parts never import Ray."""
    import ray

    from rlix.weights.nodes import relay

    @ray.remote(num_cpus=0)
    class CacheHolder:
        """Stands in for TrainerActor on node A: a cache of `total` bytes of bf16 tensors;
        publish(v) packs them as version v; send_version is TrainerActor.send_version."""

        def __init__(self, total: int, bucket: int, tensors: int = 16) -> None:
            per = total // tensors // 2
            gen = torch.Generator().manual_seed(0)
            self.state = {f"layers.{i}.weight": torch.randn(per, generator=gen).bfloat16() for i in range(tensors)}
            self.cache = BucketCache.for_model(self.state, bucket_bytes=bucket, host="shm")

        def publish(self, version: int) -> int:
            self.state["layers.0.weight"][0] = float(version)  # each version's bytes differ
            self.cache.build_latest(version, self.state)
            self.cache.promote_active(version)
            return self.cache.layout.total_bytes

        def send_version(self, version: int, host: str, port: int) -> float:
            return relay.send_version(self.cache, int(version), host, int(port))

        def checksums(self, version: int) -> list[int]:
            return self.cache.checksums(version)

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def close(self) -> None:
            self.cache.close()

    @ray.remote(num_cpus=0)
    class SocketPeer:
        """One end of the plain socket copy (and of the object store fetch): one buffer of
        `total` bytes, touched once so that no run pays page faults."""

        def __init__(self, total: int) -> None:
            self.buf = torch.empty(total, dtype=torch.uint8).random_()
            self.view = memoryview(self.buf.numpy()).cast("B")
            self.server = None

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def listen(self) -> tuple[str, int]:
            import socket
            if self.server is not None:
                self.server.close()
            ip = ray.util.get_node_ip_address()
            self.server = socket.create_server((ip, 0))
            return ip, self.server.getsockname()[1]

        def recv(self) -> float:
            self.server.settimeout(60)
            conn, _ = self.server.accept()
            with conn:
                conn.settimeout(60)
                t0, got, n = time.perf_counter(), 0, len(self.view)
                while got < n:
                    k = conn.recv_into(self.view[got: got + relay.CHUNK])
                    if not k:
                        raise ConnectionError("sender closed early")
                    got += k
                conn.sendall(b"k")
            return time.perf_counter() - t0

        def send(self, host: str, port: int) -> float:
            import socket
            t0 = time.perf_counter()
            with socket.create_connection((host, port), timeout=60) as conn:
                for pos in range(0, len(self.view), relay.CHUNK):
                    conn.sendall(self.view[pos: pos + relay.CHUNK])
                if conn.recv(1) != b"k":
                    raise ConnectionError("no ack")
            return time.perf_counter() - t0

        def put(self) -> list:
            return [ray.put(self.buf.numpy())]  # in a list: handed on as a reference, not resolved

        def fetch(self, refs: list) -> int:
            return int(ray.get(refs[0]).nbytes)

    return CacheHolder, SocketPeer


def cross_node_figures(args: argparse.Namespace, bench: Bench) -> dict:  # type: ignore[type-arg]
    import ray
    from ray.cluster_utils import Cluster

    from rlix.weights.nodes.node_cache import NodeCacheActor

    bench.phase("cross-node: starting a 2-node Ray cluster")
    total = args.cross_mib << 20
    store = 3 * total + (64 << 20)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": store, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=store)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        cluster.wait_for_nodes()
        CacheHolder, SocketPeer = _cross_node_actors()
        on_a, on_b = {"resources": {"node_a": 0.01}}, {"resources": {"node_b": 0.01}}
        holder = CacheHolder.options(**on_a).remote(total, args.bucket_mib << 20)
        replica = NodeCacheActor.options(**on_b).remote()
        src, dst = SocketPeer.options(**on_a).remote(total), SocketPeer.options(**on_b).remote(total)
        nbytes_ = ray.get(holder.publish.remote(0), timeout=300)
        a, b, r, h = ray.get([src.node_id.remote(), dst.node_id.remote(), replica.node_id.remote(),
                              holder.node_id.remote()], timeout=300)
        if not (a == h != b == r):
            raise SystemExit("cross-node actors are not on the nodes asked for")

        def relay_once(v: int) -> tuple[float, object]:
            ray.get(holder.publish.remote(v), timeout=300)
            t0 = time.perf_counter()
            res = ray.get(replica.ensure.remote(v, holder), timeout=300)
            return time.perf_counter() - t0, res

        def socket_once() -> float:
            ip, port = ray.get(dst.listen.remote(), timeout=60)
            t0 = time.perf_counter()
            ray.get([dst.recv.remote(), src.send.remote(ip, port)], timeout=300)
            return time.perf_counter() - t0

        def store_once() -> float:
            refs = ray.get(src.put.remote(), timeout=300)
            t0 = time.perf_counter()
            got = ray.get(dst.fetch.remote(refs), timeout=300)
            t = time.perf_counter() - t0
            del refs
            assert got == total
            return t

        warm, reps = 2, args.cross_reps  # the warm-up allocates the replica's two slots
        t_relay, t_sock, t_store, inner, stream, first = [], [], [], [], [], []
        for i in range(warm + reps):
            bench.phase(f"cross-node: rep {i - warm + 1} of {reps}" if i >= warm else f"cross-node: warm-up {i + 1}")
            tr, res = relay_once(i + 1)
            ts = socket_once()
            to = store_once() if args.object_store else None
            if i < warm:
                first.append(tr)
            else:
                t_relay.append(tr)
                t_sock.append(ts)
                inner.append(res.seconds)  # type: ignore[attr-defined]
                stream.append(res.send_seconds)  # type: ignore[attr-defined]
                if to is not None:
                    t_store.append(to)
            bench.log(f"cross-node rep {i - warm if i >= warm else 'warm'}: relay {tr:.4f} s, socket {ts:.4f} s"
                      + (f", object store {to:.4f} s" if to is not None else ""))
        last = warm + reps
        same = ray.get(replica.checksums.remote(last)) == ray.get(holder.checksums.remote(last))
        if not same:
            raise SystemExit("cross-node relay delivered different bytes")
        m_relay, m_sock = statistics.median(t_relay), statistics.median(t_sock)
        out = {
            "cross_node_sync_vs_socket": round(m_sock / m_relay, 3),
            "cross_node_sync_gbps": round(nbytes_ / m_relay / 1e9, 3),
            "cross_node_socket_gbps": round(total / m_sock / 1e9, 3),
            "cross_node_bytes": nbytes_, "cross_node_reps": reps,
            "cross_node_sync_vs_socket_paired": round(statistics.median(s / r for s, r in zip(t_sock, t_relay)), 3),
            "cross_node_sync_s": [round(t, 4) for t in t_relay],
            # inside NodeCacheActor.ensure: asking the trainer to promoted; the stream alone
            # (the sender's connect to the receiver's confirmation)
            "cross_node_sync_inner_s": [round(t, 4) for t in inner],
            "cross_node_sync_stream_s": [round(t, 4) for t in stream],
            "cross_node_socket_s": [round(t, 4) for t in t_sock],
            # the replica allocating (and faulting in) its two shared-memory slots: once per node
            "cross_node_first_syncs_s": [round(t, 4) for t in first],
        }
        if t_store:
            out["cross_node_object_store_gbps"] = round(total / statistics.median(t_store) / 1e9, 3)
            out["cross_node_object_store_s"] = [round(t, 4) for t in t_store]
        ray.get([replica.close.remote(), holder.close.remote()], timeout=60)
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bucket-mib", type=int, default=256)
    p.add_argument("--gpu-bucket-mib", type=int, default=256)
    p.add_argument("--small-kib", type=int, default=100, help="size of each of the 10,000 small tensors")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--only", choices=("cpu", "gpu", "cross_node"), help="run only this part")
    p.add_argument("--cross-mib", type=int, default=512, help="bytes of the cross-node cache, MiB")
    p.add_argument("--cross-reps", type=int, default=5, help="measured cross-node repetitions (>= 5)")
    p.add_argument("--no-object-store", dest="object_store", action="store_false",
                   help="skip the cross-node object store comparison")
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "bcast-peer":
        bcast_peer(args)
        return
    t0 = time.perf_counter()
    figures: dict = {}
    parts = {"cpu": (args.only or "cpu") == "cpu" and not args.skip_cpu,
             "gpu": args.only == "gpu" or (args.gpu and args.only is None),
             "cross_node": args.only == "cross_node" or (args.only is None and not args.skip_cpu)}
    with tempfile.TemporaryDirectory(prefix="rlix-bench-") as tmp, \
            Bench("weight_sync", total=sum(parts.values())) as bench:
        if parts["cpu"]:
            figures.update(cpu_figures(args, tmp, bench))
            bench.advance()
        if parts["gpu"]:
            figures.update(gpu_figures(args, tmp, bench))
            bench.advance()
        if parts["cross_node"]:
            figures.update(cross_node_figures(args, bench))
            bench.advance()
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    for k, v in figures.items():
        print(f"{k:34s} {v}", file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
