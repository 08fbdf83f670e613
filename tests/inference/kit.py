"""Helpers for tests that start real engine-server processes (each ended by its PID)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
from collections.abc import Iterator

from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.fleet.fleet import ShardFleet
from rlix.inference.fleet.local_launcher import LocalLauncher
from rlix.inference.router.router import Router
from rlix.inference.router.app import RouterServer
from rlix.inference.fleet.shard_process import ShardProcess

KEY = "test-token"
AUTH = {"Authorization": f"Bearer {KEY}"}


def sse_events(text: str) -> list[dict]:
    """A streamed answer's events (OpenAI's and vLLM's SSE: `data: {...}` lines ending with one
    `data: [DONE]`), each parsed; fails unless [DONE] comes once and last."""
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]" and events.count("[DONE]") == 1, events[-3:]
    return [json.loads(e) for e in events[:-1]]


def responses_events(text: str) -> list[dict]:
    """A streamed Responses answer's events (`event: TYPE` then `data: {...}` per event, no
    [DONE]), each parsed; fails unless every event's name is its data's `type`."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block[:200]
        event = json.loads(lines[1][6:])
        assert event["type"] == lines[0][7:], block[:200]
        events.append(event)
    return events


def engine_cfg(model_dir, **kw) -> EngineBackendConfig:
    kw.setdefault("max_model_len", 512)
    kw.setdefault("max_num_seqs", 64)
    return EngineBackendConfig(backend="embedded", model=str(model_dir), served_model_name="tiny", **kw)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie still answers kill(0); reap-check via /proc
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    return True


@contextlib.contextmanager
def shard_processes(model_dir, n: int = 1, **kw) -> Iterator[list[ShardProcess]]:
    """n engine servers on free ports, started together; all ended (by PID) on exit."""
    backend = make_backend(engine_cfg(model_dir, **kw))
    procs = [ShardProcess(backend, KEY) for _ in range(n)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()
        assert not any(p.pid and pid_alive(p.pid) for p in procs)


class FleetHarness:
    """Router (in this loop) + ShardFleet over local processes, for one async test."""

    def __init__(self, model_dir, hold_timeout_s: float = 60.0, **fleet_kw) -> None:
        self.cfg = engine_cfg(model_dir)
        self.router = Router(KEY, hold_timeout_s=hold_timeout_s)
        self.server = RouterServer(self.router)
        self.launcher = LocalLauncher(make_backend(self.cfg), KEY)
        self.client = RemoteInferenceClient(None, {}, KEY, "tiny")
        self.fleet = ShardFleet(self.launcher, self.router, self.client, **fleet_kw)
        self.pids: list[int] = []

    async def __aenter__(self) -> FleetHarness:
        await self.server.start()
        self.client.router_url = self.server.url
        return self

    async def start(self, ranks) -> None:
        await self.fleet.start(ranks)
        self.pids += list(self.launcher.pids().values())

    async def __aexit__(self, *exc) -> None:
        try:
            await self.fleet.shutdown()
        finally:
            await self.server.stop()
            await self.client.aclose()
        await asyncio.sleep(0)
        assert not [p for p in self.pids if pid_alive(p)], "a shard process outlived the test"


@contextlib.contextmanager
def router_process(shard_urls: dict[int, str]) -> Iterator[str]:
    """`python -m rlix.inference.router` over these (active) shards; ended by its PID."""
    import subprocess
    import sys
    import time

    import httpx

    from rlix.httpkit import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "rlix.inference.router", "--port", str(port), "--api-key", KEY]
    for rank, url in shard_urls.items():
        cmd += ["--shard", f"{rank}={url}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "router died"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        assert not pid_alive(proc.pid)


@functools.lru_cache(maxsize=1)
def vllm_skip_reason() -> str | None:
    """Why vLLM cannot be used here, or None (asked once per session)."""
    import subprocess

    from rlix import env
    python = env.vllm_python()
    if not python:
        return "no Python with vLLM: run scripts/setup-vllm.sh or set RLIX_VLLM_PYTHON"
    try:
        subprocess.run([python, "-c", "import vllm"], check=True, capture_output=True, timeout=180)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{python} cannot import vllm: {exc}"
    return None


def vllm_command() -> str:
    """The `vllm` command of the environment rlix starts vLLM from (rlix.env.vllm_python: a
    wrapper script or RLIX_VLLM_PYTHON), found from that Python's own prefix rather than the
    wrapper's path, which is not inside the environment. Call after `need_vllm()`."""
    import subprocess
    from pathlib import Path

    from rlix import env
    python = env.vllm_python()
    assert python, "no Python with vLLM (need_vllm() first)"
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], check=True,
                            capture_output=True, text=True, timeout=60).stdout.strip()
    return str(Path(prefix) / "bin" / "vllm")


def vllm_required() -> bool:
    """`RLIX_REQUIRE_VLLM=1` (CI's vLLM step): tests that need vLLM fail instead of skipping.
    A test-run setting, read here rather than by the product (rlix.env)."""
    return os.environ.get("RLIX_REQUIRE_VLLM", "").strip() in ("1", "true", "yes")


def need_vllm() -> None:
    """Skip without vLLM, or fail where it is required (CI's vLLM step, RLIX_REQUIRE_VLLM=1)."""
    import pytest

    reason = vllm_skip_reason()
    if reason and vllm_required():
        pytest.fail(f"vLLM is required here (RLIX_REQUIRE_VLLM): {reason}")
    if reason:
        pytest.skip(reason)


# -- constrained decoding: the schema and the tools both its HTTP and its router tests use ------
#: bounded values everywhere: the random `tiny` model's output is made valid by the constraint alone
ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]},
    "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "maxItems": 2},
    "ok": {"type": "boolean"}},
    "required": ["answer", "confidence", "tags", "ok"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
ADD_TOOL = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
#: each tool's name -> its arguments' schema
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, ADD_TOOL)}
