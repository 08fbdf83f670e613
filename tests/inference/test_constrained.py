"""Constrained decoding inside the engine (constrained.py): a grammar's mask applied to a row's
logits before the pick, padded logits never picked, unconstrained rows untouched and still
plain, the matcher advanced by every kept token, the request ended when the grammar is, and a
constraint that does not compile refused at generate() naming its field."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
from transformers import AutoTokenizer

from rlix.errors import InvalidRequestError
from rlix.inference.engine.api import OutputConstraint, SamplingParams
from rlix.inference.engine.constrained import GrammarCompiler, RowGrammar, apply_grammars, choice_grammar
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
