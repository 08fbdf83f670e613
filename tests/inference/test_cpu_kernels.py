"""rlix's bf16 row kernels for CPU decode (runner/cpu_kernels.py): same results as torch's
matmuls, used by the fused decoder for few rows, built once, and a clean fallback without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlix.inference.engine.runner import cpu_kernels
from rlix.inference.engine.runner.model_runner import ModelRunner, load_model
from rlix.models.presets import resolve_model

pytestmark = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                reason=f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")


@pytest.fixture(scope="module")
def kernels() -> cpu_kernels.Bf16RowKernels:
    loaded = cpu_kernels.load()
    assert loaded is not None  # unavailable_reason() said it could load
    return loaded


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 32, 75])  # 75: three passes
def test_linear_equals_the_matmul_with_bias_and_residual(kernels, rows):
    torch.manual_seed(rows)
    k, n = 160, 37  # n not a multiple of the kernel's block of 4 weight rows
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    w = (torch.randn(n, k) * 0.1).to(torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    residual = torch.randn(rows, n, dtype=torch.bfloat16)
    exact = _reference(x, w)
    tol = dict(atol=0.02, rtol=0.01)  # a bf16 rounding of values of magnitude ~1-3
    torch.testing.assert_close(kernels.linear(x, w).float(), exact, **tol)
    torch.testing.assert_close(kernels.linear(x, w, bias=bias).float(), exact + bias.float(), **tol)
    torch.testing.assert_close(kernels.linear(x, w, residual=residual).float(),
                               exact + residual.float(), **tol)
    # and against torch's own bf16 matmul, which rounds at the same places
    torch.testing.assert_close(kernels.linear(x, w, residual=residual),
                               torch.addmm(residual, x, w.t()), atol=0.04, rtol=0.02)


@pytest.mark.parametrize("rows", [1, 3, 8, 32, 40])
def test_silu_gate_up_equals_the_mlp_first_half(kernels, rows):
    torch.manual_seed(100 + rows)
    k, inter = 64, 45
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    gate_up = (torch.randn(2 * inter, k) * 0.2).to(torch.bfloat16)
    both = _reference(x, gate_up)
    expected = F.silu(both[:, :inter]) * both[:, inter:]
    torch.testing.assert_close(kernels.silu_gate_up(x, gate_up).float(), expected, atol=0.03, rtol=0.02)


def test_fits_refuses_what_the_kernels_cannot_take(kernels):
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    assert kernels.fits(torch.zeros(4, 32, dtype=torch.bfloat16), w)
    assert not kernels.fits(torch.zeros(4, 32), w)  # fp32
    assert kernels.fits(torch.zeros(cpu_kernels.MAX_ROWS + 1, 32, dtype=torch.bfloat16), w)
    assert not kernels.fits(torch.zeros(0, 32, dtype=torch.bfloat16), w)
    assert not kernels.fits(torch.zeros(4, 24, dtype=torch.bfloat16), torch.zeros(8, 24, dtype=torch.bfloat16))
    assert not kernels.fits(torch.zeros(32, 4, dtype=torch.bfloat16).t(), w[:, :4])  # not contiguous


@torch.inference_mode()
def test_fused_decoder_uses_them_for_few_rows_and_gives_the_plain_logits(kernels, monkeypatch):
    """bf16 on CPU: a decode step of up to kernel_rows rows goes through the kernels (counted),
    its logits equal the torch path's, and an in-place weight update is seen at once."""
    path = resolve_model("tiny")

    def runner(use_kernels: bool) -> ModelRunner:
        model, _ = load_model(path, torch.device("cpu"), torch.bfloat16)
        r = ModelRunner(model, device=torch.device("cpu"), num_rows=4, max_model_len=128,
                        fused=True, cuda_graphs=False)
        assert r.fused is not None
        assert r.fused.row_kernels is kernels
        assert r.fused.kernel_rows is None or r.fused.kernel_rows >= 2
        if not use_kernels:
            r.fused.kernel_rows = 0
        r.cache.allocate(128)
        return r

    with_kernels, plain = runner(True), runner(False)
    calls = {"linear": 0, "gate_up": 0}
    linear, gate_up = kernels.linear, kernels.silu_gate_up

    def count(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(kernels, "linear", count("linear", linear))
    monkeypatch.setattr(kernels, "silu_gate_up", count("gate_up", gate_up))
    prompts = [[5, 9, 2, 7, 1, 4], [3, 3, 8]]

    def decode(r: ModelRunner) -> torch.Tensor:
        first = r.prefill(prompts, 0)
        return r.decode([int(t) for t in first.argmax(-1)], [len(p) for p in prompts]).float()

    plain_logits = decode(plain)
    assert calls == {"linear": 0, "gate_up": 0}
    kernel_logits = decode(with_kernels)
    layers = len(with_kernels.fused.layers)
    assert calls["gate_up"] >= layers and calls["linear"] >= 3 * layers + 1  # qkv, o, down, head
    torch.testing.assert_close(kernel_logits, plain_logits, atol=0.05, rtol=0.02)

    name = "model.layers.0.mlp.down_proj.weight"
    for r in (with_kernels, plain):
        weight = r.weights.params[name]
        r.weights.swap_in({name: -weight.detach().clone()}, complete=False)
    after = decode(with_kernels)
    torch.testing.assert_close(after, decode(plain), atol=0.05, rtol=0.02)
    assert (after - kernel_logits).abs().max() > 0.05


def test_no_compiler_means_no_kernels_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_kernels.unavailable_reason() == "no C compiler (cc, gcc or $CC)"
    kernels, reason = cpu_kernels._build_and_load()
    assert kernels is None and "no C compiler" in reason
    monkeypatch.setenv("RLIX_CPU_KERNELS", "0")
    assert cpu_kernels.unavailable_reason() == "RLIX_CPU_KERNELS=0"


def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setenv("RLIX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    kernels, reason = cpu_kernels._build_and_load()
    assert kernels is None and reason.startswith("build failed")
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))  # nothing half-written kept


def test_built_once_per_source_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("RLIX_CACHE_DIR", str(tmp_path))
    first, reason = cpu_kernels._build_and_load()
    assert first is not None, reason
    built = list((tmp_path / "kernels").glob("bf16_rows-*.so"))
    assert built == [first.path]
    mtime = first.path.stat().st_mtime_ns
    second, _ = cpu_kernels._build_and_load()
    assert second is not None and second.path == first.path and first.path.stat().st_mtime_ns == mtime
