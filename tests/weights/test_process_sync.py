"""Across processes on CPU: a trainer builds the cache, a receiver process ends up bit-identical."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlix.errors import WeightSyncError
from rlix.weights import BucketCache, WeightSync, named_weights
from pipe_shard import PipeShard

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def tiny_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(torch.bfloat16)


@pytest.fixture(scope="module", params=[True, False], ids=["bucket-layout-engine", "per-tensor-engine"])
def receiver(tmp_path_factory, request):
    """A receiver process serving a differently initialised copy of the model."""
    path = tmp_path_factory.mktemp("recv") / "init.pt"
    torch.save({n: t.clone() for n, t in named_weights(tiny_model(seed=99)).items()}, path)
    proc = PipeShard(str(path), name="shard0", adopt_layouts=request.param)
    yield proc
    proc.close()


def served(proc: PipeShard, tmp_path) -> dict[str, torch.Tensor]:
    return torch.load(proc.call("dump", path=str(tmp_path / "served.pt")))


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name


def test_trainer_to_receiver_process_is_bit_identical_across_versions(receiver, tmp_path):
    model = tiny_model(seed=1)
    with BucketCache.for_model(model, bucket_bytes=64 << 10, host="shm") as cache:
        assert cache.layout.num_buckets > 3
        sync = WeightSync(cache, {0: receiver.endpoint}, "shm", verify=True)
        cache.build_latest(1, model)
        report = asyncio.run(sync.sync(1, [0]))
        assert report.ranks == [0] and receiver.call("version") == 1
        assert_bit_identical(served(receiver, tmp_path),
                             {n: t.clone() for n, t in named_weights(model).items()})
        with torch.no_grad():  # a "training step", then the next version
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        cache.build_latest(2, model)
        cache.promote_active(2)
        asyncio.run(sync.sync(2, [0]))
        assert receiver.call("version") == 2
        assert_bit_identical(served(receiver, tmp_path),
                             {n: t.clone() for n, t in named_weights(model).items()})


def test_random_state_dict_over_a_process_group_broadcast(receiver, tmp_path):
    """The nccl transport's code path (temporary group per sync, fresh TCPStore port, rank-0
    broadcast of each bucket) run with the gloo backend on CPU."""
    gen = torch.Generator().manual_seed(5)
    want = {n: (torch.randn(t.shape, generator=gen) * 3).to(t.dtype)
            for n, t in named_weights(tiny_model(seed=2)).items()}
    with BucketCache.for_model(want, bucket_bytes=96 << 10, host="pageable") as cache:
        cache.build_latest(7, want)
        sync = WeightSync(cache, {0: receiver.endpoint}, "nccl",
                          transport_options={"device": "cpu", "backend": "gloo", "timeout": 60})
        asyncio.run(sync.sync(7, [0]))
        asyncio.run(sync.sync(7, [0]))  # a second group on a new port works
    assert receiver.call("version") == 7
    assert_bit_identical(served(receiver, tmp_path), want)


def test_mismatched_layout_is_refused_by_the_receiver_process(receiver, tmp_path):
    before, version = served(receiver, tmp_path), receiver.call("version")
    other = dict(named_weights(tiny_model(seed=3)))
    other["model.norm.weight"] = torch.zeros(65, dtype=torch.bfloat16)  # wrong shape
    with BucketCache.for_model(other, bucket_bytes=64 << 10, host="shm") as cache:
        cache.build_latest(version + 1, other)
        with pytest.raises(WeightSyncError, match="layout refused.*model.norm.weight: shape") as err:
            asyncio.run(WeightSync(cache, {0: receiver.endpoint}, "shm").sync(version + 1, [0]))
    assert "WeightLayoutError" not in str(err.value) and err.value.failed.keys() == {0}
    assert receiver.call("version") == version
    assert_bit_identical(served(receiver, tmp_path), before)
