"""Backend factory and command lines; the client's pickling and its fan-out against small
real HTTP servers."""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlix.errors import ConfigError, EngineStateError, InvalidRequestError
from rlix.inference.fleet.api import EngineBackend
from rlix import env
from rlix.inference.fleet.backends import (EXTENSION_CLS, EXTENSION_PACKAGE, EmbeddedBackend,
                                          EngineBackendConfig, VllmBackend,
                                     make_backend)
from rlix.inference.fleet.client import RemoteInferenceClient, parse_load


def test_factory_picks_by_the_typed_field(tiny_model_dir, monkeypatch):
    emb = make_backend(EngineBackendConfig(model=str(tiny_model_dir)))
    assert isinstance(emb, EmbeddedBackend) and isinstance(emb, EngineBackend)
    cmd = emb.command(host="127.0.0.1", port=9000)
    assert cmd[1:4] == ["-m", "rlix.cli", "serve"] and emb.supports_sleep
    assert not any(a.startswith("--api-key") for a in cmd)  # the token goes in RLIX_API_KEY
    assert emb.api_key_env == "RLIX_API_KEY"
    from rlix.cli import build_parser

    args = build_parser().parse_args(cmd[3:])
    assert args.api_key is None and args.port == 9000
    monkeypatch.setattr(env, "vllm_python", lambda: None)  # none set, none linked by setup-vllm.sh
    with pytest.raises(ConfigError, match="setup-vllm.sh.*RLIX_VLLM_PYTHON"):
        make_backend(EngineBackendConfig(backend="vllm", model=str(tiny_model_dir)))
    with pytest.raises(ValidationError):
        EngineBackendConfig(backend="sglang")


def test_a_pipelines_capture_graphs_reaches_its_shards_serve_command(tiny_model_dir, tmp_path):
    """rollout.capture_graphs -> the shard's EngineBackendConfig -> `rlix serve --capture-graphs`,
    which the serve parser takes; off by default."""
    from rlix.cli import build_parser
    from rlix.config.models import PipelineConfig
    from rlix.pipeline.device_plan import DevicePlan
    from rlix.pipeline.shard_engine import shard_engine

    def serve_args(capture: bool | None):  # type: ignore[no-untyped-def]
        rollout = {} if capture is None else {"capture_graphs": capture}
        cfg = PipelineConfig.model_validate({"name": "p", "model": str(tiny_model_dir), "max_shards": 1,
                                             "steps": 1, "rollout": rollout})
        backend = make_backend(shard_engine(cfg, DevicePlan(), str(tiny_model_dir), None, tmp_path))
        return build_parser().parse_args(backend.command(host="127.0.0.1", port=9000)[3:])

    assert serve_args(True).capture_graphs is True
    assert serve_args(False).capture_graphs is False and serve_args(None).capture_graphs is False


def test_embedded_shards_on_shared_cores_spin_briefly(tiny_model_dir):
    """libgomp's default spin (~3 ms after every parallel region) lets one server's idle compute
    threads take the cores of the servers beside it (the four-server sync test starved)."""
    from rlix.inference.fleet.backends import SHARED_CORES_SPIN_COUNT

    cfg = EngineBackendConfig(model=str(tiny_model_dir), cpu_threads=2)
    assert make_backend(cfg).env() == {"GOMP_SPINCOUNT": str(SHARED_CORES_SPIN_COUNT)}
    assert make_backend(cfg.model_copy(update={"shared_cores": False})).env() == {}
    assert make_backend(cfg.model_copy(update={"device": "cuda"})).env() == {}


