"""The versioned host cache: memory guard, at most two versions, slots reused, leases."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlix.errors import HostMemoryError, WeightCacheError, WeightUpdateError
from rlix.weights.buckets import named_weights, unpack
from rlix.weights.cache import BucketCache
from rlix.weights.wire import SHM_DIR


def state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(128, 64, generator=gen), "b": torch.randn(1000, generator=gen).bfloat16()}


def fake_meminfo(tmp_path, available_kib: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {available_kib} kB\n")
    return str(path)


def test_cache_that_does_not_fit_is_refused_up_front_with_the_numbers(tmp_path):
    sd = {"w": torch.zeros(1 << 20)}  # 4 MiB per version, 8 MiB for two
    with pytest.raises(HostMemoryError) as err:
        BucketCache.for_model(sd, host="pageable", meminfo=fake_meminfo(tmp_path, 6 * 1024))
    msg = str(err.value)
    assert "up front" in msg and "2 version(s)" in msg
    assert str(8 << 20) in msg and str(6 << 20) in msg and "MemAvailable" in msg
    # fits: accepted, and the second slot is checked again when it is allocated
    cache = BucketCache.for_model(sd, host="pageable", meminfo=fake_meminfo(tmp_path, 9 * 1024))
    cache.build_latest(1, sd)
    fake_meminfo(tmp_path, 1024)  # memory got tight meanwhile
    with pytest.raises(HostMemoryError, match="allocating version slot 2"):
        cache.build_latest(2, sd)
    assert cache.versions() == (1,)


def test_reserve_is_part_of_the_guard(tmp_path):
    with pytest.raises(HostMemoryError, match="reserve"):
        BucketCache.for_model({"w": torch.zeros(1 << 20)}, host="pageable", reserve_bytes=8 << 20,
                              meminfo=fake_meminfo(tmp_path, 12 * 1024))


def test_at_most_two_versions_and_buffers_are_reused():
    with BucketCache.for_model(state(0), bucket_bytes=8192) as cache:
        cache.build_latest(1, state(1))
        cache.promote_active(1)
        cache.build_latest(2, state(2))
        ptrs = {v: cache.buckets(v)[0].data_ptr() for v in (1, 2)}
        bytes_two = cache.host_bytes()
        assert bytes_two == 2 * cache.layout.total_bytes
        cache.build_latest(3, state(3))  # 2 was never promoted: its slot is reused
        assert cache.versions() == (1, 3) and cache.latest_version == 3
        assert cache.buckets(3)[0].data_ptr() == ptrs[2]
        cache.promote_active(3)
        cache.build_latest(4, state(4))  # now the older one (1) goes
        assert cache.versions() == (3, 4) and cache.active_version == 3
        assert cache.buckets(4)[0].data_ptr() == ptrs[1]
        assert cache.host_bytes() == bytes_two  # never a third buffer
        for v in (3, 4):
            out = unpack(cache.layout, cache.buckets(v))
            assert all(torch.equal(out[k], t) for k, t in state(v).items())
        with pytest.raises(WeightCacheError, match="not in the cache"):
            cache.buckets(1)


def test_a_leased_version_is_not_overwritten_and_the_active_one_never():
    with BucketCache.for_model(state(0), bucket_bytes=8192) as cache:
        cache.build_latest(1, state(1))
        cache.build_latest(2, state(2))
        cache.promote_active(2)
        with cache.lease(1):
            with pytest.raises(WeightCacheError, match="sync"):
                cache.build_latest(3, state(3))
        cache.build_latest(3, state(3))
        with pytest.raises(WeightCacheError, match="active"):
            cache.build_latest(2, state(5))
        assert cache.versions() == (2, 3)


def test_a_failed_snapshot_leaves_no_half_built_version():
    with BucketCache.for_model(state(0), bucket_bytes=8192) as cache:
        with pytest.raises(WeightUpdateError):
            cache.build_latest(1, {"a": torch.zeros(3)})
        assert cache.versions() == () and cache.latest_version is None


def test_snapshot_of_a_transformers_model_dedupes_tied_weights():
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    names = named_weights(model)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    with BucketCache.for_model(model, bucket_bytes=16 << 10) as cache:
        cache.build_latest(1, model)
        out = unpack(cache.layout, cache.buckets(1))
        for name, p in model.named_parameters():
            assert torch.equal(out[name], p.detach()), name


def test_shm_segments_are_removed_on_close():
    cache = BucketCache.for_model(state(0), bucket_bytes=8192, host="shm")
    cache.build_latest(1, state(1))
    names = [s.name for s in cache.shm_segments()]
    assert names and all(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    cache.close()
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)


def test_orphaned_shared_memory_of_dead_processes_is_reaped_and_live_ones_kept():
    import os
    import subprocess
    import sys

    from rlix.weights.wire import SHM_DIR, reap_orphaned_segments

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    names = {"orphan": f"rlix-t-{dead_pid}-0badcafe", "live": f"rlix-t-{os.getpid()}-0badcafe",
             "other": f"rlix-t-{dead_pid}-not-hex", "other_prefix": f"rlix-u-{dead_pid}-0badcafe"}
    try:
        for name in names.values():
            with open(os.path.join(SHM_DIR, name), "wb") as fh:
                fh.write(b"x")
        assert reap_orphaned_segments("rlix-t") == [names["orphan"]]
        left = set(os.listdir(SHM_DIR))
        assert names["orphan"] not in left
        assert {names["live"], names["other"], names["other_prefix"]} <= left
    finally:
        for name in names.values():
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
