"""TorchEngine: exact greedy decoding, batching, sampling, stops, abort, pause, validation."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoTokenizer

from rlix.errors import EngineStateError, InvalidRequestError
from rlix.inference.engine.api import EngineAPI, SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.engine.runner.model_runner import load_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_engine_implements_the_protocol(engine):
    assert isinstance(engine, EngineAPI)
    assert engine.max_model_len == 2048 and engine.weight_version == 0
    assert engine.tokenizer.chat_template


def test_greedy_alone_equals_transformers_generate(engine, hf_model, h):
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_dict=False)
    out = h.run(engine, prompt, SamplingParams(max_tokens=32, **GREEDY))
    assert out.token_ids == h.reference_greedy(hf_model, prompt, 32)
    assert out.finish_reason == "length" and out.weight_versions == [(0, 0)]
    assert out.logprobs == pytest.approx(h.raw_logprobs(hf_model, prompt, out.token_ids), abs=1e-4)


def test_greedy_equals_generate_while_requests_join_and_leave(make_engine, hf_model, h, prompt):
    """Staggered arrivals of different lengths; a 3-row batch so some queue and refill rows."""
    engine = make_engine(max_num_seqs=3)
    specs = [(5, 40), (17, 8), (3, 25), (40, 12), (9, 30), (1, 15), (23, 20)]
    prompts = [prompt(n, salt=i) for i, (n, _) in enumerate(specs)]
    seen_running = []

    async def one(i: int, delay: float):
        await asyncio.sleep(delay)
        params = SamplingParams(max_tokens=specs[i][1], **GREEDY)
        return await h.collect(engine, f"r{i}", prompts[i], params)

    async def watch(done: asyncio.Event):  # how many rows ran together, seen throughout
        while not done.is_set():
            seen_running.append(engine.num_running())
            await asyncio.sleep(0.001)

    async def main():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        try:
            return await asyncio.gather(*(one(i, 0.015 * i) for i in range(len(specs))))
        finally:
            done.set()
            await watcher

    outs = asyncio.run(main())
    for i, out in enumerate(outs):
        assert out.token_ids == h.reference_greedy(hf_model, prompts[i], specs[i][1]), i
        assert out.logprobs == pytest.approx(
            h.raw_logprobs(hf_model, prompts[i], out.token_ids), abs=1e-4)
    assert max(seen_running) >= 2  # requests really shared the batch


def test_seeded_sampling_does_not_depend_on_the_batch(engine, prompt, h):
    params = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, top_k=100, seed=11,
                            ignore_eos=True)
    alone = h.run(engine, prompt(7), params).token_ids

    async def crowded():
        others = [h.collect(engine, f"o{i}", prompt(4 + 9 * i, salt=i),
                            SamplingParams(max_tokens=10 + 7 * i, seed=i, ignore_eos=True))
                  for i in range(4)]
        outs = await asyncio.gather(h.collect(engine, "me", prompt(7), params), *others)
        return outs[0].token_ids

    assert asyncio.run(crowded()) == alone
    assert h.run(engine, prompt(7), SamplingParams(
        max_tokens=30, temperature=0.9, seed=12, ignore_eos=True)).token_ids != alone
    top1 = SamplingParams(max_tokens=30, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    assert h.run(engine, prompt(7), top1).token_ids == h.run(
        engine, prompt(7), SamplingParams(max_tokens=30, **GREEDY)).token_ids


def test_logprobs_are_the_raw_model_distribution(engine, hf_model, prompt, h):
    params = SamplingParams(max_tokens=20, temperature=0.6, top_k=5, seed=5, ignore_eos=True)
    out = h.run(engine, prompt(11), params)
    assert out.logprobs == pytest.approx(h.raw_logprobs(hf_model, prompt(11), out.token_ids),
                                         abs=1e-4)
    no_lp = h.run(engine, prompt(11), SamplingParams(max_tokens=5, logprobs=False, **GREEDY))
    assert no_lp.logprobs == [] and len(no_lp.token_ids) == 5


def test_stop_token_ids_and_stop_strings(engine, prompt, h):
    greedy = h.run(engine, prompt(6), SamplingParams(max_tokens=40, **GREEDY)).token_ids
    stop_id = greedy[6]
    out = h.run(engine, prompt(6), SamplingParams(max_tokens=40, stop_token_ids=(stop_id,),
                                                  **GREEDY))
    assert out.token_ids == greedy[: greedy.index(stop_id) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)

    tok = engine.tokenizer
    text = tok.decode(greedy, skip_special_tokens=True)
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text))
                if text[i:i + 3].strip() and len(text[i:i + 3]) == 3)
    expected = next(m for m in range(1, len(greedy) + 1)
                    if stop in tok.decode(greedy[:m], skip_special_tokens=True))
    out = h.run(engine, prompt(6), SamplingParams(max_tokens=40, stop=(stop, "\x00never"),
                                                  **GREEDY))
    assert out.token_ids == greedy[:expected]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_eos_ends_unless_ignored(tiny_model_dir, prompt, h):
    model, tokenizer = load_model(tiny_model_dir, torch.device("cpu"), None)
    with TorchEngine(model, tokenizer) as plain:
        greedy = h.run(plain, prompt(8), SamplingParams(max_tokens=30, **GREEDY)).token_ids
    model.generation_config.eos_token_id = [greedy[4]]  # make a token the model emits an eos
    with TorchEngine(model, tokenizer) as engine:
        out = h.run(engine, prompt(8), SamplingParams(max_tokens=30, temperature=0.0))
        assert out.token_ids == greedy[: greedy.index(greedy[4]) + 1]
        assert (out.finish_reason, out.stop_reason) == ("stop", None)
        out = h.run(engine, prompt(8), SamplingParams(max_tokens=30, **GREEDY))
        assert out.token_ids == greedy and out.finish_reason == "length"


def test_abort_one_request(engine, prompt, h):
    async def main():
        a = asyncio.create_task(h.collect(engine, "a", prompt(5), SamplingParams(max_tokens=1500, ignore_eos=True)))
        b = asyncio.create_task(h.collect(engine, "b", prompt(9), SamplingParams(max_tokens=40, ignore_eos=True)))
        await h.wait_for(lambda: engine.num_running() == 2)
        assert await engine.abort(["a", "nope"]) == 1
        return await a, await b

    a, b = asyncio.run(main())
    assert a.finish_reason == "abort" and len(a.token_ids) < 1500
    assert len(a.logprobs) == len(a.token_ids)
    assert b.finish_reason == "length" and len(b.token_ids) == 40
    assert engine.num_running() == 0 and engine.num_waiting() == 0


def test_closing_the_stream_aborts_the_request(engine, prompt, h):
    async def main():
        stream = engine.generate("gone", prompt(5), SamplingParams(max_tokens=1500, ignore_eos=True))
        first = await stream.__anext__()
        await stream.aclose()
        await h.wait_for(lambda: engine.num_running() == 0)
        return first

    assert len(asyncio.run(main()).token_ids) >= 1


def test_pause_abort_ends_running_and_queues_new_requests(engine, prompt, h):
    async def main():
        old = [asyncio.create_task(h.collect(engine, f"old{i}", prompt(4 + i),
                                             SamplingParams(max_tokens=1500, ignore_eos=True))) for i in range(2)]
        await h.wait_for(lambda: engine.num_running() == 2)
        await engine.pause("abort")
        assert engine.is_paused()
        ended = [await t for t in old]
        new = asyncio.create_task(h.collect(engine, "new", prompt(6), SamplingParams(max_tokens=8, ignore_eos=True)))
        await asyncio.sleep(0.2)
        assert not new.done() and engine.num_waiting() == 1 and engine.num_running() == 0
        await engine.resume()
        return ended, await new

    ended, new = asyncio.run(main())
    assert all(o.finish_reason == "abort" and 0 < len(o.token_ids) < 1500 for o in ended)
    assert new.finish_reason == "length" and len(new.token_ids) == 8


def test_pause_wait_lets_running_finish_and_holds_new_ones(engine, prompt, h):
    async def main():
        running = asyncio.create_task(h.collect(engine, "run", prompt(5),
                                                SamplingParams(max_tokens=60, **GREEDY)))
        await h.wait_for(lambda: engine.num_running() == 1)
        await engine.pause("wait")  # returns only once "run" has finished
        assert engine.num_running() == 0
        held = asyncio.create_task(h.collect(engine, "held", prompt(6),
                                             SamplingParams(max_tokens=5, ignore_eos=True)))
        await asyncio.sleep(0.2)
        assert not held.done() and engine.num_waiting() == 1
        await engine.resume()
        return await running, await held

    running, held = asyncio.run(main())
    assert running.finish_reason == "length" and len(running.token_ids) == 60
    assert held.finish_reason == "length"


def test_pause_keep_freezes_and_resumes_exactly(engine, prompt, h):
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=21, ignore_eos=True)
    unpaused = h.run(engine, prompt(9), params).token_ids

    async def main():
        seen = []

        async def consume():
            async for out in engine.generate("kept", prompt(9), params):
                seen.append(len(out.token_ids))
            return out

        task = asyncio.create_task(consume())
        await h.wait_for(lambda: seen and seen[-1] >= 10)
        await engine.pause("keep")
        await asyncio.sleep(0.05)
        frozen_at = seen[-1]
        await asyncio.sleep(0.3)
        assert seen[-1] == frozen_at < 80  # no progress while paused
        assert engine.num_running() == 1 and engine.is_paused()
        await engine.resume()
        return await task

    out = asyncio.run(main())
    assert out.token_ids == unpaused and out.finish_reason == "length"


def test_metrics_count_running_and_waiting(make_engine, prompt, h):
    engine = make_engine(max_num_seqs=2)

    async def main():
        tasks = [asyncio.create_task(h.collect(engine, f"m{i}", prompt(3 + i),
                                               SamplingParams(max_tokens=1500, ignore_eos=True)))
                 for i in range(3)]
        await h.wait_for(lambda: engine.num_running() == 2)
        await engine.pause("keep")
        counts = engine.num_running(), engine.num_waiting()
        await engine.abort()
        await engine.resume()
        await asyncio.gather(*tasks)
        return counts

    assert asyncio.run(main()) == (2, 1)
    assert (engine.num_running(), engine.num_waiting()) == (0, 0)


def test_invalid_requests_are_refused_at_call_time(make_engine, prompt):
    engine = make_engine(max_model_len=64)
    gen = engine.generate
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        gen("a", prompt(40), SamplingParams(max_tokens=25))
    gen("ok", prompt(40), SamplingParams(max_tokens=24))  # exactly at the limit is fine
    for bad_prompt, params in [
        ([], SamplingParams()),
        ([10_000], SamplingParams()),
        (prompt(3), SamplingParams(max_tokens=0)),
        (prompt(3), SamplingParams(temperature=-1.0)),
        (prompt(3), SamplingParams(top_p=0.0)),
        (prompt(3), SamplingParams(stop=("",))),
    ]:
        with pytest.raises(InvalidRequestError):
            gen("b", bad_prompt, params)
    with pytest.raises(InvalidRequestError):
        gen("", prompt(3), SamplingParams())


def test_duplicate_request_id_is_refused(engine, prompt, h):
    async def main():
        task = asyncio.create_task(h.collect(engine, "dup", prompt(4), SamplingParams(max_tokens=1500, ignore_eos=True)))
        await h.wait_for(lambda: engine.num_running() == 1)
        with pytest.raises(InvalidRequestError, match="already running"):
            engine.generate("dup", prompt(4), SamplingParams())
        await engine.abort(["dup"])
        return await task

    assert asyncio.run(main()).finish_reason == "abort"


def test_sleeping_engine_refuses_generation(engine, prompt, h):
    async def main():
        await engine.sleep(1)
        assert engine.is_sleeping()
        with pytest.raises(EngineStateError):
            engine.generate("x", prompt(3), SamplingParams())
        await engine.wake_up(["weights"])
        assert engine.is_sleeping()  # KV cache still asleep
        await engine.wake_up(["kv_cache"])
        assert not engine.is_sleeping()

    asyncio.run(main())
    assert h.run(engine, prompt(3), SamplingParams(max_tokens=4, ignore_eos=True)).finish_reason == "length"


def test_tokenizer_round_trips(tiny_model_dir, engine):
    assert type(engine.tokenizer) is type(AutoTokenizer.from_pretrained(tiny_model_dir))


def test_final_only_delivers_one_output_equal_to_the_streamed_end(engine, prompt, h):
    async def main():
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, logprobs=True, ignore_eos=True)
        streamed = [o async for o in engine.generate("s", prompt(6), params)]
        final = [o async for o in engine.generate("f", prompt(6), params, final_only=True)]
        # an aborted final-only request still gets every token it produced
        long = asyncio.create_task(h.collect(engine, "cut", prompt(6), SamplingParams(max_tokens=1500, ignore_eos=True),
                                             final_only=True))
        await h.wait_for(lambda: engine.num_running() == 1)
        await asyncio.sleep(0.05)
        await engine.abort(["cut"])
        return streamed, final, await long

    streamed, final, cut = asyncio.run(main())
    assert len(streamed) > 1 and len(final) == 1
    end, only = streamed[-1], final[0]
    assert only.token_ids == end.token_ids and only.logprobs == end.logprobs
    assert only.weight_versions == end.weight_versions and only.finish_reason == "length"
    assert cut.finish_reason == "abort" and 0 < len(cut.token_ids) < 1500
    assert len(cut.logprobs) == len(cut.token_ids)


def test_a_control_call_is_answered_before_the_next_step(engine, prompt, h):
    """The worker answers commands as soon as it ran them; a step that never ends must not hold
    the answer back (it used to come after the step that followed the commands)."""
    import threading

    core = engine._core
    real_step = core.step
    gate, gated = threading.Event(), threading.Event()

    def step() -> None:
        if gated.is_set():
            gate.wait(30)
        real_step()

    core.step = step
    try:
        async def main():
            long = SamplingParams(max_tokens=1500, ignore_eos=True)
            a = asyncio.create_task(h.collect(engine, "a", prompt(5), long))
            b = asyncio.create_task(h.collect(engine, "b", prompt(7), long))  # work goes on
            await h.wait_for(lambda: engine.num_running() == 2)
            gated.set()  # from the step after the current one, steps block
            try:
                aborted = await asyncio.wait_for(engine.abort(["a"]), 10)
            finally:
                gate.set()
            await engine.abort(["b"])
            return aborted, await a, await b

        aborted, out, _ = asyncio.run(main())
    finally:
        core.step = real_step
    assert aborted == 1 and out.finish_reason == "abort"


def test_sleep_answers_first_and_the_requests_it_aborted_still_end(engine, prompt, h):
    async def main():
        a = asyncio.create_task(h.collect(engine, "a", prompt(5), SamplingParams(max_tokens=1500, ignore_eos=True)))
        await h.wait_for(lambda: engine.num_running() == 1)
        await engine.sleep(1)
        answered_before_the_abort_reached_the_request = not a.done()
        try:
            out = await a
        finally:
            await engine.wake_up()
        return answered_before_the_abort_reached_the_request, out

    first, out = asyncio.run(main())
    assert first and out.finish_reason == "abort"


def test_a_prefills_first_token_reaches_its_caller_before_the_steps_decode(make_engine, prompt, h):
    """On CPU a step prefills newcomers, then decodes every running row; the newcomers' first
    tokens go out between the two (time to first token is a prefill, not a prefill + a decode)."""
    engine = make_engine()
    asyncio.run(h.collect(engine, "warm", prompt(7), SamplingParams(max_tokens=2, **GREEDY)))  # a cold forward is slow
    runner = engine._core.runner
    decode = runner.decode_sample
    slow_s = 1.0

    def slow_decode(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(slow_s)
        return decode(*args, **kwargs)

    runner.decode_sample = slow_decode

    async def main():
        t0 = time.perf_counter()
        gen = engine.generate("ttft", prompt(7), SamplingParams(max_tokens=3, **GREEDY))
        first = await gen.__anext__()
        waited = time.perf_counter() - t0
        rest = [o async for o in gen]
        return first, waited, rest

    first, waited, rest = asyncio.run(main())
    assert len(first.token_ids) == 1 and waited < slow_s, (first.token_ids, waited)
    assert len(rest[-1].token_ids) == 3 and rest[-1].finish_reason == "length"
