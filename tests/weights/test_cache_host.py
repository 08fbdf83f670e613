"""Where the cache's host memory lives, and what that means for the shm path (CPU side).

With CUDA the cache lives in page-locked shared memory, so the one-call sync still works and
copies run at pinned speed (tests/weights/test_weights_gpu.py); without CUDA nothing changes:
plain shared memory, no page-locking anywhere."""

from __future__ import annotations

import pytest
import torch

from rlix.errors import WeightCacheError
from rlix.inference.engine.weights import ALIGN, ParamSpec, stage_reload
from rlix.weights import cache as cache_mod
from rlix.weights.cache import BucketCache
from rlix.weights.transport.pinning import page_lock
from rlix.weights.transport.shm import ShmReceiver, ShmSender


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64, 64, generator=gen).bfloat16(), "b": torch.randn(300, generator=gen)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_without_cuda_the_cache_is_plain_shm_and_nothing_is_page_locked():
    with BucketCache.for_model(state(), bucket_bytes=8192) as cache:
        assert cache.host == "shm"
        cache.build_latest(1, state())
        assert all(s.pinned is None for s in cache._slots)
        refs = ShmSender(cache.shm_segments).references(1, cache.buckets(1), None)
        assert refs is not None and len(refs) == cache.layout.num_buckets
        assert all(m["lasting"] for m in refs)  # the cache's segments: worth locking on a GPU shard
        sender = ShmSender(cache.shm_segments)
        staged = sender.send(1, 0, torch.zeros(64, dtype=torch.uint8))  # private memory: staged
        assert "lasting" not in staged and staged["shm"].startswith("rlix-s-")
        sender.close()
        receiver = ShmReceiver("cpu")
        got = receiver.receive(refs[0])
        assert torch.equal(got, cache.buckets(1)[0]) and not receiver.pin
        receiver.close()
    assert page_lock(0x1000, 4096, None) is None  # no CUDA: nothing to register with
    with pytest.raises(WeightCacheError, match="needs CUDA"):
        BucketCache.for_model(state(), host="pinned_shm")


def test_auto_on_cuda_prefers_page_locked_shm_and_falls_back_when_dev_shm_is_small(monkeypatch):
    """The decision alone (CUDA availability faked): both versions must fit in /dev/shm."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cache_mod, "shm_available", lambda: 10 << 20)
    assert cache_mod._resolve_host("auto", 8 << 20) == "pinned_shm"
    assert cache_mod._resolve_host("auto", 12 << 20) == "pinned"
    assert cache_mod._resolve_host("shm", 12 << 20) == "shm"  # asked for: kept
    with pytest.raises(WeightCacheError, match="pinned_shm"):
        cache_mod._resolve_host("locked", 1)


def test_reload_staging_is_one_allocation_aligned_disjoint_and_copies_each_bucket_span_once():
    """Tensors viewing one bucket keep their offsets and arrive in one copy of the span; others
    (a split tensor reassembled, a scalar, an empty one) are placed after them; one allocation,
    every view aligned and disjoint, every value as sent."""
    specs = [ParamSpec("a", (5, 3), torch.float32), ParamSpec("b", (7,), torch.bfloat16),
             ParamSpec("c", (), torch.float16), ParamSpec("d", (0, 4), torch.float32),
             ParamSpec("e", (64,), torch.int64), ParamSpec("f", (9,), torch.float32)]
    bucket = torch.zeros(4096 + 64, dtype=torch.uint8)[64:]  # a bucket need not start aligned
    at = {"a": 0, "b": 256, "e": 1024, "f": 2048}
    sent = {}
    for spec in specs:
        if spec.name in at:
            n = spec.numel * spec.dtype.itemsize
            t = bucket[at[spec.name]: at[spec.name] + n].view(spec.dtype).view(spec.shape)
            t.copy_(torch.arange(spec.numel).reshape(spec.shape).to(spec.dtype) + 3)
        else:
            t = torch.ones(spec.shape, dtype=spec.dtype)
        sent[spec.name] = t
    staged = stage_reload([(s, sent[s.name]) for s in specs], torch.device("cpu"))
    assert [(tuple(staged[s.name].shape), staged[s.name].dtype) for s in specs] == [(s.shape, s.dtype) for s in specs]
    assert all(torch.equal(staged[n], sent[n]) for n in sent)
    assert len({v.untyped_storage().data_ptr() for v in staged.values()}) == 1
    base = staged["a"].untyped_storage().data_ptr()
    spans = sorted((v.data_ptr() - base, v.data_ptr() - base + v.numel() * v.element_size())
                   for v in staged.values() if v.numel())
    assert all(start % ALIGN == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    # the bucket's tensors kept their relative offsets (one span copy), the others follow it
    assert {n: staged[n].data_ptr() - staged["a"].data_ptr() for n in at} == at
    assert staged["c"].data_ptr() - base >= 2048 + 36
