"""The tensor-parallel engine on CUDA: its NCCL group made apart from torch.distributed's default
one, an all-reduce replayed inside a CUDA graph (how the decode graphs hold the collectives),
and, where two GPUs are visible, a two-rank engine that decodes through its CUDA graphs what
the one-rank engine decodes, before and after a sleep."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.engine.runner.tp.plan import TensorParallel
from rlix.inference.engine.runner.tp.group import make_group
from rlix.tcp_store import serve_store

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 99, 3, 250, 42, 8], [11, 2, 300], [45, 46, 47, 48, 49]]


def test_an_nccl_group_of_its_own_reduces_inside_a_cuda_graph():
    store = serve_store("127.0.0.1", 0, 1, 30.0, wait_for_workers=False)
    group = make_group("nccl", store, 0, 1)
    tp = TensorParallel(0, 1, group)
    x = torch.full((4,), 3.0, device="cuda")
    assert torch.equal(TensorParallel(0, 2, group).all_reduce(x.clone()), x)  # the group's own reduce: one rank
    static = torch.zeros(4, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        TensorParallel(0, 2, group).all_reduce(static + 1)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TensorParallel(0, 2, group).all_reduce(static * 2)
    static.fill_(5.0)
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [10.0] * 4
    assert tp.all_reduce(x) is x


async def _greedy(engine: TorchEngine, tag: str) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        async for out in engine.generate(f"{tag}{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0,
                                                                             ignore_eos=True)):
            last = out
        return last.token_ids
    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_decode_through_graphs_what_one_does(tiny_model_dir):
    with TorchEngine.from_pretrained(tiny_model_dir, device="cuda", dtype="float32", max_num_seqs=4) as one:
        want = asyncio.run(_greedy(one, "a"))
    with TorchEngine.from_pretrained(tiny_model_dir, device="cuda", dtype="float32", max_num_seqs=4,
                                     tensor_parallel_size=2) as two:
        async def main():
            first = await _greedy(two, "b")
            await two.sleep(1)
            await two.wake_up()
            return first, await _greedy(two, "c")
        first, after = asyncio.run(main())
        assert two.sleep_report()["graph_captures"] > 0  # decode ran through CUDA graphs
    assert first == want and after == want


async def _prompt_logprobs(engine: TorchEngine) -> list[list[float]]:
    async def one(i: int, prompt: list[int]) -> list[float]:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        async for out in engine.generate(f"p{i}", prompt, params):
            last = out
        return [v for v in last.prompt_logprobs if v is not None]
    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


@torch.inference_mode()
def _hf_prompt_logprobs(model: torch.nn.Module) -> list[list[float]]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt], device="cuda")
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        out.append(torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


def _mean_gap(a: list[list[float]], b: list[list[float]]) -> float:
    gaps = [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return sum(gaps) / len(gaps)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_in_bf16_stay_within_the_spread_of_two_correct_forwards():
    """In bf16 a split model cannot give one GPU's bits; its prompt logprobs must lie no further
    from one GPU's than transformers' own forward of the same weights does (float32 partial
    sums: fused_model.wide_partials)."""
    with TorchEngine.from_pretrained("qwen2-0.5b-shape", device="cuda", dtype="bfloat16", max_num_seqs=4) as one:
        want = asyncio.run(_prompt_logprobs(one))
        spread = _mean_gap(want, _hf_prompt_logprobs(one.model))
    with TorchEngine.from_pretrained("qwen2-0.5b-shape", device="cuda", dtype="bfloat16", max_num_seqs=4,
                                     tensor_parallel_size=2) as two:
        assert two._runner.fused.wide_partials
        got = asyncio.run(_prompt_logprobs(two))
    assert _mean_gap(want, got) <= spread, (_mean_gap(want, got), spread)
