"""The fused decoder (fused_model.py) against transformers' own forward; its oneDNN-reordered
bf16 weights on CPU against plain matmuls, before and after a weight update; its Triton decode
kernels (triton_ops.py) against its torch ops on CUDA."""

from __future__ import annotations

import pytest
import torch

from rlix.inference.engine.runner.fused_model import packs_weights
from rlix.inference.engine.runner.model_runner import ModelRunner, load_model
from rlix.models.presets import resolve_model


def _runner(device: str, kernels: bool | None = None,
            sdpa_decode: bool | None = None) -> tuple[ModelRunner, torch.nn.Module]:
    path = resolve_model("tiny")
    model, _ = load_model(path, torch.device(device), torch.float32)
    runner = ModelRunner(model, device=torch.device(device), num_rows=4, max_model_len=256,
                         fused=True, cuda_graphs=False)
    if kernels is not None:
        assert runner.fused is not None
        runner.fused.kernels = kernels
    if sdpa_decode is not None:
        assert runner.fused is not None
        runner.fused.sdpa_decode = sdpa_decode
    runner.cache.allocate(256)
    reference, _ = load_model(path, torch.device(device), torch.float32)
    return runner, reference


@pytest.mark.parametrize("sdpa_decode", [True, False], ids=["sdpa-decode", "bmm-decode"])
@torch.inference_mode()
def test_fused_prefill_and_decode_equal_transformers(prompt, sdpa_decode):
    """Decode attention both ways: SDPA over the cache in place (CPU's) and the batched
    matmuls a CUDA graph captures; rows of different lengths share the step."""
    runner, reference = _runner("cpu", sdpa_decode=sdpa_decode)
    prompts = [prompt(70), prompt(3, salt=1)]
    logits, full = runner.prefill_all(prompts, 0, frozenset({0}))
    for i, p in enumerate(prompts):
        ref = reference(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[i], ref[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(full[0], reference(torch.tensor([prompts[0]])).logits[0],
                               atol=1e-4, rtol=1e-4)
    seqs = [p + [int(logits[i].argmax())] for i, p in enumerate(prompts)]
    for _ in range(3):
        step = runner.decode([s[-1] for s in seqs], [len(s) - 1 for s in seqs])
        for i, s in enumerate(seqs):
            torch.testing.assert_close(step[i], reference(torch.tensor([s])).logits[0, -1],
                                       atol=1e-4, rtol=1e-4)
            s.append(int(step[i].argmax()))


@torch.inference_mode()
def test_reordered_bf16_weights_on_cpu_match_plain_matmuls_and_follow_updates(prompt):
    """bf16 on CPU runs its matmuls on reordered copies; they must give the plain matmuls'
    logits, and after an in-place update (as a weight sync lands) the new weights' logits."""
    path = resolve_model("tiny")

    def bf16_runner(pack: bool) -> ModelRunner:
        model, _ = load_model(path, torch.device("cpu"), torch.bfloat16)
        runner = ModelRunner(model, device=torch.device("cpu"), num_rows=4, max_model_len=256,
                             fused=True, cuda_graphs=False)
        assert runner.fused is not None
        if pack:
            if not packs_weights(torch.device("cpu"), torch.bfloat16):
                pytest.skip("this CPU has no oneDNN bf16 reorder (AVX2 only)")
            assert runner.fused.packed  # the default where the CPU supports it
        else:
            runner.fused.packed = False
        runner.cache.allocate(256)
        return runner

    packed, plain = bf16_runner(True), bf16_runner(False)
    prompts = [prompt(40), prompt(5, salt=2)]

    def forward(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
        first = runner.prefill(prompts, 0)
        step = runner.decode([int(t) for t in first.argmax(-1)], [len(p) for p in prompts])
        return first.float(), step.float()

    for a, b in zip(forward(packed), forward(plain)):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)
    before = forward(packed)[1]
    name = "model.layers.1.mlp.down_proj.weight"
    for runner in (packed, plain):
        weight = runner.weights.params[name]
        runner.weights.swap_in({name: -weight.detach().clone()}, complete=False)
    after_packed, after_plain = forward(packed), forward(plain)
    for a, b in zip(after_packed, after_plain):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)
    assert (after_packed[1] - before).abs().max() > 0.1  # the reordered copies were remade


@pytest.mark.gpu
@torch.inference_mode()
def test_triton_decode_equals_torch_decode(prompt):
    runner, _ = _runner("cuda", kernels=False)
    fused = runner.fused
    assert fused is not None
    runner.prefill_all([prompt(70), prompt(3, salt=1)], 0)
    saved = runner.cache.kv.clone()
    ids = torch.tensor([1, 2, 0], device="cuda")
    pos = torch.tensor([70, 3, 0], device="cuda")
    rows = torch.arange(3, device="cuda")
    ref = fused.decode(ids, pos, 128, rows)
    ref_kv = runner.cache.kv.clone()
    runner.cache.kv.copy_(saved)
    fused.kernels = True
    out = fused.decode(ids, pos, 128, rows)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(runner.cache.kv, ref_kv, atol=1e-4, rtol=1e-4)
