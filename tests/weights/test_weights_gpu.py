"""GPU transports: CUDA IPC on one GPU, NCCL to another, and the two-bucket memory bound."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync

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
            assert cache.host == "pinned"
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
