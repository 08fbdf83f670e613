"""rlix's vLLM worker extension without vLLM: a stand-in worker records what reload_weights gets.
An update is all or nothing; the staged package imports where rlix is not installed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from rlix.inference.fleet.backends import EXTENSION_PACKAGE, staged_extension
from rlix.weights.cache import BucketCache
from rlix.weights.transport import make_transport
from rlix.weights.vllm.names import vllm_named
from rlix.weights.vllm_worker import RlixWorkerExtension
from rlix.weights.wire import ReceiveError


class FakeRunner:
    """vLLM's model runner as the extension uses it: a model, and reload_weights."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.model = torch.nn.Module()
        for i, (name, t) in enumerate(params.items()):
            self.model.register_parameter(f"p{i}", torch.nn.Parameter(t.clone()))
        self._names = {f"p{i}": n for i, n in enumerate(params)}
        self.reloads: list[dict[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator) -> None:  # noqa: ANN001
        self.reloads.append({n: t.clone() for n, t in weights_iterator})


class Worker(RlixWorkerExtension):
    def __init__(self, runner: FakeRunner) -> None:
        self.model_runner = runner

    def _rlix_named_parameters(self):  # the stand-in's names are vLLM's
        return [(self.model_runner._names[n], p) for n, p in self.model_runner.model.named_parameters()]


@pytest.fixture
def setup():
    gen = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(300, 16, generator=gen),
          "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=gen),
          "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 16, generator=gen),
          "model.layers.0.self_attn.v_proj.weight": torch.randn(8, 16, generator=gen)}
    with BucketCache.for_model(sd, bucket_bytes=4096, host="shm") as cache:
        cache.build_latest(3, sd)
        sender = make_transport("shm", segments=cache.shm_segments).sender()
        messages = sender.references(3, cache.buckets(3), cache.checksums(3))
        worker = Worker(FakeRunner(vllm_named(sd)))
        yield sd, cache, messages, worker


def call(worker: Worker, cache: BucketCache, messages: list[dict], verify: bool = True) -> dict:
    worker.rlix_init_transfer(json.dumps({"layout": cache.layout.to_json(), "transport": "shm", "verify": verify}))
    return json.loads(worker.rlix_sync(json.dumps({"weight_version": 3, "layout_id": cache.layout.layout_id,
                                                   "updates": messages})))


def test_an_update_reaches_reload_weights_whole(setup):
    sd, cache, messages, worker = setup
    assert len(messages) > 3
    answer = call(worker, cache, messages)
    assert answer["weight_version"] == 3 and answer["tensors"] == len(sd) and answer["reload_s"] >= 0
    (got,) = worker.model_runner.reloads
    assert got.keys() == sd.keys() and all(torch.equal(got[n], sd[n]) for n in sd)
    assert json.loads(worker.rlix_weight_version()) == {"weight_version": 3}


@pytest.mark.parametrize("spoil,error", [
    (lambda m: [*m[:1], {**m[1], "checksum": m[1]["checksum"] ^ 1}, *m[2:]], "checksum"),
    (lambda m: m[:-1], "incomplete"),
    (lambda m: [*m[:1], {**m[1], "shm": "rlix-w-1-deadbeef"}, *m[2:]], "cannot open shared memory"),
    (lambda m: [*m[:1], {**m[1], "offset": 1 << 40}, *m[2:]], "outside"),
])
def test_a_failed_update_touches_nothing(setup, spoil, error):
    sd, cache, messages, worker = setup
    with pytest.raises(ReceiveError, match=error):
        call(worker, cache, spoil(messages))
    assert worker.model_runner.reloads == [] and worker.rlix_version == 0
    call(worker, cache, messages)  # and the next one succeeds
    assert len(worker.model_runner.reloads) == 1


