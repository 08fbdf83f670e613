"""Engine test helpers: a reference transformers model, an engine factory, stream collectors."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlix.inference.engine.api import GenerationOutput, SamplingParams
from rlix.inference.engine.engine import TorchEngine

from polling import until


class Helpers:
    @staticmethod
    async def collect(engine: TorchEngine, request_id: str, prompt: list[int],
                      params: SamplingParams, final_only: bool = False) -> GenerationOutput:
        last = None
        async for last in engine.generate(request_id, prompt, params, final_only=final_only):
            pass
        assert last is not None and last.finished
        return last

    @staticmethod
    def run(engine: TorchEngine, prompt: list[int], params: SamplingParams,
            request_id: str = "r") -> GenerationOutput:
        return asyncio.run(Helpers.collect(engine, request_id, prompt, params))

    @staticmethod
    async def wait_for(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
        await until(predicate, timeout, every=0.002)

    @staticmethod
    @torch.inference_mode()
    def reference_greedy(model, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
        """transformers' own greedy decoding (its DynamicCache, batch of one), eos ignored."""
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        tokens = out[0, len(prompt):].tolist()
        assert len(tokens) == n
        return tokens

    @staticmethod
    @torch.inference_mode()
    def raw_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
        """log_softmax of the raw logits at each generated token, one full forward, no cache."""
        ids = torch.tensor([prompt + tokens])
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.fixture(scope="session")
def h() -> type[Helpers]:
    return Helpers


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture
def make_engine(tiny_model_dir):
    """Factory for engines over the tiny preset (or another path); all closed at teardown."""
    engines: list[TorchEngine] = []

    def make(path=None, **kwargs) -> TorchEngine:  # type: ignore[no-untyped-def]
        kwargs.setdefault("max_num_seqs", 8)
        engine = TorchEngine.from_pretrained(path or tiny_model_dir, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def engine(make_engine) -> TorchEngine:
    return make_engine()


def prompt_of(length: int, salt: int = 0) -> list[int]:
    """A deterministic prompt of ordinary (non-special) token ids."""
    return [3 + (salt * 31 + i * 17) % 370 for i in range(length)]


@pytest.fixture(scope="session")
def prompt():
    return prompt_of
