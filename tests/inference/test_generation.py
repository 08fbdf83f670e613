"""The router's in-process generate: typed answers and typed errors (no servers needed here; the
real-shard path is tests/pipeline/test_collector_engine.py)."""

from __future__ import annotations

import asyncio

import pytest

from rlix.inference.server.openai_schema import GenerateSamplingParams as SP
from rlix.errors import EngineStateError, InferenceError, InvalidRequestError, NoActiveShardError
from rlix.inference.router.router import Generation, Router, VersionSpan
from rlix.inference.server.openai_schema import answer_error


def test_an_answer_becomes_a_typed_generation():
    g = Generation.from_answer({
        "choices": [{"token_ids": [7, 8], "finish_reason": "length",
                     "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}, {"token_id": 8, "logprob": -1}]},
                     "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                         {"version": "unknown", "start": 1, "end": 2}]}],
        "usage": {"prompt_tokens": 4}})
    assert g.token_ids == [7, 8] and g.logprobs == [-0.5, -1.0] and g.finish_reason == "length"
    assert g.weight_versions == [VersionSpan(3, 0, 1), VersionSpan(None, 1, 2)] and g.prompt_tokens == 4


@pytest.mark.parametrize("answer", [{}, {"choices": []}, {"choices": [{"token_ids": ["x"]}]},
                                    {"choices": [{"weight_versions": [{"version": 1}]}]}])
def test_a_malformed_answer_is_an_inference_error(answer):
    with pytest.raises(InferenceError, match="malformed generate answer"):
        Generation.from_answer(answer)


def test_refusals_map_to_typed_errors():
    body = {"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}
    assert isinstance(answer_error(400, body, "generate"), InvalidRequestError)
    assert isinstance(answer_error(503, body, "generate"), EngineStateError)
    other = answer_error(500, "boom", "generate")
    assert type(other) is InferenceError and "boom" in str(other)


def test_no_active_shard_ends_a_held_request_in_time():
    async def main() -> None:
        router = Router("k", hold_timeout_s=0.05)
        try:
            with pytest.raises(NoActiveShardError):
                await router.generate([1, 2], SP(max_tokens=2))
        finally:
            await router.close()
    asyncio.run(main())
