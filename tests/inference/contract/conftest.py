"""One engine server per backend for the HTTP contract tests: embedded always; vLLM when
RLIX_VLLM_PYTHON names a Python that can import vLLM (skipped otherwise, with the reason)."""

from __future__ import annotations

import functools
import subprocess
from dataclasses import dataclass

import httpx
import pytest

from rlix import env
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.shard_process import ShardProcess

KEY = "contract-token"


@functools.lru_cache(maxsize=1)
def vllm_skip_reason() -> str | None:
    python = env.vllm_python()
    if not python:
        return "RLIX_VLLM_PYTHON is not set (a Python with vLLM installed)"
    try:
        subprocess.run([python, "-c", "import vllm"], check=True, capture_output=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"RLIX_VLLM_PYTHON={python} cannot import vllm: {exc}"
    return None


@dataclass
class Served:
    backend: str
    http: httpx.Client
    supports_sleep: bool


@pytest.fixture(scope="module", params=["embedded", "vllm"])
def served(request, tiny_model_dir):
    if request.param == "vllm" and vllm_skip_reason():
        pytest.skip(vllm_skip_reason())
    cfg = EngineBackendConfig(backend=request.param, model=str(tiny_model_dir), served_model_name="tiny",
                              max_model_len=512, max_num_seqs=16)
    backend = make_backend(cfg)
    proc = ShardProcess(backend, KEY)
    try:
        proc.start()
        proc.wait_ready()
        with httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
            yield Served(request.param, http, backend.supports_sleep)
    finally:
        proc.stop()
