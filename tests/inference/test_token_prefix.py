"""NeMo Gym's `required_prefix_token_ids` on chat completions (server/token_prefix.py): the next
turn's prompt starts with the previous call's prompt and sampled ids exactly, even where the
template's re-tokenization of that turn differs, and goes on with what the template renders
after that turn; the prefix may also ride on the assistant message (NeMo RL's rule). A prefix
that is not this conversation's is a 400 naming the field."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from kit import KEY
from rlix.errors import InvalidRequestError
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.server.app import create_app
from rlix.inference.server.token_prefix import required_prefix, splice

FIRST = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def render(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def sampled_turn(tok, text: str) -> list[int]:
    """An answer as a model might have sampled it: character by character (not the merges the
    tokenizer would make of the text), then end-of-turn."""
    return [tok.convert_tokens_to_ids(tok.tokenize(ch)[0]) for ch in text] + [tok.convert_tokens_to_ids("<|im_end|>")]


def test_the_prompt_starts_with_the_sampled_ids_and_goes_on_as_rendered(tok):
    first_prompt = render(tok, FIRST)
    answer = sampled_turn(tok, "hello there")
    second = [*FIRST, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"}]
    rendered = render(tok, second)
    assert rendered[: len(first_prompt) + len(answer)] != first_prompt + answer  # re-tokenized otherwise
    got = splice(rendered, first_prompt + answer, tok.all_special_ids, "required_prefix_token_ids")
    tail = rendered[rendered.index(answer[-1], len(first_prompt)) + 1:]  # after the assistant turn's end
    assert got == first_prompt + answer + tail
    assert tok.decode(got[len(first_prompt) + len(answer):]) == tok.decode(tail)
    assert tok.decode(tail).startswith("\n<|im_start|>user\nmore<|im_end|>")


def test_a_prefix_that_is_not_this_conversations_is_refused(tok):
    rendered = render(tok, FIRST)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(InvalidRequestError, match="must end with a special token") as exc:
        splice(rendered, rendered[:3], tok.all_special_ids, "required_prefix_token_ids")
    assert exc.value.param == "required_prefix_token_ids"
    with pytest.raises(InvalidRequestError, match="not a prefix of this conversation"):
        splice(rendered, [end, end, end], tok.all_special_ids, "messages[1]")


def test_the_field_wins_else_the_last_assistant_message_carries_it():
    msgs = [{"role": "user", "content": "a"},
            {"role": "assistant", "content": "x", "prompt_token_ids": [1, 2], "generation_token_ids": [3]},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "y", "prompt_token_ids": [1, 2, 3, 4], "generation_token_ids": [5, 2]},
            {"role": "user", "content": "c"}]
    assert required_prefix([9, 2], msgs) == ([9, 2], "required_prefix_token_ids")
    assert required_prefix(None, msgs) == ([1, 2, 3, 4, 5, 2], "messages[3]")
    assert required_prefix(None, msgs[:1]) is None
    with pytest.raises(InvalidRequestError) as exc:
        required_prefix(None, [{"role": "assistant", "content": "", "prompt_token_ids": ["x"]}])
    assert exc.value.param == "messages[0].prompt_token_ids"


def test_over_http_the_engine_is_given_the_spliced_prompt(tiny_model_dir, tok):
    engine = TorchEngine.from_pretrained(tiny_model_dir, device="cpu", max_num_seqs=4, max_model_len=512)
    try:
        with TestClient(create_app(engine, engine.tokenizer, "tiny", KEY),
                        headers={"Authorization": f"Bearer {KEY}"}) as http:
            first = http.post("/v1/chat/completions", json={"model": "tiny", "messages": FIRST, "max_tokens": 4,
                                                           "temperature": 0, "return_token_ids": True}).json()
            prompt, out = first["prompt_token_ids"], first["choices"][0]["token_ids"]
            end = tok.convert_tokens_to_ids("<|im_end|>")
            prefix = prompt + out + ([] if out[-1] == end else [end])  # a finished turn ends with it
            turn = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
            follow = [*FIRST, turn, {"role": "user", "content": "more"}]
            body = {"model": "tiny", "max_tokens": 2, "return_token_ids": True}
            explicit = http.post("/v1/chat/completions", json={**body, "messages": follow,
                                                              "required_prefix_token_ids": prefix}).json()
            assert explicit["prompt_token_ids"][: len(prefix)] == prefix
            carried = [*FIRST, {**turn, "prompt_token_ids": prompt, "generation_token_ids": prefix[len(prompt):]},
                       {"role": "user", "content": "more"}]
            implicit = http.post("/v1/chat/completions", json={**body, "messages": carried}).json()
            assert implicit["prompt_token_ids"] == explicit["prompt_token_ids"]
            bad = http.post("/v1/chat/completions", json={**body, "messages": follow,
                                                         "required_prefix_token_ids": prefix[:-1] + [5]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "required_prefix_token_ids"
    finally:
        engine.close()
