"""Constrained decoding inside the engine (constrained.py): a grammar's mask applied to a row's
logits before the pick, padded logits never picked, unconstrained rows untouched and still
plain, the matcher advanced by every kept token, the request ended when the grammar is, and a
constraint that does not compile refused at generate() naming its field. A continuation's
matcher (a re-dispatched request's: `already_generated`) starts after the tokens already
generated, so it masks and picks as the uninterrupted request would have."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from rlix.errors import InvalidRequestError
from rlix.inference.engine.api import OutputConstraint, SamplingParams
from rlix.inference.engine.constrained import (GrammarCompiler, RowGrammar, apply_grammars, choice_grammar,
                                               grammar_after)
from rlix.inference.engine.sampling import RowSampling, sample


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tok):
    # logits 16 wider than the tokenizer: padded embeddings, as real checkpoints have
    return GrammarCompiler(tok, len(tok) + 16, [tok.eos_token_id])


def ids_of(tok, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_mask_allows_exactly_the_grammars_next_tokens_and_never_the_padding(tok, compiler):
    grammar = RowGrammar(compiler.compile(OutputConstraint("regex", "[0-9]+x")))
    vocab = compiler.vocab_size
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_grammars(logits, [1], [grammar])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])  # other rows untouched
    allowed = torch.isfinite(logits[1]).nonzero()[:, 0].tolist()
    assert allowed and all(tok.decode([t]).isdigit() for t in allowed)
    digits = [t for t in range(len(tok)) if tok.decode([t]).isdigit()]
    assert sorted(allowed) == sorted(digits)  # every digit token, nothing else
    assert torch.isinf(logits[1, len(tok):]).all()  # padding ids: -inf
    assert torch.equal(logits[1, allowed], before[1, allowed])  # allowed logits unchanged


def test_masks_of_several_rows_and_ends(tok, compiler):
    pick = RowGrammar(compiler.compile(OutputConstraint("choice", choices=("yes", "no"))))
    digits = RowGrammar(compiler.compile(OutputConstraint("regex", "[0-9]")))
    logits = torch.zeros(4, compiler.vocab_size)
    apply_grammars(logits, [0, 3], [pick, digits])
    assert torch.isfinite(logits[1]).all() and torch.isfinite(logits[2]).all()
    first = {tok.decode([t]) for t in torch.isfinite(logits[0]).nonzero()[:, 0].tolist()}
    assert first and all("yes".startswith(s) or "no".startswith(s) for s in first)
    for t in ids_of(tok, "7"):
        assert digits.accept(t)
    logits = torch.zeros(1, compiler.vocab_size)
    apply_grammars(logits, [0], [digits])
    assert torch.isfinite(logits[0]).nonzero()[:, 0].tolist() == [tok.eos_token_id]  # complete: only the end
    assert digits.accept(tok.eos_token_id) and digits.terminated


def test_a_constrained_row_is_not_plain_and_samples_only_allowed_tokens(tok, compiler):
    compiled = compiler.compile(OutputConstraint("regex", "(ab|cd)+"))
    rows = [RowSampling(1.0, 0, 1.0, random.Random(i), grammar=RowGrammar(compiled)) for i in range(16)]
    free = RowSampling(1.0, 0, 1.0, random.Random(99))
    assert free.plain and not any(r.plain for r in rows)
    logits = torch.randn(17, compiler.vocab_size)
    picked = sample(logits, [*rows, free]).tokens
    for token in picked[:16]:
        assert RowGrammar(compiled).accept(token), tok.decode([token])  # a token the grammar allows first
        assert tok.decode([token])[0] in "ac"
    alone = sample(logits[16:], [RowSampling(1.0, 0, 1.0, random.Random(99))]).tokens
    assert picked[16] == alone[0]  # the unconstrained row draws what it draws alone


def test_min_tokens_never_masks_what_the_grammar_must_end_with(tok, compiler):
    """A complete grammar allows only the end; a min_tokens mask on it would leave nothing:
    the grammar wins."""
    grammar = RowGrammar(compiler.compile(OutputConstraint("choice", choices=("7",))))
    for t in ids_of(tok, "7"):
        grammar.accept(t)
    row = RowSampling(1.0, 0, 1.0, random.Random(0), grammar=grammar)
    row.hold((tok.eos_token_id,))
    assert sample(torch.randn(1, compiler.vocab_size), [row]).tokens == [tok.eos_token_id]


def test_choices_are_escaped_into_the_grammar():
    assert choice_grammar(('a"b', "c\\d", "e\nf")) == 'root ::= "a\\"b" | "c\\\\d" | "e\\nf"'


@pytest.mark.parametrize("constraint", [
    OutputConstraint("json", '{"type": "objectx"}', param="response_format.json_schema.schema"),
    OutputConstraint("regex", "(ab", param="structured_outputs.regex"),
    OutputConstraint("regex", "a\x00", param="structured_outputs.regex"),
    OutputConstraint("grammar", "root ::= nowhere", param="structured_outputs.grammar"),
    OutputConstraint("structural_tag", '{"type": "structural_tag"}', param="structured_outputs.structural_tag"),
])
def test_what_does_not_compile_is_refused_naming_its_field(compiler, constraint):
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(constraint)
    assert err.value.param == constraint.param and "cannot be compiled" in str(err.value)
    assert "/project/" not in str(err.value)  # the library's source location is not the client's business


def test_compiled_grammars_are_cached_by_constraint(compiler):
    c = OutputConstraint("regex", "[a-z]{3}")
    assert compiler.compile(c) is compiler.compile(OutputConstraint("regex", "[a-z]{3}"))
    assert compiler.compile(c) is not compiler.compile(OutputConstraint("regex", "[a-z]{4}"))


def test_the_engine_ends_a_constrained_request_with_its_grammar(make_engine, h, tok):
    """JSON by schema from the engine, with plain requests in the same batch; n > 1 samples each
    keep their own matcher; the output ends with end-of-sequence once the grammar is complete."""
    engine = make_engine(max_num_seqs=8)
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "boolean"}},
              "required": ["k", "v"], "additionalProperties": False}
    constrained = SamplingParams(max_tokens=200, n=3, seed=5, constraint=OutputConstraint("json", json.dumps(schema)))
    plain = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    prompt = ids_of(tok, "hello there")

    async def run():  # type: ignore[no-untyped-def]
        async def samples() -> list:
            outs = {}
            async for out in engine.generate("c", prompt, constrained):
                outs[out.index] = out
            return [outs[i] for i in range(3)]

        return await asyncio.gather(samples(), h.collect(engine, "p", prompt, plain))

    outs, free = asyncio.run(run())
    for out in outs:
        assert out.finish_reason == "stop" and out.token_ids[-1] in (tok.eos_token_id, *engine._core.eos_ids)
        obj = json.loads(tok.decode(out.token_ids, skip_special_tokens=True))
        assert obj["k"] in ("x", "y") and isinstance(obj["v"], bool)
    assert len(free.token_ids) == 12
    alone = h.run(engine, prompt, plain, request_id="p2")
    assert alone.token_ids == free.token_ids  # the plain row is not changed by its constrained neighbours
    with pytest.raises(InvalidRequestError) as err:
        engine.generate("bad", prompt, SamplingParams(constraint=OutputConstraint("regex", "(", param="x.regex")))
    assert err.value.param == "x.regex"


SCHEMA = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "boolean"},
                                           "w": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
          "required": ["k", "v", "w"], "additionalProperties": False}


def allowed(grammar: RowGrammar, vocab: int) -> list[int]:
    logits = torch.zeros(1, vocab)
    apply_grammars(logits, [0], [grammar])
    return torch.isfinite(logits[0]).nonzero()[:, 0].tolist()


def test_a_matcher_advanced_through_generated_tokens_masks_as_the_one_that_sampled_them(tok, compiler):
    """What the shard taking a re-dispatched request does: its matcher, advanced through the
    tokens the first shard's row sampled, allows at each point exactly what that row's did."""
    compiled = compiler.compile(OutputConstraint("json", json.dumps(SCHEMA)))
    row = RowSampling(1.0, 0, 1.0, random.Random(7), grammar=RowGrammar(compiled))
    torch.manual_seed(0)
    masks, sampled = [], []
    while not row.grammar.terminated:  # type: ignore[union-attr]
        masks.append(allowed(row.grammar, compiler.vocab_size))  # type: ignore[arg-type]
        token = sample(torch.randn(1, compiler.vocab_size), [row]).tokens[0]
        assert row.grammar.accept(token)  # type: ignore[union-attr]
        sampled.append(token)
    assert len(sampled) > 8
    assert set(json.loads(tok.decode(sampled, skip_special_tokens=True))) == {"k", "v", "w"}
    for k in range(len(sampled)):  # every cut point but after the end itself
        advanced = grammar_after(compiled, sampled[:k], "already_generated")
        assert allowed(advanced, compiler.vocab_size) == masks[k], k
    # forked (the n samples of a continuation): the same state, advanced independently
    half = grammar_after(compiled, sampled[:5], "already_generated")
    fork = half.fork()
    assert fork.advance(sampled[5:8]) == 3
    assert allowed(half, compiler.vocab_size) == masks[5] and allowed(fork, compiler.vocab_size) == masks[8]


def test_already_generated_tokens_the_grammar_refuses_are_a_400_naming_the_field(tok, compiler):
    compiled = compiler.compile(OutputConstraint("regex", "[0-9]+x"))
    with pytest.raises(InvalidRequestError) as err:
        grammar_after(compiled, ids_of(tok, "12") + ids_of(tok, "y"), "already_generated")
    assert err.value.param == "already_generated" and "does not allow" in str(err.value)
    with pytest.raises(InvalidRequestError) as err:  # the end already came: nothing to continue
        grammar_after(compiled, ids_of(tok, "1x") + [tok.eos_token_id], "already_generated")
    assert err.value.param == "already_generated"


def test_the_engine_continues_a_constrained_request_from_its_already_generated_tokens(make_engine, h, tok):
    """A greedy constrained answer cut after k tokens and continued (prompt + those k tokens,
    already_generated=k, n = 2 to fork the advanced matcher) gives the uninterrupted answer's
    rest; tokens the grammar refuses, or more than the prompt holds, are refused at generate()."""
    engine = make_engine(max_num_seqs=4)
    c = OutputConstraint("json", json.dumps(SCHEMA), any_whitespace=False)  # greedy: no runs of spaces
    prompt = ids_of(tok, "hello there")
    whole = h.run(engine, prompt, SamplingParams(max_tokens=200, temperature=0.0, constraint=c))
    ref = whole.token_ids
    assert whole.finish_reason == "stop" and len(ref) > 8
    k = len(ref) // 2
    rest = SamplingParams(max_tokens=200 - k, temperature=0.0, constraint=c, n=2, already_generated=k)

    async def continued() -> list:  # type: ignore[type-arg]
        outs = {}
        async for out in engine.generate("cont", prompt + ref[:k], rest):
            outs[out.index] = out
        return [outs[0], outs[1]]

    for out in asyncio.run(continued()):
        assert ref[:k] + out.token_ids == ref and out.finish_reason == "stop"
    bad = ref[:k - 1] + ids_of(tok, "]]")[:1]
    with pytest.raises(InvalidRequestError) as err:
        engine.generate("bad", prompt + bad, SamplingParams(constraint=c, already_generated=k))
    assert err.value.param == "already_generated"
    with pytest.raises(InvalidRequestError) as err:
        engine.generate("long", prompt, SamplingParams(constraint=c, already_generated=len(prompt) + 1))
    assert err.value.param == "already_generated"
