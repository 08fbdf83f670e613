"""Selective sync: only the named shards move; the others keep serving; no global lock."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlix.errors import WeightUpdateError
from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync

from model_engine import ModelEngine


def state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(64, 96, generator=gen).bfloat16() for i in range(8)}
    out["embed"] = torch.randn(2000, 32, generator=gen)  # 256 KB: split over 64 KB buckets
    return out


def shards(n: int, seed: int = 100, adopt: bool = True) -> tuple[list[ModelEngine], dict[int, InProcessEndpoint]]:
    engines = [ModelEngine({k: v.clone() for k, v in state(seed).items()}, adopt_layouts=adopt)
               for _ in range(n)]
    return engines, {i: InProcessEndpoint(ShardUpdater(e), f"shard{i}") for i, e in enumerate(engines)}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Watched(InProcessEndpoint):
    """Lets the test look at every shard between two buckets of the sync."""

    def __init__(self, inner: InProcessEndpoint, on_push) -> None:  # type: ignore[no-untyped-def]
        super().__init__(inner.updater, inner.name)
        self.on_push = on_push

    async def push(self, message):  # type: ignore[no-untyped-def]
        await super().push(message)
        await self.on_push(message["bucket"])


@pytest.mark.parametrize("adopt", [True, False], ids=["bucket-layout-engine", "per-tensor-engine"])
@pytest.mark.parametrize("transport", ["local", "shm"])
def test_sync_to_ranks_1_and_3_leaves_0_and_2_alone_and_all_keep_answering(transport, adopt):
    engines, endpoints = shards(4, adopt=adopt)
    old = {k: v.clone() for k, v in engines[0].served().items()}
    new = state(7)
    seen: list[tuple[int, int, int, float]] = []  # (bucket, shard, version, fingerprint)

    async def look(bucket: int) -> None:
        await asyncio.sleep(0)
        for i, e in enumerate(engines):
            seen.append((bucket, i, *e.probe()))

    endpoints[1] = Watched(endpoints[1], look)
    with BucketCache.for_model(new, bucket_bytes=64 << 10) as cache:
        cache.build_latest(5, new)
        report = asyncio.run(WeightSync(cache, endpoints, transport).sync(5, [3, 1]))
        assert report.ranks == [1, 3] and report.buckets == cache.layout.num_buckets > 2
    assert [e.weight_version for e in engines] == [0, 5, 0, 5]
    assert equal(engines[1].served(), new) and equal(engines[3].served(), new)
    assert equal(engines[0].served(), old) and equal(engines[2].served(), old)
    # every shard answered between buckets, and with the old weights until finish
    old_print = ModelEngine(old).probe()
    assert {(b, i) for b, i, _, _ in seen} == {(b, i) for b in range(report.buckets) for i in range(4)}
    assert all((v, f) == old_print for _, _, v, f in seen)


def test_syncs_of_two_pipelines_run_concurrently():
    eng_a, eps_a = shards(2, seed=1)
    eng_b, eps_b = shards(2, seed=2)
    inside: set[str] = set()
    overlapped = []

    def tracking(endpoints: dict, tag: str) -> dict:  # type: ignore[type-arg]
        async def hook(bucket: int) -> None:
            inside.add(tag)
            overlapped.append(len(inside) == 2)
            await asyncio.sleep(0.002)
            inside.discard(tag)
        return {r: Watched(ep, hook) for r, ep in endpoints.items()}

    with BucketCache.for_model(state(3), bucket_bytes=32 << 10) as ca, \
            BucketCache.for_model(state(4), bucket_bytes=32 << 10) as cb:
        ca.build_latest(1, state(3))
        cb.build_latest(9, state(4))

        async def both() -> None:
            await asyncio.gather(WeightSync(ca, tracking(eps_a, "a"), "local").sync(1, [0, 1]),
                                 WeightSync(cb, tracking(eps_b, "b"), "local").sync(9, [1]))
        asyncio.run(both())
    assert any(overlapped)  # the two pipelines' buckets interleaved: no global lock
    assert [e.weight_version for e in eng_a] == [1, 1] and [e.weight_version for e in eng_b] == [0, 9]
    assert equal(eng_a[0].served(), state(3)) and equal(eng_b[1].served(), state(4))


def test_a_shard_is_not_synced_twice_at_once_and_unknown_ranks_are_refused():
    engines, endpoints = shards(2)
    gate = asyncio.Event()

    async def wait(bucket: int) -> None:
        await gate.wait()

    endpoints[0] = Watched(endpoints[0], wait)
    with BucketCache.for_model(state(5), bucket_bytes=64 << 10) as cache:
        cache.build_latest(2, state(5))
        sync = WeightSync(cache, endpoints, "local")

        async def main() -> None:
            first = asyncio.create_task(sync.sync(2, [0]))
            await asyncio.sleep(0.05)
            with pytest.raises(WeightUpdateError, match="already being synced"):
                await sync.sync(2, [0, 1])
            await sync.sync(2, [1])  # a different shard is fine meanwhile
            gate.set()
            await first
        asyncio.run(main())
        with pytest.raises(WeightUpdateError, match="no endpoint"):
            asyncio.run(sync.sync(2, [7]))
    assert [e.weight_version for e in engines] == [2, 2]


def test_the_layout_is_sent_once_per_shard():
    engines, endpoints = shards(1)
    calls = []
    ep = endpoints[0]
    real = ep.init_transfer

    async def counted(info):  # type: ignore[no-untyped-def]
        calls.append(len(info["layout"]))
        return await real(info)

    ep.init_transfer = counted  # type: ignore[method-assign]
    with BucketCache.for_model(state(6), bucket_bytes=64 << 10) as cache:
        sync = WeightSync(cache, endpoints, "local")
        for v in (1, 2, 3):
            cache.build_latest(v, state(6 + v))
            cache.promote_active(v)
            asyncio.run(sync.sync(v, [0]))
    assert len(calls) == 1 and engines[0].weight_version == 3
    assert equal(engines[0].served(), state(9))


def test_feeds_the_embedded_engine_through_its_own_update_api(tiny_model_dir):
    """The receiving side drives exactly EngineAPI's start/update/finish on the real engine."""
    from safetensors.torch import load_file

    from rlix.inference.engine.engine import TorchEngine

    engine = TorchEngine.from_pretrained(tiny_model_dir, device="cpu", max_num_seqs=2)
    try:
        base = load_file(str(tiny_model_dir / "model.safetensors"))
        names = {n for n, _ in engine._weights.params.items()}  # the engine's canonical names
        new = {n: (t + 0.5).contiguous() for n, t in base.items() if n in names}
        with BucketCache.for_model(new, bucket_bytes=256 << 10) as cache:
            cache.build_latest(3, new)
            ep = InProcessEndpoint(ShardUpdater(engine), "embedded")
            asyncio.run(WeightSync(cache, {0: ep}, "local").sync(3, [0]))
        assert engine.weight_version == 3
        for n, t in new.items():
            assert torch.equal(engine._weights.params[n].data, t), n
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
