"""Model presets: built files load back with plain transformers; resolution rules."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlix.errors import ConfigError
from rlix.models import PRESETS, build_preset, preset_config, resolve_model
from rlix.models.tokenizer import build_tokenizer


def test_tiny_loads_back_with_transformers(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = model.config
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers) == (256, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM's CPU kernels need 64
    assert model.model.layers[0].self_attn.head_dim == 64
    assert config.vocab_size == len(tokenizer) < 1000
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert set(model.generation_config.eos_token_id) == {
        tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    out = model.generate(torch.tensor([tokenizer("Hello").input_ids]), max_new_tokens=4,
                         do_sample=False)
    assert out.shape == (1, len(tokenizer("Hello").input_ids) + 4)


def test_chat_template_renders_chatml(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # specials stay single tokens
    assert tokenizer.decode(ids) == text


def test_loaded_tokenizer_encodes_like_the_trained_one(tiny_model_dir):
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    trained = build_tokenizer()
    for text in ["The scheduler moves GPUs.", "x = 1234567\n\n\ty", "héllo 😀 wörld", "it's we'll"]:
        assert loaded(text).input_ids == trained(text).input_ids
        assert loaded.decode(loaded(text).input_ids) == text  # byte-level: lossless


def test_build_is_deterministic(tiny_model_dir, tmp_path):
    again = build_preset("tiny", tmp_path / "again")
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(again).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resolve_builds_a_preset_once_then_reuses_it(tmp_path):
    first = resolve_model("tiny", cache_dir=tmp_path)
    assert (first / "config.json").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny", cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((first / "rlix_preset.json").read_text())["preset"] == "tiny"
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging dir left


def test_resolve_accepts_a_checkpoint_dir_and_refuses_the_rest(tiny_model_dir, tmp_path):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(ConfigError, match="neither a preset"):
        resolve_model("Qwen/Qwen2-0.5B", cache_dir=tmp_path)
    with pytest.raises(ConfigError):
        resolve_model(tmp_path)  # a dir without config.json


def test_resolve_uses_the_env_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("RLIX_CACHE_DIR", str(tmp_path / "cache"))
    assert resolve_model("tiny").is_relative_to(tmp_path / "cache")


@pytest.mark.parametrize("name,hidden,layers,heads,kv_heads,head_dim,params_m,weights", [
    ("small", 512, 8, 8, 2, 64, (20, 30), "file"),
    ("qwen2-0.5b-shape", 896, 24, 14, 2, 64, (300, 400), "file"),
    ("qwen2-1.5b-shape", 1536, 28, 12, 2, 128, (1300, 1600), "file"),  # Qwen2-1.5B's own head dim
    ("qwen2.5-3b-shape", 2048, 36, 16, 2, 128, (2700, 2900), "file"),
    ("qwen2.5-7b-shape", 3584, 28, 28, 4, 128, (6400, 6700), "seeded"),
    ("qwen2.5-14b-shape", 5120, 48, 40, 8, 128, (13000, 13400), "seeded"),
])
def test_real_shapes(name, hidden, layers, heads, kv_heads, head_dim, params_m, weights):
    config = preset_config(name, vocab_size=384, eos_token_id=2, pad_token_id=0)
    assert (config.hidden_size, config.num_hidden_layers) == (hidden, layers)
    assert config.num_attention_heads == heads and config.num_key_value_heads == kv_heads
    assert PRESETS[name].weights == weights
    assert config.hidden_size // config.num_attention_heads == head_dim
    assert PRESETS[name].head_dim == head_dim
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert params_m[0] < count < params_m[1]
