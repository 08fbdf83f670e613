"""Seeded presets: weights drawn where they load, the same bits in every process and for any
slice of rows, as transformers initialises Qwen2; the trainer and the embedded engine load them;
`rlix check` keeps them away from vLLM."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.models import PRESETS, build_preset, is_seeded, resolve_model
from rlix.models.init import load_causal_lm, seeded_rows
from rlix.models.presets import SEEDED_FILE
from rlix.training.trainer import PolicyTrainer
from rlix.training.types import TrainSample

SRC = Path(__file__).resolve().parents[2] / "src"
#: the tiny shape, seeded and stored in bf16 as the large seeded presets are
TINY_SEEDED = dataclasses.replace(PRESETS["tiny"], weights="seeded", dtype="bfloat16")


@pytest.fixture(scope="module")
def seeded_dir(tmp_path_factory):
    return build_preset("tiny-seeded", tmp_path_factory.mktemp("models") / "tiny-seeded", preset=TINY_SEEDED)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_a_seeded_folder_holds_the_recipe_and_no_weights(seeded_dir, tiny_model_dir):
    names = {f.name for f in seeded_dir.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", SEEDED_FILE} <= names
    assert not [n for n in names if n.endswith((".safetensors", ".bin"))]
    recipe = json.loads((seeded_dir / SEEDED_FILE).read_text())
    assert recipe["preset"] == "tiny-seeded" and recipe["initializer_range"] == 0.1
    assert json.loads((seeded_dir / "config.json").read_text())["dtype"] == "bfloat16"
    assert is_seeded(seeded_dir) and not is_seeded(tiny_model_dir)


def test_two_materialisations_are_bit_identical(seeded_dir):
    a, b = load_causal_lm(seeded_dir), load_causal_lm(seeded_dir)
    assert a.dtype == torch.bfloat16 and not a.training
    assert digest(a) == digest(b)
    # another dtype is the stored values cast, as loading a bf16 checkpoint in float32
    wide = load_causal_lm(seeded_dir, dtype=torch.float32)
    assert all(torch.equal(wide.state_dict()[k], v.float()) for k, v in a.state_dict().items())


def test_another_process_on_another_cpu_path_draws_the_same_bits(seeded_dir):
    """The subprocess runs torch's portable (non-AVX) kernels: float32 `randn` would differ there."""
    code = ("import hashlib, sys, torch; from rlix.models.init import load_causal_lm\n"
            "m = load_causal_lm(sys.argv[1]); h = hashlib.sha256()\n"
            "for k, t in sorted(m.state_dict().items()):\n"
            "    h.update(k.encode()); h.update(t.contiguous().view(torch.uint8).numpy().tobytes())\n"
            "print(torch.backends.cpu.get_cpu_capability(), h.hexdigest())\n")
    env = {**os.environ, "PYTHONPATH": str(SRC), "ATEN_CPU_CAPABILITY": "default"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(seeded_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    capability, theirs = out.split()
    assert capability == "DEFAULT"
    assert theirs == digest(load_causal_lm(seeded_dir))


@pytest.mark.parametrize("name, lo, hi", [
    ("model.layers.1.mlp.up_proj.weight", 10, 140),   # across block boundaries
    ("model.layers.1.mlp.up_proj.weight", 448, 512),  # the last block, whole
    ("model.layers.0.self_attn.q_proj.weight", 64, 64),  # empty
    ("model.embed_tokens.weight", 0, 70),  # with the padding row
    ("lm_head.weight", 100, 200),  # tied: the embedding's rows
    ("model.layers.0.self_attn.k_proj.bias", 3, 90),  # 1-D: elements
    ("model.norm.weight", 0, 256),
])
def test_rows_of_a_tensor_equal_those_of_the_whole_model(seeded_dir, name, lo, hi):
    whole = load_causal_lm(seeded_dir).state_dict()[name]
    rows = seeded_rows(seeded_dir, name, lo, hi, torch.bfloat16)
    assert rows.shape == whole[lo:hi].shape and torch.equal(rows, whole[lo:hi])
    assert torch.equal(seeded_rows(seeded_dir, name, lo, hi, torch.float32), whole[lo:hi].float())


def test_rows_out_of_range_or_of_no_parameter_are_refused(seeded_dir):
    with pytest.raises(ValueError, match="outside"):
        seeded_rows(seeded_dir, "model.norm.weight", 0, 257, torch.float32)
    with pytest.raises(KeyError):
        seeded_rows(seeded_dir, "model.nope.weight", 0, 1, torch.float32)


def test_tied_embeddings_stay_tied(seeded_dir):
    model = load_causal_lm(seeded_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(not t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_frequencies_equal_those_of_a_model_built_on_the_cpu(seeded_dir, dtype):
    model = load_causal_lm(seeded_dir, dtype=dtype)
    reference = AutoModelForCausalLM.from_config(model.config, dtype=dtype)
    for name, buffer in reference.named_buffers():
        assert model.get_buffer(name).dtype == buffer.dtype
        assert torch.equal(model.get_buffer(name), buffer), name


def test_values_follow_transformers_init(seeded_dir):
    model = load_causal_lm(seeded_dir, dtype=torch.float32)
    std = TINY_SEEDED.initializer_range
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
        elif name.endswith(".bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
        elif param.numel() >= 100_000:
            assert abs(param.std().item() / std - 1) < 0.03, name
            assert abs(param.mean().item()) < 0.03 * std, name
    embed = model.model.embed_tokens
    assert embed.padding_idx == model.config.pad_token_id
    assert torch.equal(embed.weight[embed.padding_idx], torch.zeros(embed.weight.shape[1]))
    # distinct streams: no two tensors of one shape share values
    layers = model.model.layers
    assert not torch.equal(layers[0].mlp.up_proj.weight, layers[1].mlp.up_proj.weight)
    assert not torch.equal(layers[0].mlp.up_proj.weight, layers[0].mlp.gate_proj.weight)


def test_trainer_and_engine_load_a_seeded_folder_and_agree(seeded_dir, tmp_path):
    trainer = PolicyTrainer(seeded_dir, dtype="float32")
    engine = TorchEngine.from_pretrained(seeded_dir, dtype="float32", max_num_seqs=2)
    try:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True, return_dict=False)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True)

        async def collect():  # type: ignore[no-untyped-def]
            last = None
            async for last in engine.generate("r", prompt, params):
                pass
            return last

        import asyncio
        out = asyncio.run(collect())
    finally:
        engine.close()
    sample = TrainSample(prompt_ids=prompt, response_ids=out.token_ids,
                         behaviour_logprobs=out.logprobs, advantage=0.0)
    assert trainer.compute_logprobs([sample])[0] == pytest.approx(out.logprobs, abs=1e-4)
    # its checkpoint holds the weights: no recipe copied beside them to shadow them
    saved = trainer.save_checkpoint(tmp_path / "ckpt") / "model"
    assert not (saved / SEEDED_FILE).exists() and not is_seeded(saved)


def test_resolving_a_large_seeded_preset_writes_no_weights_and_rows_come_fast(tmp_path):
    folder = resolve_model("qwen2.5-7b-shape", cache_dir=tmp_path)
    assert is_seeded(folder) and resolve_model("qwen2.5-7b-shape", cache_dir=tmp_path) == folder
    assert sum(f.stat().st_size for f in folder.iterdir()) < 1 << 20
    rows = seeded_rows(folder, "model.layers.27.mlp.down_proj.weight", 3584 - 2, 3584, torch.bfloat16)
    assert rows.shape == (2, 18944) and rows.dtype == torch.bfloat16
    assert abs(rows.float().std().item() / 0.02 - 1) < 0.05
