"""Sleep levels free real memory; weight updates are validated, staged, and swapped atomically."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import load_file

from rlix.errors import EngineStateError, WeightUpdateError
from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.runner.memory import host_rss_bytes
from rlix.models.presets import build_preset

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    """~24M params (97 MB fp32): big enough that freeing its weights shows in RSS."""
    return build_preset("small", tmp_path_factory.mktemp("models") / "small")


def served_state(path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as a trainer would send them (fresh copies each time)."""
    return load_file(str(path / "model.safetensors"))


def perturbed(state: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


def split(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    names = sorted(state)
    return ({k: state[k] for k in names[::2]}, {k: state[k] for k in names[1::2]})


def test_update_then_finish_changes_output_and_bumps_version(engine, tiny_model_dir, prompt, h):
    base = h.run(engine, prompt(7), GREEDY).token_ids
    first, second = split(perturbed(served_state(tiny_model_dir)))

    async def main():
        await engine.start_weight_update(7)
        await engine.update_weights(first)
        staged_out = await h.collect(engine, "mid", prompt(7), GREEDY)  # old weights still serve
        await engine.update_weights(second)
        assert await engine.finish_weight_update() == 7
        new_out = await h.collect(engine, "new", prompt(7), GREEDY)
        await engine.start_weight_update(8)  # and back again
        await engine.update_weights(served_state(tiny_model_dir))
        assert await engine.finish_weight_update() == 8
        back = await h.collect(engine, "back", prompt(7), GREEDY)
        return staged_out, new_out, back

    staged_out, new_out, back = asyncio.run(main())
    assert staged_out.token_ids == base and staged_out.weight_versions == [(0, 0)]
    assert new_out.token_ids != base and new_out.weight_versions == [(0, 7)]
    assert back.token_ids == base and engine.weight_version == 8


@pytest.mark.parametrize("bad", ["unknown name", "wrong shape", "wrong dtype"])
def test_mismatched_update_is_refused_and_old_weights_keep_serving(engine, tiny_model_dir,
                                                                   prompt, h, bad):
    base = h.run(engine, prompt(7), GREEDY).token_ids
    state = perturbed(served_state(tiny_model_dir))
    name = "model.layers.0.mlp.up_proj.weight"
    if bad == "unknown name":
        state["model.layers.9.mlp.up_proj.weight"] = state[name]
    elif bad == "wrong shape":
        state[name] = state[name][:, :-1].contiguous()
    else:
        state[name] = state[name].to(torch.bfloat16)

    async def main():
        await engine.start_weight_update(1)
        with pytest.raises(WeightUpdateError, match="unknown|shape|dtype"):
            await engine.update_weights(state)
        with pytest.raises(WeightUpdateError, match="refused"):  # staging was discarded
            await engine.update_weights({name: served_state(tiny_model_dir)[name]})
        with pytest.raises(WeightUpdateError):
            await engine.finish_weight_update()
        return await h.collect(engine, "after", prompt(7), GREEDY)

    assert asyncio.run(main()).token_ids == base
    assert engine.weight_version == 0


def test_incomplete_update_refused_unless_partial_allowed(engine, tiny_model_dir, prompt, h):
    base = h.run(engine, prompt(7), GREEDY).token_ids
    half, _ = split(perturbed(served_state(tiny_model_dir)))

    async def main():
        await engine.start_weight_update(1)
        await engine.update_weights(half)
        with pytest.raises(WeightUpdateError, match="never arrived"):
            await engine.finish_weight_update()
        unchanged = await h.collect(engine, "u", prompt(7), GREEDY)
        await engine.start_weight_update(2, allow_partial=True)
        await engine.update_weights(half)
        version = await engine.finish_weight_update()
        return unchanged, version, await h.collect(engine, "p", prompt(7), GREEDY)

    unchanged, version, partial = asyncio.run(main())
    assert unchanged.token_ids == base
    assert version == 2 == engine.weight_version and partial.token_ids != base


def test_update_protocol_misuse_is_a_state_error(engine, tiny_model_dir):
    async def main():
        with pytest.raises(EngineStateError):
            await engine.update_weights(served_state(tiny_model_dir))
        with pytest.raises(EngineStateError):
            await engine.finish_weight_update()
        await engine.start_weight_update(1)
        with pytest.raises(EngineStateError, match="in progress"):
            await engine.start_weight_update(2)
        await engine.abort_weight_update("test")
        await engine.start_weight_update(3)  # a fresh start works after an abort
        await engine.abort_weight_update("test")
        await engine.sleep(1)
        with pytest.raises(EngineStateError, match="asleep"):
            await engine.start_weight_update(4)

    asyncio.run(main())


def test_weight_versions_spans_record_a_mid_request_change(engine, tiny_model_dir, prompt, h):
    new_weights = perturbed(served_state(tiny_model_dir))

    async def main():
        seen = []

        async def consume():
            async for out in engine.generate("long", prompt(5), SamplingParams(
                    max_tokens=60, temperature=0.0, ignore_eos=True)):
                seen.append(out)
            return out

        task = asyncio.create_task(consume())
        await h.wait_for(lambda: seen and len(seen[-1].token_ids) >= 10)
        await engine.pause("keep")
        await engine.start_weight_update(1)
        await engine.update_weights(new_weights)
        await engine.finish_weight_update()
        await asyncio.sleep(0.05)
        switched_at = len(seen[-1].token_ids)
        await engine.resume()
        return await task, switched_at

    out, switched_at = asyncio.run(main())
    assert out.weight_versions == [(0, 0), (switched_at, 1)]
    assert 10 <= switched_at < 60 and len(out.token_ids) == 60


def test_sleep_aborts_in_flight_requests(engine, prompt, h):
    async def main():
        task = asyncio.create_task(h.collect(engine, "a", prompt(5), SamplingParams(max_tokens=1500, ignore_eos=True)))
        await h.wait_for(lambda: engine.num_running() == 1)
        await engine.sleep(1)
        return await task

    out = asyncio.run(main())
    assert out.finish_reason == "abort" and engine.is_sleeping() and engine.num_running() == 0


def test_sleep_level_1_frees_the_kv_cache(make_engine, prompt, h):
    engine = make_engine(max_num_seqs=32, kv_initial_capacity=2048)
    base = h.run(engine, prompt(9), GREEDY).token_ids
    kv = engine.kv_cache_bytes()
    assert kv >= 60 * 2**20
    before = host_rss_bytes()
    asyncio.run(engine.sleep(1))
    dropped = before - host_rss_bytes()
    assert dropped >= 0.8 * kv and engine.last_sleep_freed_bytes >= 0.8 * kv
    assert engine.kv_cache_bytes() == 0
    asyncio.run(engine.wake_up())
    assert h.run(engine, prompt(9), GREEDY).token_ids == base


def test_sleep_level_2_frees_weights_then_reload_restores_output(make_engine, small_model_dir,
                                                                  prompt, h):
    engine = make_engine(small_model_dir, max_num_seqs=4)
    base = h.run(engine, prompt(9), GREEDY).token_ids
    weights, kv = engine.weight_bytes(), engine.kv_cache_bytes()
    assert weights >= 90 * 2**20
    before = host_rss_bytes()
    asyncio.run(engine.sleep(2))
    assert before - host_rss_bytes() >= 0.8 * (weights + kv)

    async def reload():
        await engine.wake_up(["weights"])
        with pytest.raises(EngineStateError, match="level-2"):
            engine.generate("early", prompt(9), GREEDY)
        await engine.start_weight_update(5)
        for part in split(served_state(small_model_dir)):  # bucket by bucket
            await engine.update_weights(part)
        assert await engine.finish_weight_update() == 5
        assert engine.is_sleeping()  # KV cache still asleep
        await engine.wake_up(["kv_cache"])

    asyncio.run(reload())
    assert h.run(engine, prompt(9), GREEDY).token_ids == base


def test_level_2_reload_must_be_complete(engine, tiny_model_dir, prompt, h):
    async def main():
        await engine.sleep(2)
        await engine.wake_up()
        half, _ = split(served_state(tiny_model_dir))
        await engine.start_weight_update(1, allow_partial=True)  # nothing to fall back on
        await engine.update_weights(half)
        with pytest.raises(WeightUpdateError, match="level-2"):
            await engine.finish_weight_update()
        with pytest.raises(EngineStateError):
            engine.generate("x", prompt(3), GREEDY)

    asyncio.run(main())
