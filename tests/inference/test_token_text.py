"""Logprob token strings as vLLM 0.32 writes them (server/token_text.py), and the chat message
without a `tool_calls` key when no tool was called. The same strings and shapes are compared
with vLLM's own server in contract/test_vllm_metrics.py (`-m vllm`)."""

from __future__ import annotations

import asyncio

import httpx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kit import sse_events
from rlix.inference.server.app import create_app
from rlix.inference.server.token_text import TokenTexts, space_marker

KEY = "k"


def _read(texts: TokenTexts, ids: list[int]) -> list[str]:
    return [texts.at(t, ids[:i]) for i, t in enumerate(ids)]


def test_byte_tokens_read_empty_until_the_one_completing_their_character(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = TokenTexts(tok)
    assert space_marker(tok) is None  # byte-level BPE: decoding a token alone keeps its spaces
    for text, want in (("a€b", ["a", "", "", "€", "b"]), ("日本", ["", "", "日", "", "", "本"]),
                       ("🙂x", ["", "", "", "🙂", "x"])):
        ids = tok.encode(text, add_special_tokens=False)
        alone = [tok.decode([t]) for t in ids]
        assert [a for a, w in zip(alone, want) if a != w] == ["\ufffd"] * (len(ids) - sum(c.isascii() for c in text))
        assert _read(texts, ids) == want, text
    # an alternative at a position reads against the same sampled tokens before it
    ids = tok.encode("€", add_special_tokens=False)
    assert texts.at(ids[-1], ids[:-1]) == "€" and texts.at(ids[-1], []) == ""


def test_sentencepiece_pieces_keep_their_leading_space():
    """A Metaspace pre-tokenizer's decoder drops a lone piece's leading marker; vLLM restores it."""
    vocab = {"[UNK]": 0, "\u2581hello": 1, "world": 2, "\u2581\u2581x": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    texts = TokenTexts(tok)
    assert space_marker(tok) == "\u2581"
    assert tok.decode([1]) == "hello" and texts.alone(1) == " hello"
    assert texts.alone(2) == "world" and texts.alone(3).endswith("x") and texts.alone(3).startswith("  ")


def test_chat_logprobs_of_byte_tokens_and_no_tool_calls_key(engine):
    """Output held to the three bytes of "€" (a bias): every token's string and bytes, whole and
    streamed chunk by chunk (a chunk's tokens read against the chunks before); with tools offered
    and none called, no `tool_calls` key in the message nor in any streamed delta."""
    app = create_app(engine, engine.tokenizer, "tiny", KEY)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
            "temperature": 0, "ignore_eos": True}
    biased = {**chat, "logprobs": True, "logit_bias": {"161": 100, "227": 100, "108": 100}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            whole = (await http.post("/v1/chat/completions", json=biased)).json()
            streamed = (await http.post("/v1/chat/completions", json={**biased, "stream": True})).text
            called = (await http.post("/v1/chat/completions", json={**chat, "tools": tools})).json()
            called_stream = (await http.post("/v1/chat/completions",
                                             json={**chat, "tools": tools, "stream": True})).text
            return whole, streamed, called, called_stream

    whole, streamed, called, called_stream = asyncio.run(main())
    choice = whole["choices"][0]
    got = [(c["token"], c["bytes"]) for c in choice["logprobs"]["content"]]
    # each of the three is U+FFFD alone: the first has no context (""), a completed "€" is
    # carried by its last byte, a byte that never completes one stays ""
    assert len(got) == 9 and got[0] == ("", []) and {t for t, _ in got} <= {"", "€"}
    assert all(b == list(t.encode()) for t, b in got)
    assert "".join(t for t, _ in got) == choice["message"]["content"].replace("\ufffd", "")
    events = sse_events(streamed)
    assert [(c["token"], c["bytes"]) for e in events for ch in e["choices"] if ch.get("logprobs")
            for c in ch["logprobs"]["content"]] == got

    message = called["choices"][0]["message"]
    assert called["choices"][0]["finish_reason"] == "length" and "tool_calls" not in message
    assert all("tool_calls" not in ch.get("delta", {}) for e in sse_events(called_stream) for ch in e["choices"])
