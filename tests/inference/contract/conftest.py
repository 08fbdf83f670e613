"""One engine server per backend for the HTTP contract tests: embedded always; vLLM (marked
`vllm`) when a Python with vLLM is found (rlix.env.vllm_python: RLIX_VLLM_PYTHON or the one
scripts/setup-vllm.sh linked), skipped with the reason otherwise, failed under RLIX_REQUIRE_VLLM."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from kit import need_vllm
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.shard_process import ShardProcess

KEY = "contract-token"


@dataclass
class Served:
    backend: str
    http: httpx.Client
    supports_sleep: bool


@pytest.fixture(scope="module", params=["embedded", pytest.param("vllm", marks=pytest.mark.vllm)])
def served(request, tiny_model_dir):
    if request.param == "vllm":
        need_vllm()
    cfg = EngineBackendConfig(backend=request.param, model=str(tiny_model_dir), served_model_name="tiny",
                              max_model_len=2048, max_num_seqs=16, startup_timeout_s=600)
    backend = make_backend(cfg)
    proc = ShardProcess(backend, KEY)
    try:
        proc.start()
        proc.wait_ready()
        with httpx.Client(base_url=proc.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as http:
            yield Served(request.param, http, backend.supports_sleep)
    finally:
        proc.stop()
