"""min_tokens in the engine: the stop ids masked in the sampler until that many tokens, stop
strings deferred as vLLM defers them; rows without it keep their exact tokens and (on CUDA) their
graphed, overlapped sampling, and a row that reached its min_tokens becomes plain again."""

from __future__ import annotations

import pytest
import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.core import EngineCore
from rlix.inference.engine.runner.model_runner import ModelRunner, load_model
from rlix.inference.engine.sequence import PromptGroup, Sequence

EOS = frozenset({0, 2})  # the tiny preset's (tokenizer and generation config)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=DEVICES)
def tiny(request, tiny_model_dir):
    device = torch.device(request.param)
    return (*load_model(tiny_model_dir, device, None), device)


def new_core(tiny, rows: int = 8) -> EngineCore:
    model, tokenizer, device = tiny
    runner = ModelRunner(model, device=device, num_rows=rows, max_model_len=256, kv_initial_capacity=256)
    assert (runner.graphs is not None) == (device.type == "cuda")  # CUDA: the graphed sampler
    return EngineCore(runner, tokenizer, max_num_seqs=rows, eos_ids=EOS, overlap=True)


def run(core: EngineCore, reqs: list[list[Sequence]]) -> dict[str, Sequence]:
    for seqs in reqs:
        core.add_group(seqs) if len(seqs) > 1 else core.add(seqs[0])
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
        assert steps < 500
    core.settle()
    return {f"{s.request_id}/{s.index}": s for seqs in reqs for s in seqs}


def prompt_of(length: int, salt: int) -> list[int]:
    return [(7 * j + 13 * salt) % 200 + 5 for j in range(length)]


def plain_requests() -> list[list[Sequence]]:
    return [[Sequence(f"p{i}", prompt_of(4 + 3 * i, i),
                      SamplingParams(max_tokens=24, temperature=0.0 if i == 0 else 1.0, seed=10 + i,
                                     ignore_eos=True))] for i in range(4)]


def held_requests(min_tokens: int) -> list[list[Sequence]]:
    """Rows whose stop ids are biased +100: without min_tokens each ends at its first token."""
    eos = SamplingParams(max_tokens=24, temperature=1.0, seed=3, min_tokens=min_tokens, logit_bias=((0, 100.0),))
    stop = SamplingParams(max_tokens=24, temperature=0.0, min_tokens=min_tokens, stop_token_ids=(50,),
                          logit_bias=((50, 100.0),))
    group, grouped = PromptGroup("g"), SamplingParams(max_tokens=24, temperature=1.0, seed=8, n=2,
                                                      min_tokens=min_tokens, logit_bias=((2, 100.0),))
    group.members = [Sequence("g", prompt_of(6, 77), grouped, index=j, group=group) for j in range(2)]
    return [[Sequence("eos", prompt_of(5, 50), eos)], [Sequence("stop", prompt_of(7, 60), stop)], group.members]


def test_min_tokens_masks_stop_ids_and_leaves_other_rows_alone(tiny):
    alone = run(new_core(tiny), plain_requests())
    free = run(new_core(tiny), held_requests(0))
    assert all(len(s.output_ids) == 1 and s.finish_reason == "stop" for s in free.values())
    mixed = run(new_core(tiny), plain_requests() + held_requests(6))
    for key, seq in alone.items():  # the plain rows sampled exactly what they sample alone
        assert mixed[key].output_ids == seq.output_ids, key
        assert mixed[key].logprobs == pytest.approx(seq.logprobs, abs=1e-4), key
    for key in ("eos/0", "stop/0", "g/0", "g/1"):
        seq = mixed[key]
        banned = EOS | set(seq.params.stop_token_ids)
        assert len(seq.output_ids) == 7 and seq.finish_reason == "stop", (key, seq.output_ids)
        assert not banned & set(seq.output_ids[:6]) and seq.output_ids[-1] in banned, key
    assert mixed["stop/0"].stop_reason == 50 and mixed["eos/0"].stop_reason is None


def test_a_row_past_its_min_tokens_samples_plainly_again(tiny):
    """Its first tokens go through the host sampler (the mask); the rest of the batch's steps run
    overlapped (on CUDA: sampled inside the decode graph), as for rows that never had one."""
    core = new_core(tiny)
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=4, min_tokens=2, ignore_eos=True)
    seq = Sequence("m", prompt_of(5, 1), params)
    out = run(core, plain_requests() + [[seq]])
    assert len(out["m/0"].output_ids) == 30 and not EOS & set(seq.output_ids[:2])
    assert seq.sampling.plain and seq.sampling.held is None
    assert core.overlapped_steps >= 20


def test_hold_and_release_follow_the_output_length():
    seq = Sequence("s", [5, 6], SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(9,)))
    seq.hold_stops(EOS)
    assert seq.sampling.held == (0, 2, 9) and not seq.sampling.plain
    for i, token in enumerate((11, 12, 13)):
        assert seq.sampling.held is not None, i
        seq.append(token, -1.0, 0, EOS, None)
    assert seq.sampling.held is None and seq.sampling.plain
    unheld = Sequence("u", [5], SamplingParams(max_tokens=8))
    unheld.hold_stops(EOS)  # min_tokens 0: nothing masked, plain from the start
    assert unheld.sampling.held is None and unheld.sampling.plain


class Letters:
    """A detokenizer whose token i is the letter chr(97 + i)."""

    @staticmethod
    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids)


@pytest.mark.parametrize("stop,min_tokens,ends_after", [
    (("ab",), 0, 2),  # "ab": the first match ends it
    (("ab",), 3, 4),  # "aba": the "ab" inside the first 3 tokens' text is not a match; "abab" is
    (("ba",), 3, 5),  # "ab|ab": "ba" ending at the floor does not count either; "ababa" does
    (("bab", "ab"), 0, 2),  # the one that ends first wins, whichever is listed first
])
def test_stop_strings_wait_for_min_tokens(stop, min_tokens, ends_after):
    seq = Sequence("s", [5], SamplingParams(max_tokens=10, min_tokens=min_tokens, stop=stop))
    for token in (0, 1, 0, 1, 0, 1, 0, 1):
        seq.append(token, -1.0, 0, frozenset(), Letters())
        if seq.finished:
            break
    assert len(seq.output_ids) == ends_after and seq.finish_reason == "stop"
