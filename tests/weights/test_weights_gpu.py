"""GPU transports: CUDA IPC on one GPU, NCCL to another, the two-bucket memory bound, and the
shm path on CUDA: a page-locked cache, page-locked mappings in the shard, and a level-2 sleep
woken and reloaded in one call into a real engine server process."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest
import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.engine.weights import ALIGN, SEGMENT_GRANULE
from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync, pack
from rlix.weights.transport.shm import ShmReceiver, ShmSender

from model_engine import ModelEngine
from pipe_shard import PipeShard

pytestmark = pytest.mark.gpu

BUCKET = 4 << 20


def state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(512, 1024, generator=gen).bfloat16() for i in range(6)}
    out["embed"] = torch.randn(4096, 512, generator=gen)  # 8 MiB: split over 4 MiB buckets
    out["norm"] = torch.randn(1024, generator=gen).half()
    return out


def bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        g = got[name].cpu()
        assert torch.equal(g, t), name
        assert torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


@pytest.fixture()
def init_state(tmp_path):
    path = tmp_path / "init.pt"
    torch.save({k: torch.zeros_like(v) for k, v in state(0).items()}, path)
    return str(path)


def test_cuda_ipc_same_gpu_is_bit_identical_and_stages_at_most_two_buckets(init_state, tmp_path):
    proc = PipeShard(init_state, device="cuda:0", name="ipc-shard")
    try:
        want = state(1)
        with BucketCache.for_model(want, bucket_bytes=BUCKET) as cache:
            assert cache.host == "pinned_shm"
            cache.build_latest(1, want)
            sync = WeightSync(cache, {0: proc.endpoint}, "cuda_ipc", transport_options={"device": "cuda:0"})
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(0)
            torch.cuda.reset_peak_memory_stats(0)
            asyncio.run(sync.sync(1, [0]))
            peak = torch.cuda.max_memory_allocated(0) - base
        assert proc.call("version") == 1
        bit_identical(torch.load(proc.call("dump", path=str(tmp_path / "out.pt"))), want)
        assert peak <= 2 * BUCKET, f"sender staged {peak} bytes, more than two buckets"
    finally:
        proc.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_to_another_gpu_is_bit_identical_with_a_fresh_group_per_sync(init_state, tmp_path):
    proc = PipeShard(init_state, device="cuda:1", name="nccl-shard")
    try:
        with BucketCache.for_model(state(1), bucket_bytes=BUCKET) as cache:
            sync = WeightSync(cache, {0: proc.endpoint}, "nccl",
                              transport_options={"device": "cuda:0", "timeout": 120})
            for version in (1, 2):  # the second sync builds a new group on a new port
                want = state(version)
                cache.build_latest(version, want)
                cache.promote_active(version)
                asyncio.run(sync.sync(version, [0]))
                assert proc.call("version") == version
                bit_identical(torch.load(proc.call("dump", path=str(tmp_path / "out.pt"))), want)
    finally:
        proc.close()


@pytest.mark.parametrize("adopt", [True, False], ids=["bucket-layout-engine", "per-tensor-engine"])
def test_peak_extra_gpu_memory_of_a_sync_is_at_most_two_buckets(adopt):
    """Cache -> in-process shard on the GPU: the engine's own staging exists before the sync
    (warm-up), so what the sync adds is the double-buffered staging, and split tensors are
    assembled straight into the engine's staging."""
    engine = ModelEngine({k: torch.zeros_like(v) for k, v in state(0).items()}, device="cuda:0",
                         adopt_layouts=adopt)
    ep = InProcessEndpoint(ShardUpdater(engine, device="cuda:0"))
    with BucketCache.for_model(state(1), bucket_bytes=BUCKET) as cache:
        assert any(cache.layout.is_split(i) for i in range(len(cache.layout.entries)))
        sync = WeightSync(cache, {0: ep}, "local", transport_options={"device": "cuda:0"})
        cache.build_latest(1, state(1))
        asyncio.run(sync.sync(1, [0]))  # warm-up: the engine allocates its staging once
        cache.build_latest(2, state(2))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(0)
        torch.cuda.reset_peak_memory_stats(0)
        asyncio.run(sync.sync(2, [0]))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(0) - base
    assert engine.weight_version == 2
    bit_identical(engine.served(), state(2))
    assert peak <= 2 * BUCKET, f"peak extra {peak} bytes = {peak / BUCKET:.2f} buckets"


