"""A reload after a level-2 sleep lands in the sender's bucket layout: the engine's parameters
(and its fused q/k/v and gate/up matrices) become views of one store holding the buckets end to
end, each bucket arriving as one copy; the store is freed by the next sleep; a layout that does
not fit leaves the per-tensor path. CPU here; the same code serves CUDA (GPU tests)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from rlix.errors import WeightUpdateError
from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync
from rlix.weights.buckets import fusion_order, named_weights, plan_layout, tensor_checksums

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def engine(tiny_model_dir):
    engine = TorchEngine.from_pretrained(tiny_model_dir, device="cpu", max_num_seqs=4, max_model_len=128)
    yield engine
    engine.close()


def sent_state(model_dir, scale: float = 1.0) -> dict[str, torch.Tensor]:
    sd = load_file(str(model_dir / "model.safetensors"))
    return {n: (t * scale).to(t.dtype) if t.is_floating_point() else t for n, t in sd.items()}


async def greedy(engine: TorchEngine, tag: str) -> list[int]:
    last = None
    async for last in engine.generate(tag, [5, 17, 42, 99], GREEDY):
        pass
    return list(last.token_ids)


def storages(engine: TorchEngine) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in engine.model.parameters()}


def fused_storages(engine: TorchEngine) -> set[int]:
    layers = engine._core.runner.fused.layers
    return {t.untyped_storage().data_ptr() for layer in layers for t in (layer.qkv_w, layer.gate_up_w)}


async def reload(engine: TorchEngine, cache: BucketCache, version: int, updater: ShardUpdater) -> None:
    await engine.sleep(2)
    await engine.wake_up(["weights"])
    sync = WeightSync(cache, {0: InProcessEndpoint(updater)}, "shm")
    report = await sync.sync(version, [0])
    assert not report.failed
    await engine.wake_up(["kv_cache"])


def test_a_reload_lands_in_the_bucket_layout_and_the_next_sleep_frees_it(engine, tiny_model_dir):
    async def main() -> None:
        before = await greedy(engine, "before")
        sd = sent_state(tiny_model_dir)
        updater = ShardUpdater(engine)
        # small buckets: several per tensor group, and the embedding split over buckets
        with BucketCache.for_model(sd, bucket_bytes=64 << 10) as cache:
            assert any(cache.layout.is_split(i) for i in range(len(cache.layout.entries)))
            cache.build_latest(1, sd)
            await reload(engine, cache, 1, updater)
            store = engine._weights.store
            assert store is not None and store.allocated
            assert storages(engine) == {store.flat.untyped_storage().data_ptr()}
            assert await greedy(engine, "after") == before
            # generation fused q/k/v and gate/up as views of the store, not copies
            assert fused_storages(engine) == storages(engine)
            assert engine.weight_version == 1
            sent = tensor_checksums(named_weights(sd))
            served = tensor_checksums(engine.served_weights())
            assert {n: served[n] for n in sent if n in served} == {n: sent[n] for n in sent if n in served}

            # new values land in the same place and serve
            changed = sent_state(tiny_model_dir, scale=0.5)
            cache.build_latest(2, changed)
            await reload(engine, cache, 2, updater)
            assert engine.weight_version == 2
            assert storages(engine) == {store.flat.untyped_storage().data_ptr()}
            want = tensor_checksums(named_weights(changed))
            served = tensor_checksums(engine.served_weights())
            assert all(served[n] == want[n] for n in served if n in want)

            await engine.sleep(2)
            assert not store.allocated  # freed by the sleep, whatever still views it
            assert all(p.numel() == 0 for p in engine.model.parameters())

    asyncio.run(main())


def test_a_failed_reload_frees_what_landed(engine, tiny_model_dir):
    async def main() -> None:
        sd = sent_state(tiny_model_dir)
        updater = ShardUpdater(engine)
        with BucketCache.for_model(sd, bucket_bytes=64 << 10) as cache:
            cache.build_latest(1, sd)
            await engine.sleep(2)
            await engine.wake_up(["weights"])
            endpoint = InProcessEndpoint(updater)
            await endpoint.init_transfer({"layout": cache.layout.to_json(), "transport": "shm"})
            from rlix.weights.transport.shm import ShmSender

            sender = ShmSender()
            with cache.lease(1) as buckets:
                transfer = sender.open(1)
                await endpoint.start(1, cache.layout.layout_id, transfer)
                messages = list(sender.stream(1, buckets, None))
                for message in messages[: len(messages) // 2]:
                    await endpoint.push(message)
                assert engine._weights.store.allocated
                with pytest.raises(WeightUpdateError):
                    await endpoint.finish(1)  # half the buckets never came
            sender.close()
            assert not engine._weights.store.allocated
            with pytest.raises(Exception):
                await greedy(engine, "unloaded")  # nothing loaded, nothing served
            # the next complete reload serves
            await reload(engine, cache, 1, updater)
            assert engine.weight_version == 1

    asyncio.run(main())


def test_a_layout_out_of_fusion_order_still_lands_and_serves_the_same(engine, tiny_model_dir):
    async def main() -> None:
        before = await greedy(engine, "before")
        sd = sent_state(tiny_model_dir)
        layout = plan_layout(named_weights(sd), 64 << 10)  # the model's own order: biases between
        assert list(fusion_order(named_weights(sd))) != [e.name for e in layout.entries]
        with BucketCache(layout) as cache:
            cache.build_latest(1, sd)
            await reload(engine, cache, 1, ShardUpdater(engine))
            assert engine._weights.store is not None
            assert await greedy(engine, "after") == before  # q/k/v concatenated instead

    asyncio.run(main())


def test_a_layout_that_does_not_send_every_parameter_is_not_adopted(engine, tiny_model_dir):
    sd = named_weights(sent_state(tiny_model_dir))
    partial = dict(list(sd.items())[1:])
    assert not engine.adopt_layout(plan_layout(partial))
    renamed = {("x." + n if i == 0 else n): t for i, (n, t) in enumerate(sd.items())}
    assert not engine.adopt_layout(plan_layout(renamed))
    assert engine.adopt_layout(plan_layout(fusion_order(sd)))
