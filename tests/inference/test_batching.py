"""EngineCore step by step: rows join and leave at chosen steps; KV rows move; output stays exact."""

from __future__ import annotations

import pytest
import torch

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.batching import plan_prefill_groups
from rlix.inference.engine.core import EngineCore
from rlix.inference.engine.runner.model_runner import ModelRunner, load_model
from rlix.inference.engine.sequence import Sequence


@pytest.fixture
def core(tiny_model_dir):
    cpu = torch.device("cpu")
    model, tokenizer = load_model(tiny_model_dir, cpu, None)
    # A tiny initial KV capacity forces the cache to grow (and copy live rows) mid-run.
    runner = ModelRunner(model, device=cpu, num_rows=3, max_model_len=2048, kv_initial_capacity=8)
    return EngineCore(runner, tokenizer, max_num_seqs=3, eos_ids=[])


def greedy(request_id: str, prompt: list[int], n: int) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(max_tokens=n, temperature=0.0))


def test_rows_join_and_leave_at_token_granularity(core, hf_model, h, prompt):
    seqs = {name: greedy(name, prompt(n, salt=i), m) for i, (name, n, m) in enumerate(
        [("a", 5, 30), ("b", 17, 4), ("c", 3, 12), ("d", 40, 9), ("e", 9, 14), ("f", 1, 6)])}
    schedule = {0: "a", 3: "b", 4: "c", 5: "d", 6: "e", 11: "f"}  # step -> arrival
    seen = []  # (running rows in order, waiting) after each step
    step = 0
    while step in schedule or core.running or core.waiting:
        if step in schedule:
            core.add(seqs[schedule[step]])
        core.step()
        seen.append(("".join(s.request_id for s in core.running),
                     "".join(s.request_id for s in core.waiting)))
        step += 1
    assert seen[4] == ("abc", "")
    assert seen[5] == ("ac", "d")  # b left; c moved from row 2 to row 1; d found no free row
    assert seen[6] == ("acd", "e")  # d took the freed row mid-generation of a and c
    assert seen[13] == ("ac", "ef")  # d left from the last row
    assert seen[14] == ("ae", "f")  # c left; e joined
    assert max(len(r) for r, _ in seen) == 3
    assert core.runner.cache.capacity >= 49  # grew from 8, copying the live rows
    for seq in seqs.values():
        n = seq.params.max_tokens
        assert seq.finish_reason == "length"
        assert seq.output_ids == h.reference_greedy(hf_model, seq.prompt_token_ids, n), seq.request_id
        assert seq.logprobs == pytest.approx(
            h.raw_logprobs(hf_model, seq.prompt_token_ids, seq.output_ids), abs=1e-4)


def test_abort_in_the_middle_row_keeps_the_others_exact(core, hf_model, h, prompt):
    a, b, c = greedy("a", prompt(6), 20), greedy("b", prompt(11, 1), 20), greedy("c", prompt(4, 2), 20)
    for seq in (a, b, c):
        core.add(seq)
    for _ in range(5):
        core.step()
    assert [s.request_id for s in core.running] == ["b", "a", "c"]  # prefilled longest first
    assert core.abort(["a"]) == 1  # row 1 leaves; the last row (c) moves into it
    assert [s.request_id for s in core.running] == ["b", "c"]
    while core.running:
        core.step()
    assert a.finish_reason == "abort" and 0 < len(a.output_ids) < 20
    for seq in (b, c):
        assert seq.output_ids == h.reference_greedy(hf_model, seq.prompt_token_ids, 20)


def test_prefill_groups_bound_padding():
    assert plan_prefill_groups([]) == []
    assert plan_prefill_groups([10]) == [[0]]
    groups = plan_prefill_groups([64, 8, 60, 9, 62, 8])
    assert sorted(i for g in groups for i in g) == list(range(6))
    lengths = [64, 8, 60, 9, 62, 8]
    for group in groups:
        width = max(lengths[i] for i in group)
        assert width * len(group) <= 1.25 * sum(lengths[i] for i in group)
    assert len(groups) == 2  # the long ones together, the short ones together
    assert len(plan_prefill_groups(lengths, float("inf"))) == 1  # GPU: one forward
    assert len(plan_prefill_groups(lengths, float("inf"), max_padded_tokens=200)) == 2


def test_gpu_style_admission_waits_for_a_batch_of_free_rows(tiny_model_dir, prompt):
    """min_admit_batch / max_admit_delay_steps: newcomers join together, or after a delay."""
    cpu = torch.device("cpu")
    model, tokenizer = load_model(tiny_model_dir, cpu, None)
    runner = ModelRunner(model, device=cpu, num_rows=4, max_model_len=256)
    core = EngineCore(runner, tokenizer, max_num_seqs=4, eos_ids=[], min_admit_batch=2,
                      max_admit_delay_steps=3)
    long_ones = [greedy(f"l{i}", prompt(4, i), 50) for i in range(3)]
    for seq in long_ones:
        core.add(seq)
    core.step()  # an idle engine admits at once
    assert len(core.running) == 3
    late = greedy("late", prompt(5, 9), 5)
    core.add(late)
    waited = 0
    while late not in core.running:  # one free row < 2: wait out the delay
        core.step()
        waited += 1
    assert waited == 4 and late.output_ids  # admitted on the 4th step (delay 3 exceeded)
    core.abort(["l0", "l1"])  # two rows free now
    a, b = greedy("a", prompt(3, 5), 5), greedy("b", prompt(6, 6), 5)
    core.add(a)
    core.add(b)
    core.step()
    assert a in core.running and b in core.running  # enough free rows: both join at once
