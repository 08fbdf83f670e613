"""The prefix cache (engine/prefix_cache.py): a prompt that starts with a finished sequence's
tokens prefills only the rest, and gives what a whole prefill gives."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.prefix_cache import PrefixCache
from rlix.inference.engine.runner.model_runner import ModelRunner, load_model
from rlix.models.presets import resolve_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
#: CPU prefills packed; on CUDA a prefill with a cached prefix runs the packed path eagerly
#: while a whole one goes through the padded prefill graphs
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _kv(n: int) -> torch.Tensor:
    return torch.full((2, 2, 1, n, 4), float(n))


def test_longest_prefix_of_the_same_version_matches_and_leaves_one_token_to_run():
    cache = PrefixCache(budget_bytes=1 << 20, min_hit_tokens=4)
    base = list(range(100, 130))
    cache.put(base[:12], _kv(12), version=0)
    cache.put([7] * 20, _kv(20), version=0)
    hit = cache.match(base + [1, 2], version=0)
    assert hit is not None and hit.length == 12 and hit.entry.tokens == tuple(base[:12])
    assert cache.match(base[:12], version=0).length == 11  # one prompt token must still run
    assert cache.match(base, version=1) is None  # other weights computed it
    assert cache.match(base[:3] + [0] * 20, version=0) is None  # 3 shared tokens: under the minimum
    assert cache.hits == 2 and cache.hit_tokens == 23


def test_an_entry_replaces_those_it_extends_and_the_oldest_go_over_budget():
    one = _kv(10).numel() * 4
    cache = PrefixCache(budget_bytes=3 * one, min_hit_tokens=4)
    turn1 = list(range(10))
    cache.put(turn1, _kv(10), version=0)
    cache.put(turn1 + [50] * 10, _kv(20), version=0)  # the next turn: same keys, and more
    assert len(cache) == 1 and cache.nbytes == 2 * one
    other = [9] * 10
    cache.put(other, _kv(10), version=0)
    assert len(cache) == 2
    cache.put([8] * 10, _kv(10), version=0)  # over budget: the least recently used goes
    assert len(cache) == 2 and cache.match(turn1 + [50] * 10 + [1], version=0) is None
    assert cache.match(other + [1], version=0) is not None
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


@pytest.mark.parametrize("device", DEVICES)
@torch.inference_mode()
def test_prefill_after_a_cached_prefix_equals_the_whole_prefill(prompt, device):
    """The rest of a prompt run at its positions over the copied prefix gives the logits and
    keys/values of the whole prompt's prefill (several prompts packed, one with no prefix)."""
    model, _ = load_model(resolve_model("tiny"), torch.device(device), torch.float32)
    runner = ModelRunner(model, device=torch.device(device), num_rows=4, max_model_len=256,
                         fused=True, cuda_graphs=device == "cuda")
    assert runner.reuses_prefixes
    runner.cache.allocate(256)
    prompts = [prompt(90), prompt(40, salt=2), prompt(33, salt=3)]
    whole, _ = runner.prefill_all(prompts, 0)
    kv = runner.cache.kv
    assert kv is not None
    expected = kv.clone()
    kv[:, :, 3].copy_(kv[:, :, 0])  # row 3: a spare copy of prompt 0's keys (the "entry")
    kv[:, :, :3].zero_()
    kv[:, :, 0, :, :70].copy_(kv[:, :, 3, :, :70])  # 70 positions of prompt 0 cached
    kv[:, :, 2, :, :20].copy_(expected[:, :, 2, :, :20])  # and 20 of prompt 2
    part, _ = runner.prefill_all(prompts, 0, offsets=[70, 0, 20])
    tol = 1e-4 if device == "cpu" else 2e-3  # CUDA: the two paths run different kernels
    torch.testing.assert_close(part, whole, atol=tol, rtol=tol)
    for row, n in enumerate(len(p) for p in prompts):
        torch.testing.assert_close(kv[:, :, row, :, :n], expected[:, :, row, :, :n], atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_the_next_turn_reuses_the_last_turns_keys_and_answers_as_without_them(make_engine, prompt, h, device):
    """Turn 2 = turn 1's prompt and answer plus new tokens: everything but the answer's last
    token comes from the cache, and greedy decoding is what an engine without the cache gives."""
    cached, plain = make_engine(device=device), make_engine(device=device, prefix_cache_bytes=0)
    first = prompt(40)
    t1 = h.run(cached, first, SamplingParams(max_tokens=8, **GREEDY))
    assert cached.prefix_hit_tokens == 0
    second = first + t1.token_ids + prompt(12, salt=5)
    t2 = h.run(cached, second, SamplingParams(max_tokens=8, logprobs=1, **GREEDY))
    assert cached.prefix_hit_tokens == len(first) + len(t1.token_ids) - 1
    assert cached.prefill_tokens == len(first) + len(second) - cached.prefix_hit_tokens
    ref = h.run(plain, second, SamplingParams(max_tokens=8, logprobs=1, **GREEDY))
    assert t2.token_ids == ref.token_ids
    assert t2.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert plain.prefix_hit_tokens == 0


@pytest.mark.parametrize("device", DEVICES)
def test_keys_of_older_weights_are_not_reused(make_engine, prompt, h, device):
    """After a weight update (or a sleep) the next turn is prefilled whole."""
    engine = make_engine(device=device)
    first = prompt(40)
    t1 = h.run(engine, first, SamplingParams(max_tokens=8, **GREEDY))
    asyncio.run(engine.sleep(1))
    asyncio.run(engine.wake_up())
    h.run(engine, first + t1.token_ids + [5], SamplingParams(max_tokens=2, **GREEDY))
    assert engine.prefix_hit_tokens == 0
    t2 = h.run(engine, first, SamplingParams(max_tokens=8, **GREEDY))
    assert engine.prefix_hit_tokens == len(first) - 1  # the request before left these
    weights = {n: t.clone() for n, t in engine.served_weights().items()}
    asyncio.run(engine.start_weight_update(1))
    asyncio.run(engine.update_weights(weights))
    asyncio.run(engine.finish_weight_update())
    h.run(engine, first + t2.token_ids + [5], SamplingParams(max_tokens=2, **GREEDY))
    assert engine.prefix_hit_tokens == len(first) - 1