def test_refuses_a_layout_that_does_not_fit_and_other_transports(setup):
    sd, cache, messages, worker = setup
    other = {"not.a.param": torch.zeros(4)}
    with BucketCache.for_model(other, host="shm") as wrong:
        with pytest.raises(ValueError, match="does not fit the served model"):
            worker.rlix_init_transfer(json.dumps({"layout": wrong.layout.to_json()}))
    with pytest.raises(ValueError, match="shared memory only"):
        worker.rlix_init_transfer(json.dumps({"layout": cache.layout.to_json(), "transport": "nccl"}))
    with pytest.raises(ValueError, match="layout"):
        worker.rlix_sync(json.dumps({"weight_version": 1, "layout_id": "x", "updates": []}))


def test_the_staged_package_imports_without_rlix():
    child = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("rlix", "numpy", "pydantic"):
                    raise ModuleNotFoundError(f"blocked: {{name}}")
        sys.meta_path.insert(0, Block())
        sys.path.insert(0, sys.argv[1])
        from {EXTENSION_PACKAGE}.vllm_worker import RlixWorkerExtension
        assert "rlix" not in sys.modules
        print("ok", RlixWorkerExtension.__module__)
    """)
    proc = subprocess.run([sys.executable, "-c", child, str(staged_extension())], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ok {EXTENSION_PACKAGE}.vllm_worker"


def test_weights_vllm_packed_away_are_not_mismatches_but_not_all_of_them():
    """vLLM's CPU backend may drop a linear layer's weight after packing it for oneDNN; its
    /weight_checker digest is then that of zero bytes: not comparable, not a mismatch. The rest
    is still compared, and a server with nothing comparable is a problem."""
    from rlix.weights.vllm.names import PACKED_AWAY_DIGEST, compare_digests, packed_away

    want = {"a.weight": "1", "b.weight": "2", "norm.weight": "3"}
    got = {"a.weight": PACKED_AWAY_DIGEST, "b.weight": PACKED_AWAY_DIGEST, "norm.weight": "3"}
    assert packed_away(got) == ["a.weight", "b.weight"] and compare_digests(want, got) == []
    assert compare_digests(want, {**got, "norm.weight": "4"}) == ["norm.weight: differs"]
    everything = {n: PACKED_AWAY_DIGEST for n in want}
    assert compare_digests(want, everything) == ["no served weight is observable (all packed away by vLLM's CPU GEMM)"]


def test_a_bias_widened_to_float32_by_vllm_is_served_as_sent():
    """On AMX CPUs vLLM's CPU backend holds small linear layers' biases in float32 (the serving
    dtype's values widened, or the float32 values an update sent): those digests match, others not."""
    import torch

    from rlix.weights.vllm.names import compare_digests, sha256_of, vllm_digests

    g = torch.Generator().manual_seed(0)
    sent = {f"l.self_attn.{p}_proj.{k}": torch.randn(8 if k == "bias" else (8, 4), generator=g)
            for p in ("q", "k", "v") for k in ("weight", "bias")}
    want = vllm_digests(sent, torch.bfloat16)
    bias = torch.cat([sent[f"l.self_attn.{p}_proj.bias"] for p in "qkv"])
    weight = torch.cat([sent[f"l.self_attn.{p}_proj.weight"] for p in "qkv"]).to(torch.bfloat16)
    served = {"l.self_attn.qkv_proj.weight": sha256_of(weight)}
    # as served: in bf16; loaded in bf16 then widened; updated with the sent float32 values
    for form in (bias.to(torch.bfloat16), bias.to(torch.bfloat16).float(), bias):
        assert compare_digests(want, {**served, "l.self_attn.qkv_proj.bias": sha256_of(form)}) == []
    assert compare_digests(want, {**served, "l.self_attn.qkv_proj.bias": sha256_of(bias * 2)}) == \
        ["l.self_attn.qkv_proj.bias: differs"]
    assert compare_digests(want, {**served, "l.self_attn.qkv_proj.bias": sha256_of(bias.to(torch.float16))}) == \
        ["l.self_attn.qkv_proj.bias: differs"]
    assert compare_digests(want, {"l.self_attn.qkv_proj.weight": sha256_of(weight.float())}) == \
        ["l.self_attn.qkv_proj.weight: differs", "l.self_attn.qkv_proj.bias: sent, not served"]
