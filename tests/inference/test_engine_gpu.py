"""The engine on CUDA: exact greedy decoding, device memory really freed by sleep, bf16."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlix.errors import EngineStateError
from rlix.inference.engine.api import SamplingParams
from rlix.models.presets import build_preset

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_gpu_greedy_equals_generate_alone_and_batched(make_engine, tiny_model_dir, prompt, h):
    engine = make_engine(device="cuda", max_num_seqs=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to("cuda").eval()
    specs = [(5, 30), (17, 8), (3, 20), (40, 12), (9, 16), (1, 10)]

    @torch.inference_mode()
    def reference(p, n):
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        return out[0, len(p):].tolist()

    async def main():
        async def one(i, delay):
            await asyncio.sleep(delay)
            n, m = specs[i]
            return await h.collect(engine, f"g{i}", prompt(n, salt=i),
                                   SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        return await asyncio.gather(*(one(i, 0.01 * i) for i in range(len(specs))))

    for i, out in enumerate(asyncio.run(main())):
        n, m = specs[i]
        assert out.token_ids == reference(prompt(n, salt=i), m), i


def test_gpu_sleep_frees_device_memory_and_reload_restores_output(make_engine, tmp_path, prompt, h):
    path = build_preset("small", tmp_path / "small")
    engine = make_engine(path, device="cuda", max_num_seqs=32, kv_initial_capacity=1024)
    base = h.run(engine, prompt(9), GREEDY).token_ids
    weights, kv = engine.weight_bytes(), engine.kv_cache_bytes()

    async def main():
        before = device_used()
        await engine.sleep(1)  # weights to host memory, KV freed
        assert before - device_used() >= 0.9 * (weights + kv)
        assert engine.last_sleep_freed_bytes >= 0.9 * (weights + kv)
        await engine.wake_up()
        level1 = await h.collect(engine, "l1", prompt(9), GREEDY)
        before = device_used()
        await engine.sleep(2)
        assert before - device_used() >= 0.9 * (weights + kv)
        await engine.wake_up(["weights"])
        with pytest.raises(EngineStateError):
            engine.generate("early", prompt(9), GREEDY)
        await engine.start_weight_update(3)
        await engine.update_weights(load_file(str(path / "model.safetensors")))  # CPU tensors
        assert await engine.finish_weight_update() == 3
        await engine.wake_up(["kv_cache"])
        level2 = await h.collect(engine, "l2", prompt(9), GREEDY)
        return level1, level2

    level1, level2 = asyncio.run(main())
    assert level1.token_ids == base and level2.token_ids == base


def test_gpu_graphs_equal_eager_decoding(make_engine, prompt, h):
    graphs = make_engine(device="cuda", max_num_seqs=16)
    eager = make_engine(device="cuda", max_num_seqs=16, cuda_graphs=False)
    for n in (3, 11):
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        assert h.run(graphs, prompt(n), params).token_ids == h.run(eager, prompt(n), params).token_ids


def test_gpu_bf16_serves_and_updates_in_place(make_engine, tiny_model_dir, prompt, h):
    engine = make_engine(device="cuda", dtype="bfloat16")
    base = h.run(engine, prompt(6), GREEDY).token_ids
    sampled = h.run(engine, prompt(6), SamplingParams(max_tokens=16, seed=1, ignore_eos=True))
    assert len(sampled.token_ids) == 16 and all(lp <= 0 for lp in sampled.logprobs)
    state = {k: v.to(torch.bfloat16) for k, v in load_file(
        str(tiny_model_dir / "model.safetensors")).items()}
    noisy = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}

    async def update(version, weights):
        await engine.start_weight_update(version)
        await engine.update_weights(weights)
        return await engine.finish_weight_update()

    assert asyncio.run(update(1, noisy)) == 1
    assert h.run(engine, prompt(6), GREEDY).token_ids != base  # the captured graphs see it
    assert asyncio.run(update(2, state)) == 2
    assert h.run(engine, prompt(6), GREEDY).token_ids == base