def test_cache_on_cuda_is_page_locked_shm_and_a_cuda_receiver_locks_each_segment_once():
    want = state(1)
    with BucketCache.for_model(want, bucket_bytes=BUCKET) as cache:
        assert cache.host == "pinned_shm"
        cache.build_latest(1, want)
        assert all(b.is_pinned() for b in cache.buckets(1))
        refs = ShmSender(cache.shm_segments).references(1, cache.buckets(1), None)
        assert refs is not None, "a cache in shared memory needs no staging: one-call sync"
        receiver = ShmReceiver("cuda:0")
        got = [receiver.receive(m) for m in refs]
        assert len(receiver._pinned) == 1 and all(b.is_pinned() for b in got)
        on_gpu = [b.to("cuda:0", non_blocking=True) for b in got]
        torch.cuda.synchronize()
        assert all(torch.equal(g.cpu(), b) for g, b in zip(on_gpu, cache.buckets(1)))
        receiver.close()
        assert not receiver._pinned


def test_a_receiver_dropped_without_close_leaves_no_stale_registration():
    """A registration must end before its mapping goes: otherwise a later mapping at the same
    address inherits it and copies land in the old pages (seen: a cache that stayed zero)."""
    want = state(2)
    on_gpu = {k: v.cuda() for k, v in want.items()}
    for _ in range(3):
        with BucketCache.for_model(want, bucket_bytes=BUCKET) as cache:
            cache.build_latest(1, on_gpu)  # GPU -> page-locked segment
            expected = pack(cache.layout, want)
            assert all(torch.equal(a, b) for a, b in zip(cache.buckets(1), expected))
            receiver = ShmReceiver("cuda:0")
            refs = ShmSender(cache.shm_segments).references(1, cache.buckets(1), None)
            got = [receiver.receive(m).to("cuda:0", non_blocking=True) for m in refs]
            torch.cuda.synchronize()
            assert all(torch.equal(g.cpu(), b) for g, b in zip(got, expected))
            del receiver, got  # never closed: collection must unregister before unmapping
            gc.collect()


async def greedy_tokens(engine: TorchEngine) -> list[int]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    last = None
    async for last in engine.generate(f"g{time.perf_counter_ns()}", [5, 17, 42, 99], params):
        pass
    assert last is not None
    return list(last.token_ids)


def test_level2_reload_lands_in_one_allocation_that_becomes_the_parameters(tiny_model_dir):
    """After a level-2 sleep the reload lands in one allocation in the sender's bucket layout
    (not one per tensor; no extra bucket on the GPU either) and those bytes are the parameters."""
    from safetensors.torch import load_file

    async def main() -> None:
        engine = TorchEngine.from_pretrained(tiny_model_dir, device="cuda", max_num_seqs=4,
                                             max_model_len=128)
        try:
            before = await greedy_tokens(engine)
            sd = load_file(str(tiny_model_dir / "model.safetensors"))
            with BucketCache.for_model(sd, bucket_bytes=256 << 10) as cache:
                cache.build_latest(1, sd)
                sync = WeightSync(cache, {0: InProcessEndpoint(ShardUpdater(engine, device="cuda"))}, "shm")
                await engine.sleep(2)
                await engine.wake_up()
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                await sync.sync(1, [0])
                peak = torch.cuda.max_memory_allocated() - base
            params = list(engine.model.parameters())
            weights = sum(p.numel() * p.element_size() for p in params)
            # the layout (fusion order) covers the model: one store of whole 2 MiB pages holds
            # every parameter; nothing else on the GPU meanwhile
            assert len({p.untyped_storage().data_ptr() for p in params}) == 1
            slack = ALIGN * len(params) + SEGMENT_GRANULE
            assert peak <= weights + slack, f"peak extra {peak}, weights {weights}"
            assert engine.weight_version == 1
            assert await greedy_tokens(engine) == before
        finally:
            engine.close()

    asyncio.run(main())


