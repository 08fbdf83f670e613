"""TorchEngine features behind the OpenAI surface: n samples sharing one prefill, top-k
alternatives, prompt logprobs from the prefill, penalties and logit bias."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlix.errors import InvalidRequestError
from rlix.inference.engine.api import SamplingParams


async def _group(engine, rid, prompt, params, final_only=False):
    """{index: last output} of one request of params.n samples."""
    last = {}
    async for out in engine.generate(rid, prompt, params, final_only=final_only):
        last[out.index] = out
    return last


def test_n_samples_share_one_prefill_and_differ(engine, prompt):
    """A GRPO group: 8 samples of one prompt, one prefill forward of its tokens, 8 distinct
    samples at temperature 1."""
    p = prompt(23)
    before = engine.prefill_tokens, engine.forked_rows
    outs = asyncio.run(_group(engine, "g", p, SamplingParams(n=8, max_tokens=12, temperature=1.0,
                                                             ignore_eos=True)))
    assert sorted(outs) == list(range(8))
    assert engine.prefill_tokens - before[0] == len(p)  # one prefill, not eight
    assert engine.forked_rows - before[1] == 7
    samples = {tuple(o.token_ids) for o in outs.values()}
    assert len(samples) == 8 and all(len(s) == 12 for s in samples)
    assert {o.request_id for o in outs.values()} == {f"g-{i}" for i in range(8)}
    assert all(o.finish_reason == "length" and len(o.logprobs) == 12 for o in outs.values())


def test_seeded_samples_equal_single_requests_seeded_seed_plus_index(engine, prompt, h):
    """Sample i of a seeded request draws from seed + i, as vLLM's: the shared prefill and the
    copied cache rows give exactly what a request of its own gives."""
    p = prompt(17, salt=3)
    params = SamplingParams(n=4, max_tokens=10, temperature=0.9, seed=100, ignore_eos=True)
    outs = asyncio.run(_group(engine, "s", p, params))
    final = asyncio.run(_group(engine, "f", p, params, final_only=True))
    for i in range(4):
        alone = h.run(engine, p, SamplingParams(max_tokens=10, temperature=0.9, seed=100 + i,
                                                ignore_eos=True), request_id=f"a{i}")
        assert outs[i].token_ids == alone.token_ids
        assert outs[i].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert final[i].token_ids == alone.token_ids


def test_aborting_the_request_aborts_all_its_samples(engine, prompt, h):
    async def main():
        task = asyncio.create_task(_group(engine, "big", prompt(5),
                                          SamplingParams(n=3, max_tokens=1500, ignore_eos=True)))
        await h.wait_for(lambda: engine.num_running() == 3)
        assert await engine.abort(["big"]) == 3
        return await task

    outs = asyncio.run(main())
    assert [o.finish_reason for o in outs.values()] == ["abort"] * 3


def test_n_is_bounded_by_the_batch(make_engine, prompt):
    engine = make_engine(max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match="n must"):
        engine.generate("x", prompt(3), SamplingParams(n=5))
    for bad in (SamplingParams(top_logprobs=21), SamplingParams(prompt_logprobs=21),
                SamplingParams(presence_penalty=2.5), SamplingParams(frequency_penalty=float("nan")),
                SamplingParams(repetition_penalty=0.0), SamplingParams(logit_bias=((10_000, 1.0),)),
                SamplingParams(logit_bias=((5, 101.0),))):
        with pytest.raises(InvalidRequestError):
            engine.generate("x", prompt(3), bad)


def test_top_logprobs_and_prompt_logprobs_are_the_raw_distribution(engine, hf_model, prompt, h):
    p = prompt(9, salt=1)
    out = h.run(engine, p, SamplingParams(max_tokens=6, temperature=0.7, seed=1, top_logprobs=5,
                                          prompt_logprobs=3, ignore_eos=True))
    with torch.inference_mode():
        logits = hf_model(torch.tensor([p + out.token_ids])).logits[0].float()
    raw = torch.log_softmax(logits, -1)
    assert len(out.top_logprobs) == 6
    for i, (token, alts) in enumerate(zip(out.token_ids, out.top_logprobs)):
        row = raw[len(p) - 1 + i]
        values, ids = row.topk(5)
        assert [t for t, _ in alts] == ids.tolist()
        assert [v for _, v in alts] == pytest.approx(values.tolist(), abs=1e-4)
        assert [v for _, v in alts] == sorted((v for _, v in alts), reverse=True)
        if token in ids.tolist():
            assert dict(alts)[token] == pytest.approx(out.logprobs[i], abs=1e-6)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] == []
    expected = raw[torch.arange(len(p) - 1), torch.tensor(p[1:])].tolist()
    assert out.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(a) == 3 for a in out.prompt_top_logprobs[1:])
    assert [t for t, _ in out.prompt_top_logprobs[1]] == raw[0].topk(3).indices.tolist()
    plain = h.run(engine, p, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert plain.top_logprobs == [] and plain.prompt_logprobs is None


def test_logit_bias_forces_a_token_and_penalties_break_repetition(engine, prompt, h):
    p = prompt(7)
    forced = h.run(engine, p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                             logit_bias=((42, 100.0),)))
    assert forced.token_ids == [42] * 6
    # the bias shapes what is sampled, not the reported (raw) logprobs
    plain = h.run(engine, p, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    assert forced.token_ids[0] != plain.token_ids[0] and forced.logprobs[0] < plain.logprobs[0]
    # a forced token, penalised per repetition, gives way: frequency 2 beats a bias of +4 after 2
    # repeats at most (the tiny model's logits span a few units)
    shaped = h.run(engine, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                             logit_bias=((42, 4.0),), frequency_penalty=2.0))
    assert shaped.token_ids.count(42) < 12


def test_n_with_prompt_logprobs_and_a_batch_of_other_requests(engine, prompt, h):
    """Groups and single requests admitted in one step: every sample gets the prompt logprobs
    and the single requests are unaffected."""
    async def main():
        single = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        group = SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        return await asyncio.gather(h.collect(engine, "a", prompt(5), single),
                                    _group(engine, "g", prompt(12, salt=2), group),
                                    h.collect(engine, "b", prompt(9, salt=4), single))

    a, g, b = asyncio.run(main())
    assert a.token_ids == h.run(engine, prompt(5), SamplingParams(max_tokens=8, **{"temperature": 0.0,
                                                                               "ignore_eos": True})).token_ids
    assert len({tuple(o.token_ids) for o in g.values()}) == 1  # greedy: all the same
    assert all(o.prompt_logprobs is not None and len(o.prompt_logprobs) == 12 for o in g.values())
    assert len(b.token_ids) == 8
