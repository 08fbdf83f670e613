"""Overlapped decode (core.py): step k+1 launched before step k's tokens are read.

On CPU decode steps run eagerly, so overlap gains nothing here, but the logic is the same one the
GPU runs (rows that finished in the step in flight decoded one token too many, rows retired while
a step is in flight, tokens gathered from the previous step's picks). These tests drive
`EngineCore` step by step with overlap on and off over the same requests and require the same
tokens, logprobs and finish reasons, through admissions, stops the host cannot foresee, groups,
an abort and a pause landing between two steps; a weight swap settles the step in flight under
the old version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.core import EngineCore
from rlix.inference.engine.runner.model_runner import ModelRunner, load_model
from rlix.inference.engine.sequence import PromptGroup, Sequence
from rlix.inference.engine.weights import WeightStaging


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, torch.device("cpu"), None)


def new_core(tiny, overlap: bool, rows: int = 4, full_cache: bool = True) -> EngineCore:
    """full_cache: the KV cache at max_model_len from the start (as with CUDA graphs), so
    newcomers are prefilled while a step is in flight; else it grows, and a step that admits
    or grows settles the one in flight first."""
    model, tokenizer = tiny
    runner = ModelRunner(model, device=torch.device("cpu"), num_rows=rows, max_model_len=256,
                         kv_initial_capacity=256 if full_cache else 32)
    return EngineCore(runner, tokenizer, max_num_seqs=rows, eos_ids=[], overlap=overlap)


def prompt_of(length: int, salt: int) -> list[int]:
    return [(7 * j + 13 * salt) % 200 + 5 for j in range(length)]


def requests(stop_token: int | None = None) -> list[list[Sequence]]:
    """Ten requests of mixed lengths and settings; one of three samples sharing a prompt."""
    out: list[list[Sequence]] = []
    for i in range(9):
        params = SamplingParams(max_tokens=3 + (7 * i) % 17, temperature=0.0 if i % 3 == 0 else 1.0,
                                seed=100 + i, ignore_eos=True,
                                stop_token_ids=(stop_token,) if stop_token is not None and i % 2 else ())
        out.append([Sequence(f"r{i}", prompt_of(5 + 3 * i, salt=i), params)])
    group = PromptGroup("g")
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3, ignore_eos=True)
    for j in range(3):
        seq = Sequence("g", prompt_of(9, salt=99), params, index=j, group=group)
        group.members.append(seq)
    out.append(group.members)
    return out


def run(core: EngineCore, reqs: list[list[Sequence]], at: dict[int, Callable[[EngineCore], None]] | None = None,
        ) -> dict[str, tuple]:
    for seqs in reqs:
        core.add_group(seqs) if len(seqs) > 1 else core.add(seqs[0])
    steps = 0
    while core.has_work():
        if at and steps in at:
            at[steps](core)
        core.step()
        steps += 1
        assert steps < 500
    core.settle()
    return {f"{s.request_id}/{s.index}": (s.output_ids, s.logprobs, s.finish_reason, s.weight_versions)
            for seqs in reqs for s in seqs}


def same(a: dict[str, tuple], b: dict[str, tuple]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        ids_a, lps_a, *rest_a = a[key]
        ids_b, lps_b, *rest_b = b[key]
        assert ids_a == ids_b, key
        assert lps_a == pytest.approx(lps_b, abs=1e-5), key
        assert rest_a == rest_b, key


@pytest.mark.parametrize("full_cache", [True, False])
def test_overlapped_steps_give_the_same_tokens(tiny, full_cache):
    plain = run(new_core(tiny, overlap=False), requests())
    core = new_core(tiny, overlap=True, full_cache=full_cache)
    overlapped = run(core, requests())
    same(plain, overlapped)
    assert core.overlapped_steps > 20  # the chained path ran, not only settle-and-launch
    for i in range(9):  # no stops: every row got exactly its max_tokens, the extra ones dropped
        assert len(overlapped[f"r{i}/0"][0]) == 3 + (7 * i) % 17


def test_stops_the_host_cannot_foresee_drop_the_extra_token(tiny):
    """A stop token ends a row at a step whose successor was already launched for it."""
    first = run(new_core(tiny, overlap=False), requests())
    stop = first["r1/0"][0][2]  # a token sampled mid-way: rows stopping on it stop early
    plain = run(new_core(tiny, overlap=False), requests(stop))
    assert any(r[2] == "stop" for r in plain.values())
    core = new_core(tiny, overlap=True)
    same(plain, run(core, requests(stop)))
    assert core.overlapped_steps > 0


@pytest.mark.parametrize("full_cache", [True, False])
def test_abort_and_pause_between_overlapped_steps(tiny, full_cache):
    def pause(core: EngineCore) -> None:
        core.pause("keep")
        assert not core.has_work() and core._in_flight is None  # the step in flight was settled
        core.resume()

    events = {4: lambda c: c.abort(["r2"]), 9: pause}
    plain = run(new_core(tiny, overlap=False), requests(), dict(events))
    core = new_core(tiny, overlap=True, full_cache=full_cache)
    overlapped = run(core, requests(), dict(events))
    same(plain, overlapped)
    assert overlapped["r2/0"][2] == "abort" and 0 < len(overlapped["r2/0"][0]) < 9
    assert core.overlapped_steps > 0


def test_a_weight_swap_settles_the_step_in_flight_under_the_old_version(tiny):
    """Tokens recorded under version 0 were all computed with version 0's weights: each row's
    version-0 tokens are exactly what a run that never swapped sampled (every row is seeded), and
    its first version-1 token is, mostly, not (the swap negates an MLP's output)."""
    model, _ = tiny
    name = "model.layers.0.mlp.down_proj.weight"
    param = dict(model.named_parameters())[name]
    served = param.detach().clone()

    def swap(core: EngineCore) -> None:
        staging = WeightStaging(core.weights, 1, allow_partial=True)
        staging.add({name: -served})
        core.apply_update(staging)

    never = run(new_core(tiny, overlap=False), requests())
    core = new_core(tiny, overlap=True)
    try:
        swapped = run(core, requests(), {13: swap})
    finally:
        with torch.no_grad():
            param.copy_(served)
    both, changed = 0, 0
    for key, (ids, _, reason, versions) in swapped.items():
        # versions: (first token index, version) spans; tokens before version 1's span are old
        old = next((start for start, v in versions if v == 1), len(ids))
        assert ids[:old] == never[key][0][:old], key
        assert len(ids) == len(never[key][0]) and reason == "length", key
        if len(versions) == 2:
            both += 1
            changed += ids[old] != never[key][0][old]
    assert both >= 3 and changed >= both / 2, (both, changed)
    assert core.overlapped_steps > 0


def test_engine_serves_with_overlap(make_engine, h, prompt):
    """The threaded engine with overlap on: concurrent seeded requests equal one at a time."""
    engine = make_engine(max_num_seqs=3, overlap_steps=True)
    params = [SamplingParams(max_tokens=6 + i, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    prompts = [prompt(4 + i, salt=i) for i in range(6)]

    async def together():
        return await asyncio.gather(*(h.collect(engine, f"r{i}", prompts[i], params[i]) for i in range(6)))

    outs = asyncio.run(together())
    for i, out in enumerate(outs):
        alone = h.run(engine, prompts[i], params[i], request_id=f"alone{i}")
        assert out.token_ids == alone.token_ids and len(out.token_ids) == 6 + i
    assert engine._core.overlapped_steps > 0


@pytest.mark.gpu
def test_overlapped_graph_steps_give_the_same_tokens_on_gpu(tiny_model_dir):
    """The same on CUDA, where decode runs through graphs and step k+1 really is queued on the
    device before step k's picks are copied back."""
    tiny_gpu = load_model(tiny_model_dir, torch.device("cuda"), None)

    def core(overlap: bool) -> EngineCore:
        model, tokenizer = tiny_gpu
        runner = ModelRunner(model, device=torch.device("cuda"), num_rows=4, max_model_len=256)
        assert runner.graphs is not None
        return EngineCore(runner, tokenizer, max_num_seqs=4, eos_ids=[], overlap=overlap)

    first = run(core(False), requests())
    stop = first["r1/0"][0][2]
    plain = run(core(False), requests(stop))
    overlapping = core(True)
    same(plain, run(overlapping, requests(stop)))
    assert overlapping.overlapped_steps > 20


@pytest.mark.parametrize("late", ["top_logprobs", "penalty"])
def test_a_newcomer_that_samples_on_the_host_while_a_step_is_in_flight(tiny, late):
    """Plain rows run chained; then a request whose row samples on the host (alternatives asked
    for, or a penalty) is admitted while a step is in flight: that step is read and the batch
    decodes at once. The next step must not chain on the step already read (its picks are not
    the rows' inputs any more); every row gets the tokens it gets without overlap."""
    def reqs() -> list[list[Sequence]]:
        early = [[Sequence(f"p{i}", prompt_of(6 + i, salt=i), SamplingParams(
            max_tokens=24, temperature=1.0, seed=10 + i, ignore_eos=True))] for i in range(2)]
        extra = {"top_logprobs": 2} if late == "top_logprobs" else {"presence_penalty": 0.5}
        return early + [[Sequence("late", prompt_of(7, salt=50), SamplingParams(
            max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, **extra))]]

    def add_late_at_step(k: int) -> Callable[[list[list[Sequence]]], dict[str, tuple]]:
        def go(core: EngineCore, all_reqs: list[list[Sequence]]) -> dict[str, tuple]:
            return run(core, all_reqs[:2], {k: lambda c: c.add(all_reqs[2][0])}) | {
                "late/0": tuple(getattr(all_reqs[2][0], f) for f in ("output_ids", "logprobs", "finish_reason",
                                                                      "weight_versions"))}
        return go

    for k in (3, 6):
        plain_reqs, overlap_reqs = reqs(), reqs()
        plain = add_late_at_step(k)(new_core(tiny, overlap=False), plain_reqs)
        core = new_core(tiny, overlap=True)
        overlapped = add_late_at_step(k)(core, overlap_reqs)
        same(plain, overlapped)
        assert core.overlapped_steps > 5