def test_embedded_shards_split_over_their_gpus_on_cuda(tiny_model_dir):
    cfg = EngineBackendConfig(model=str(tiny_model_dir), tensor_parallel_size=2)
    wide = make_backend(cfg.model_copy(update={"device": "cuda"})).command(host="h", port=1)
    assert wide[wide.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in make_backend(cfg).command(host="h", port=1)  # fake GPUs: scheduled only


def test_vllm_command_line(tiny_model_dir):
    cfg = EngineBackendConfig(backend="vllm", model=str(tiny_model_dir), python="/opt/py/bin/python",
                              served_model_name="tiny", max_model_len=512,
                              worker_extension_cls="rlix.inference.vllm.ext.Ext")
    b = make_backend(cfg)
    assert isinstance(b, VllmBackend)
    cmd = b.command(host="127.0.0.1", port=8001)
    assert cmd[:3] == ["/opt/py/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-scale-out", "--served-model-name", "--max-model-len", "--worker-extension-cls"):
        assert flag in cmd
    assert cmd[cmd.index("--worker-extension-cls") + 1] == "rlix.inference.vllm.ext.Ext"
    assert "--enable-sleep-mode" not in cmd and not b.supports_sleep  # refused on CPU
    child_env = b.env()
    staged = Path(child_env.pop("PYTHONPATH"))
    assert child_env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert sorted(p.name for p in (staged / EXTENSION_PACKAGE).glob("*.py")) == ["__init__.py", "vllm_worker.py",
                                                                                "wire.py"]
    assert b.ready_requests == (("/update_weight_version", {"new_version": "0"}),)
    default = make_backend(cfg.model_copy(update={"worker_extension_cls": None, "enforce_eager": True,
                                                   "gpu_memory_utilization": 0.5}))
    cmd = default.command(host="h", port=1)
    assert cmd[cmd.index("--worker-extension-cls") + 1] == EXTENSION_CLS
    assert "--enforce-eager" in cmd and cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.5"
    gpu = make_backend(cfg.model_copy(update={"device": "cuda"}))
    assert "--enable-sleep-mode" in gpu.command(host="h", port=1) and gpu.supports_sleep
    assert "--tensor-parallel-size" not in gpu.command(host="h", port=1)  # tp 1: vLLM's default
    wide = make_backend(cfg.model_copy(update={"device": "cuda", "tensor_parallel_size": 2})).command(host="h", port=1)
    assert wide[wide.index("--tensor-parallel-size") + 1] == "2"
    # fake GPUs on the CPU only schedule a shard's tp GPUs: vLLM's CPU server runs one process
    assert "--tensor-parallel-size" not in make_backend(cfg.model_copy(update={"tensor_parallel_size": 2})).command(
        host="h", port=1)


def test_client_pickles_without_its_connections():
    c = RemoteInferenceClient("http://r", {0: "http://a/", 1: "http://b"}, "k", "tiny")

    async def touch():
        c._pool()
    asyncio.run(touch())
    c2 = pickle.loads(pickle.dumps(c))
    assert c2._lean is None and c2.shard_urls == {0: "http://a", 1: "http://b"} and c2.api_key == "k"


async def _tiny_http_server(name: str, seen: list):  # type: ignore[no-untyped-def]
    """A real HTTP/1.1 server on a free port answering like a shard ("c" is asleep)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                line = await reader.readuntil(b"\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            method, target, _ = line.decode().split(" ", 2)
            headers = {}
            while (h := await reader.readuntil(b"\r\n")) != b"\r\n":
                k, _, v = h.decode().partition(":")
                headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            path, _, query = target.partition("?")
            seen.append((name, method, path, query, headers.get("authorization"), body))
            if path == "/metrics":
                status, out = 200, (b'vllm:num_requests_running{engine="0",model_name="t"} 2.0\n'
                                    b'vllm:num_requests_waiting{engine="0",model_name="t"} 1.0\n')
            elif name == "c":
                status, out = 503, json.dumps({"error": {"message": "asleep", "type": "x", "param": None,
                                                         "code": 503}}).encode()
            else:
                status, out = 200, json.dumps({"status": "ok", "path": path}).encode()
            writer.write(f"HTTP/1.1 {status} X\r\ncontent-length: {len(out)}\r\n\r\n".encode() + out)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


def test_client_fans_out_to_the_chosen_ranks():
    seen: list = []

    async def main():
        servers = {n: await _tiny_http_server(n, seen) for n in "abc"}
        c = RemoteInferenceClient(None, {i: servers[n][1] for i, n in enumerate("abc")}, "tok")
        try:
            assert await c.pause("keep", ranks=[1, 0]) == {0: {"status": "ok", "path": "/pause"},
                                                           1: {"status": "ok", "path": "/pause"}}
            assert await c.load([2]) == {2: {"running": 2.0, "waiting": 1.0}}
            await c.wake_up(["weights", "kv_cache"], ranks=[0])
            await c.abort_requests([1], request_ids=["x"])
            with pytest.raises(EngineStateError, match="asleep"):
                await c.resume()
            with pytest.raises(InvalidRequestError, match="unknown DP ranks"):
                await c.sleep(1, ranks=[7])
        finally:
            await c.aclose()
            for server, _ in servers.values():
                server.close()
                await server.wait_closed()
    asyncio.run(main())
    assert ("a", "POST", "/pause", "mode=keep", "Bearer tok", b"") in seen
    assert ("b", "POST", "/pause", "mode=keep", "Bearer tok", b"") in seen
    assert ("a", "POST", "/wake_up", "tags=weights&tags=kv_cache", "Bearer tok", b"") in seen
    assert ("b", "POST", "/abort_requests", "", "Bearer tok", b'{"request_ids": ["x"]}') in seen
    assert {n for n, _, p, *_ in seen if p == "/resume"} == {"a", "b", "c"}  # all called before raising


def test_parse_load_sums_engines():
    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3.0\n'
            'vllm:num_requests_running{engine="1"} 1.0\nvllm:num_requests_waiting 4\n')
    assert parse_load(text) == {"running": 4.0, "waiting": 4.0}


class _ExitingBackend:
    """A 'server' that prints a line and exits: start-up must fail with that line."""

    name, health_path, startup_timeout_s, supports_sleep = "exiting", "/health", 10.0, False

    startup_phases: tuple = ()  # its log marks no phase
    ready_requests = ()
    api_key_env = None

    def command(self, *, host: str, port: int) -> list[str]:
        import sys
        return [sys.executable, "-c", "import sys; print('model path does not exist'); sys.exit(3)"]

    def env(self) -> dict[str, str]:
        return {}


def test_shard_process_start_failure_shows_the_log_and_stop_removes_its_temp_dir():
    from rlix.inference.fleet.shard_process import ShardProcess

    proc = ShardProcess(_ExitingBackend(), "k")
    log_dir = proc.log_path.parent
    proc.start()
    with pytest.raises(EngineStateError, match="model path does not exist"):
        proc.wait_ready()
    assert log_dir.exists()
    assert proc.stop() == 3
    assert not log_dir.exists()


def test_shard_process_keeps_a_log_dir_it_was_given(tmp_path):
    from rlix.inference.fleet.shard_process import ShardProcess

    proc = ShardProcess(_ExitingBackend(), "k", log_dir=tmp_path)
    proc.start()
    with pytest.raises(EngineStateError):
        proc.wait_ready()
    proc.stop()
    assert "model path does not exist" in proc.log_path.read_text()


class _HealthBackend:
    """A real HTTP server answering 200 on /health (a bind that fails exits with Python's
    "Address already in use")."""

    name, health_path, startup_timeout_s, supports_sleep = "health", "/health", 20.0, False

    startup_phases: tuple = ()  # its log marks no phase
    ready_requests = ()
    api_key_env = None

    def command(self, *, host: str, port: int) -> list[str]:
        import sys
        code = ("import http.server\n"
                "class H(http.server.BaseHTTPRequestHandler):\n"
                "    def do_GET(self):\n"
                "        self.send_response(200); self.end_headers()\n"
                f"http.server.HTTPServer(({host!r}, {port}), H).serve_forever()\n")
        return [sys.executable, "-c", code]

    def env(self) -> dict[str, str]:
        return {}


def test_a_shard_whose_chosen_port_was_taken_first_chooses_another(monkeypatch):
    """The port is chosen before the server binds it; when another process binds it in
    between, the start is made again on a new port, not lost."""
    import socket

    import httpx

    from rlix.inference.fleet import shard_process
    from rlix.httpkit import free_port

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    ports = iter([busy])
    monkeypatch.setattr(shard_process, "free_port", lambda host: next(ports, None) or free_port(host))
    proc = shard_process.ShardProcess(_HealthBackend(), "k")
    try:
        assert proc.port == busy
        proc.start_ready()
        assert proc.port != busy and httpx.get(proc.url + "/health").status_code == 200
    finally:
        proc.stop()
        taken.close()


def test_a_shard_given_a_port_that_is_taken_fails_with_the_servers_words():
    import socket

    from rlix.inference.fleet.shard_process import ShardProcess

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    proc = ShardProcess(_HealthBackend(), "k", port=taken.getsockname()[1])
    try:
        with pytest.raises(EngineStateError, match="(?i)address already in use"):
            proc.start_ready()
    finally:
        proc.stop()
        taken.close()
