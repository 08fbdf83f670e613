"""Backend factory and command lines; the client's pickling and fan-out (no servers)."""

from __future__ import annotations

import asyncio
import pickle

import httpx
import pytest
from pydantic import ValidationError

from rlix.errors import ConfigError, EngineStateError, InvalidRequestError
from rlix.inference.backends import (EmbeddedBackend, EngineBackend, EngineBackendConfig, VllmBackend,
                                     make_backend)
from rlix.inference.client import RemoteInferenceClient, parse_load


def test_factory_picks_by_the_typed_field(tiny_model_dir, monkeypatch):
    emb = make_backend(EngineBackendConfig(model=str(tiny_model_dir)))
    assert isinstance(emb, EmbeddedBackend) and isinstance(emb, EngineBackend)
    cmd = emb.command(host="127.0.0.1", port=9000, api_key="k")
    assert cmd[1:4] == ["-m", "rlix.cli", "serve"] and "--api-key" in cmd and emb.supports_sleep
    monkeypatch.delenv("RLIX_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError, match="RLIX_VLLM_PYTHON"):
        make_backend(EngineBackendConfig(backend="vllm", model=str(tiny_model_dir)))
    with pytest.raises(ValidationError):
        EngineBackendConfig(backend="sglang")


def test_vllm_command_line(tiny_model_dir):
    cfg = EngineBackendConfig(backend="vllm", model=str(tiny_model_dir), python="/opt/py/bin/python",
                              served_model_name="tiny", max_model_len=512,
                              worker_extension_cls="rlix.inference.vllm.ext.Ext")
    b = make_backend(cfg)
    assert isinstance(b, VllmBackend)
    cmd = b.command(host="127.0.0.1", port=8001, api_key="k")
    assert cmd[:3] == ["/opt/py/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-scale-out", "--served-model-name", "--max-model-len", "--worker-extension-cls"):
        assert flag in cmd
    assert "--enable-sleep-mode" not in cmd and not b.supports_sleep  # refused on CPU
    assert b.env() == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    gpu = make_backend(cfg.model_copy(update={"device": "cuda"}))
    assert "--enable-sleep-mode" in gpu.command(host="h", port=1, api_key="k") and gpu.supports_sleep


def test_client_pickles_without_its_connections():
    c = RemoteInferenceClient("http://r", {0: "http://a/", 1: "http://b"}, "k", "tiny")

    async def touch():
        c._client()
    asyncio.run(touch())
    c2 = pickle.loads(pickle.dumps(c))
    assert c2._http is None and c2.shard_urls == {0: "http://a", 1: "http://b"} and c2.api_key == "k"


def test_client_fans_out_to_the_chosen_ranks():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.path, str(request.url.params), request.headers["authorization"]))
        if request.url.path == "/metrics":
            return httpx.Response(200, text='vllm:num_requests_running{engine="0",model_name="t"} 2.0\n'
                                             'vllm:num_requests_waiting{engine="0",model_name="t"} 1.0\n')
        if request.url.host == "c":
            return httpx.Response(503, json={"error": {"message": "asleep", "type": "x", "param": None,
                                                       "code": 503}})
        return httpx.Response(200, json={"status": "paused"})

    async def main():
        c = RemoteInferenceClient(None, {0: "http://a", 1: "http://b", 2: "http://c"}, "tok")
        c._http = (asyncio.get_running_loop(), httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        assert await c.pause("keep", ranks=[1, 0]) == {0: {"status": "paused"}, 1: {"status": "paused"}}
        assert await c.load([2]) == {2: {"running": 2.0, "waiting": 1.0}}
        with pytest.raises(EngineStateError, match="asleep"):
            await c.resume()
        with pytest.raises(InvalidRequestError, match="unknown DP ranks"):
            await c.sleep(1, ranks=[7])
        await c.aclose()
    asyncio.run(main())
    assert ("a", "/pause", "mode=keep", "Bearer tok") in seen and ("b", "/pause", "mode=keep", "Bearer tok") in seen
    assert {h for h, p, *_ in seen if p == "/resume"} == {"a", "b", "c"}  # all called before raising


def test_parse_load_sums_engines():
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3.0\n'
            'vllm:num_requests_running{engine="1"} 1.0\nvllm:num_requests_waiting 4\n')
    assert parse_load(text) == {"running": 4.0, "waiting": 4.0}
