"""Every implementation of the weight layer's Protocols says what it can do, and says it truly:
the sync driver and the shard's receiver read declared members, never probe with getattr."""

from __future__ import annotations

import inspect

import pytest
import torch

from rlix.inference.engine.api import EngineAPI
from rlix.weights import InProcessEndpoint, ShardUpdater
from rlix.weights.api import OneCallEndpoint, ShardEndpoint, WeightTarget
from rlix.weights.http_endpoint import HttpShardEndpoint
from rlix.weights.transport import KINDS, TransportReceiver, TransportSender, make_transport
from rlix.weights.vllm.endpoint import VllmShardEndpoint

from model_engine import ModelEngine
from pipe_shard import ConnectionEndpoint


def _engine() -> ModelEngine:
    return ModelEngine({"w": torch.zeros(4, 4)})


def _endpoints() -> list[ShardEndpoint]:
    return [HttpShardEndpoint("http://127.0.0.1:9", "k"), VllmShardEndpoint("http://127.0.0.1:9", "k"),
            InProcessEndpoint(ShardUpdater(_engine())), ConnectionEndpoint(conn=None)]  # type: ignore[arg-type]


@pytest.mark.parametrize("endpoint", _endpoints(), ids=lambda e: type(e).__name__)
def test_each_shard_endpoint_satisfies_the_protocol_and_its_one_call_flag_is_true(endpoint):
    assert isinstance(endpoint, ShardEndpoint)
    assert isinstance(endpoint.one_call, bool)
    # the flag is what the driver reads: it must match what the endpoint really offers
    assert endpoint.one_call == isinstance(endpoint, OneCallEndpoint)
    if endpoint.one_call:
        assert inspect.iscoroutinefunction(endpoint.sync) and inspect.iscoroutinefunction(endpoint.wake_up)
        assert isinstance(endpoint.last_phases_ms, dict)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("cuda_ipc", "nccl")] +
                         [pytest.param(k, marks=pytest.mark.gpu) for k in ("cuda_ipc", "nccl")])
def test_each_transport_satisfies_the_protocols_and_its_sender_answers_references(kind):
    if kind in ("cuda_ipc", "nccl") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    transport = make_transport(kind)
    receiver = transport.receiver("cuda" if kind in ("cuda_ipc", "nccl") else "cpu")
    assert isinstance(receiver, TransportReceiver) and isinstance(receiver.receives_into, bool)
    receiver.close()
    sender = transport.sender()
    try:
        assert isinstance(sender, TransportSender)
        cpu = [torch.zeros(8, dtype=torch.uint8)]
        out = sender.references(0, cpu, None)
        # only a sender whose bytes need no staging answers with messages (shm: buckets that
        # already live in its segments; plain CPU tensors do not)
        assert out is None
    finally:
        sender.close()


def test_engines_say_what_they_can_do_for_a_weight_receiver(tiny_model_dir):
    from rlix.inference.engine.engine import TorchEngine

    engine = TorchEngine.from_pretrained(tiny_model_dir, device="cpu", max_num_seqs=2)
    try:
        for target in (engine, _engine()):
            assert isinstance(target, WeightTarget)
        assert isinstance(engine, EngineAPI)
        specs = engine.weight_specs()
        assert specs and all(isinstance(shape, tuple) for shape, _ in specs.values())
        assert engine.weight_destination(next(iter(specs))) is None
        assert engine.weight_bucket(0) is None  # no reload in progress
    finally:
        engine.close()