def test_level2_sleep_then_one_call_wake_and_sync_into_an_engine_server(tiny_model_dir):
    """The real path: engine server on CUDA, /sleep?level=2, then the weight path's refit with
    wake in one /sync_weights call from the page-locked shm cache; output as before."""
    import httpx
    from safetensors.torch import load_file

    from rlix.inference.fleet.backends import EmbeddedBackend, EngineBackendConfig
    from rlix.inference.fleet.shard_process import ShardProcess
    from rlix.weights.api import ShardTarget
    from rlix.weights.refit import WeightPath

    key = "gpu-test-token"
    cfg = EngineBackendConfig(backend="embedded", model=str(tiny_model_dir), device="cuda",
                              max_num_seqs=8, max_model_len=256)
    shard = ShardProcess(EmbeddedBackend(cfg), key)
    sd = load_file(str(tiny_model_dir / "model.safetensors"), device="cuda")
    cache = BucketCache.for_model(sd, bucket_bytes=1 << 20)

    class CachePublisher:  # the trainer's side, here: the state dict into the cache
        async def publish(self, version, audit=False, on_device=False):  # noqa: ANN001, ANN202
            cache.build_latest(version, sd)
            cache.promote_active(version)
            return cache.published(version)

    http = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"})

    def greedy() -> list[int]:
        r = http.post(f"{shard.url}/inference/v1/generate", json={
            "token_ids": [5, 17, 42, 99], "sampling_params": {"temperature": 0.0, "max_tokens": 12,
                                                              "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    async def main() -> None:
        path = WeightPath(CachePublisher(), api_key=key)
        try:
            before = greedy()
            for version in (1, 2, 3):  # both cache slots, the first one twice
                await path.publish(version)
                http.post(f"{shard.url}/sleep", params={"level": 2}).raise_for_status()
                assert http.get(f"{shard.url}/is_sleeping").json()["is_sleeping"]
                report = await path.refit(version, {0: ShardTarget(shard.url)}, wake=[0])
                assert report.bundled and report.route == "host" and report.reported == {0: version}
                assert not http.get(f"{shard.url}/is_sleeping").json()["is_sleeping"]
                assert greedy() == before
        finally:
            await path.close()

    try:
        assert cache.host == "pinned_shm"
        shard.start()
        shard.wait_ready()
        asyncio.run(main())
    finally:
        http.close()
        shard.stop()
        cache.close()


def test_a_shard_asleep_beside_the_trainer_takes_its_gpu_copy_by_cuda_ipc(tiny_model_dir):
    """The trainer still on the GPU packs the new version there (DeviceCopy); the shard asleep
    at level 2 on the same GPU gets it in one /sync_weights call by CUDA IPC (the weight path's
    device route), its weights woken and its KV cache still asleep; it serves exactly the
    trainer's tensors; the trainer's offload frees the copy before measuring the GPU."""
    import httpx

    from rlix.inference.fleet.backends import EmbeddedBackend, EngineBackendConfig
    from rlix.inference.fleet.shard_process import ShardProcess
    from rlix.training.trainer import PolicyTrainer
    from rlix.weights.api import ShardTarget
    from rlix.weights.buckets import tensor_checksums
    from rlix.weights.refit import WeightPath

    key = "gpu-test-token"
    cfg = EngineBackendConfig(backend="embedded", model=str(tiny_model_dir), device="cuda",
                              max_num_seqs=8, max_model_len=256)
    shard = ShardProcess(EmbeddedBackend(cfg), key)
    trainer = PolicyTrainer(str(tiny_model_dir), device="cuda", lr=0.05)  # the shard's dtype

    class Here:  # the trainer's side of the weight path, in this process
        async def publish(self, version, audit=False, on_device=False):  # noqa: ANN001, ANN202
            return trainer.publish(version, on_device)

    http = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}"})

    async def main() -> None:
        path = WeightPath(Here(), api_key=key)
        beside, on_host = {0: ShardTarget(shard.url, beside=trainer.rank)}, {0: ShardTarget(shard.url)}
        try:
            for version in (1, 2):
                with torch.no_grad():  # a different model each version
                    for p in trainer.model.parameters():
                        p.add_(torch.randn_like(p) * 0.01)
                http.post(f"{shard.url}/sleep", params={"level": 2}).raise_for_status()
                await path.publish(version, on_device=True)
                assert path.device_ranks == [trainer.rank] and trainer.device_copy.version == version
                report = await path.refit(version, beside, wake=[0])
                assert report.bundled and report.route == "device" and report.reported == {0: version}
                assert http.get(f"{shard.url}/is_sleeping").json()["is_sleeping"]  # KV still asleep
                served = http.get(f"{shard.url}/weight_checksums").json()
                assert served["checksums"] == tensor_checksums(trainer.state_for_sync())
                # the host cache was filled from the device copy: the same bytes
                assert trainer.cache.checksums(version) == trainer.device_copy.checksums(version)
                http.post(f"{shard.url}/wake_up").raise_for_status()
                assert not http.get(f"{shard.url}/is_sleeping").json()["is_sleeping"]
                if version == 1:  # the host path still works after the IPC one (transport switch)
                    http.post(f"{shard.url}/sleep", params={"level": 2}).raise_for_status()
                    again = await path.refit(version, on_host, wake=[0])
                    assert again.route == "host" and again.reported == {0: version}
                    assert http.get(f"{shard.url}/weight_checksums").json()["checksums"] == served["checksums"]
        finally:
            await path.close()

    try:
        shard.start()
        shard.wait_ready()
        asyncio.run(main())
        allocated = torch.cuda.memory_allocated()
        copy_bytes = trainer.device_copy.nbytes
        trainer.offload()
        assert trainer.device_copy.nbytes == 0
        assert torch.cuda.memory_allocated() <= allocated - copy_bytes
    finally:
        http.close()
        shard.stop()
        if trainer.cache is not None:
            trainer.cache.close()
