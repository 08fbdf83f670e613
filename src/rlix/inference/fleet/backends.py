"""Engine backends: how one shard's engine server process is launched.

Every backend serves the same HTTP API (server.py's, which is vLLM's), so the router, the
client and the fleet only ever see a URL; a backend decides just the command line, the child's
environment and what it can do. `backend:` in `EngineBackendConfig` picks one; `make_backend`
is the only place that maps the name to a class. `server_launch` is what a shard is started
with: the command line and the environment, the bearer token in the environment only (every
user of the machine can read a process's command line in /proc; its environment only its owner).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlix import env
from rlix.errors import ConfigError
from rlix.inference.fleet.api import EngineBackend
from rlix.inference.fleet.startup import EMBEDDED_PHASES, VLLM_PHASES, PhaseMarkers
from rlix.models.presets import resolve_model


#: vLLM's own --gpu-memory-utilization default; a shard on a slice of a GPU gets its share of it
VLLM_DEFAULT_MEMORY_UTILIZATION = 0.9


#: libgomp spin iterations (~10 ns each) before a waiting OpenMP thread sleeps, for embedded
#: shards on CPU: libgomp's own figure for a process with more threads than cores (its default
#: otherwise, ~3 ms of spinning, starved co-located shards: docs/BENCHMARKS.md)
SHARED_CORES_SPIN_COUNT = 100


class EngineBackendConfig(BaseModel):
    """One pipeline's engine settings, the same for all its shards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["embedded", "vllm"] = "embedded"
    model: str = Field("tiny", min_length=1, description="preset name or local checkpoint dir")
    served_model_name: str | None = Field(None, description="name in the API; default: `model`")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str | None = Field(None, description="weights dtype (e.g. bfloat16); default: the checkpoint's")
    max_num_seqs: int = Field(64, ge=1)
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one shard splits the model across (the "
                                                            "pipeline's tp): vllm on CUDA gets "
                                                            "--tensor-parallel-size; fake GPUs only schedule it")
    max_model_len: int | None = Field(None, ge=16, description="default: the model's")
    startup_timeout_s: float = Field(180.0, gt=0)
    python: str | None = Field(None, description="vllm: interpreter with vLLM; default rlix.env.vllm_python()")
    cpu_kvcache_gib: int = Field(1, ge=1, description="vllm on cpu: VLLM_CPU_KVCACHE_SPACE")
    worker_extension_cls: str | None = Field(None, description="vllm: --worker-extension-cls")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vllm: its own default if unset")
    enforce_eager: bool = Field(False, description="vllm: no CUDA graphs")
    extra_args: tuple[str, ...] = ()
    capture_graphs: bool = Field(False, description="embedded on CUDA: capture every CUDA graph before "
                                                    "serving (`rlix serve --capture-graphs`)")
    cpu_threads: int | None = Field(None, ge=1, description="embedded: torch threads of each shard "
                                                            "(default torch's; 1 when many share few cores)")
    shared_cores: bool = Field(True, description="embedded on CPU: other processes compute on the same cores "
                                                 "(the fleet's shards, trainers), so OpenMP threads spin only "
                                                 "briefly before sleeping; false for a server that has its "
                                                 "cores to itself")
    record_generations: str | None = Field(None, description="embedded: a directory where each shard records "
                                                             "what it sampled (rlix serve --record-generations)")

    @property
    def name_in_api(self) -> str:
        return self.served_model_name or self.model


def _model_path(cfg: EngineBackendConfig) -> str:
    return str(resolve_model(cfg.model))


class EmbeddedBackend:
    """rlix's own engine server (`rlix serve`) in the current interpreter's environment."""

    name = "embedded"
    health_path = "/health"
    startup_phases: PhaseMarkers = EMBEDDED_PHASES
    supports_sleep = True
    ready_requests: tuple[tuple[str, dict], ...] = ()
    api_key_env: str | None = env.API_KEY_VAR  # `rlix serve` reads RLIX_API_KEY

    def __init__(self, cfg: EngineBackendConfig, python: str | None = None) -> None:
        self.cfg = cfg
        self.python = python or sys.executable
        self.startup_timeout_s = cfg.startup_timeout_s

    def command(self, *, host: str, port: int) -> list[str]:
        cfg = self.cfg
        cmd = [self.python, "-m", "rlix.cli", "serve", "--model", _model_path(cfg),
               "--served-model-name", cfg.name_in_api, "--host", host, "--port", str(port),
               "--device", cfg.device, "--max-num-seqs", str(cfg.max_num_seqs)]
        if cfg.dtype:
            cmd += ["--dtype", cfg.dtype]
        if cfg.max_model_len:
            cmd += ["--max-model-len", str(cfg.max_model_len)]
        if cfg.cpu_threads:
            cmd += ["--threads", str(cfg.cpu_threads)]
        if cfg.record_generations:
            cmd += ["--record-generations", cfg.record_generations]
        if cfg.capture_graphs:
            cmd += ["--capture-graphs"]
        if cfg.device == "cuda" and cfg.tensor_parallel_size > 1:  # the shard's GPUs, all visible to it
            cmd += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        return cmd + list(cfg.extra_args)

    def env(self) -> dict[str, str]:
        """On CPU with `shared_cores`, a short OpenMP spin: the fleet's shards share the machine's
        cores with each other and with the trainers, and a server's compute threads spinning after
        every parallel region (libgomp's default when its own threads fit the cores) take those
        cores from the others."""
        if self.cfg.device == "cpu" and self.cfg.shared_cores:
            return {"GOMP_SPINCOUNT": str(SHARED_CORES_SPIN_COUNT)}
        return {}


#: the package vLLM imports rlix's worker extension from (`--worker-extension-cls`)
EXTENSION_PACKAGE = "rlix_vllm_ext"
EXTENSION_CLS = f"{EXTENSION_PACKAGE}.vllm_worker.RlixWorkerExtension"


def staged_extension() -> Path:
    """A folder holding rlix's worker extension as a package of its own (vllm_worker.py and the
    wire.py it reads buckets with), for the vLLM server's PYTHONPATH: vLLM's environment has no
    rlix, and putting rlix's site-packages there would mix two environments. Named by a hash of
    its files, so every process of every run shares one copy and a changed file gets a new one."""
    from rlix.weights import vllm_worker, wire  # deferred: torch, and only for vLLM shards

    sources = [Path(wire.__file__), Path(vllm_worker.__file__)]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    root = env.cache_dir() / "vllm-extension" / digest
    package = root / EXTENSION_PACKAGE
    if not (package / "__init__.py").exists():
        tmp = root.with_name(f"{digest}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / EXTENSION_PACKAGE).mkdir(parents=True)
        for src in sources:
            shutil.copy(src, tmp / EXTENSION_PACKAGE / src.name)
        (tmp / EXTENSION_PACKAGE / "__init__.py").write_text('"""rlix\'s vLLM worker extension."""\n')
        try:
            tmp.rename(root)
        except OSError:  # another process staged it first
            shutil.rmtree(tmp, ignore_errors=True)
    return root


class VllmBackend:
    """A real vLLM OpenAI server with the dev-mode control plane (VLLM_SERVER_DEV_MODE=1).

    Started as `python -m vllm.entrypoints.openai.api_server` because the `vllm` console script
    fails for the CPU distribution. On CPU vLLM refuses sleep mode, so `supports_sleep` is False
    there and the fleet pauses instead of sleeping. Its token goes in VLLM_API_KEY (what vLLM
    reads when `--api-key` is not given), never on the command line; note it guards /v1 and
    /inference only, not the dev control endpoints.
    """

    name = "vllm"
    health_path = "/health"
    api_key_env: str | None = env.VLLM_API_KEY_VAR
    startup_phases: PhaseMarkers = VLLM_PHASES

    def __init__(self, cfg: EngineBackendConfig) -> None:
        python = cfg.python or env.vllm_python()
        if not python:
            raise ConfigError("backend 'vllm' needs a Python with vLLM: run scripts/setup-vllm.sh, or set "
                              "vllm_python or RLIX_VLLM_PYTHON")
        self.cfg = cfg
        self.python = python
        self.startup_timeout_s = cfg.startup_timeout_s
        self.supports_sleep = cfg.device == "cuda"
        # vLLM stamps what it generates "default" until told a version; weights on disk are 0
        self.ready_requests = (("/update_weight_version", {"new_version": "0"}),)

    def command(self, *, host: str, port: int) -> list[str]:
        cfg = self.cfg
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", _model_path(cfg),
               "--served-model-name", cfg.name_in_api, "--host", host, "--port", str(port),
               "--max-num-seqs", str(cfg.max_num_seqs),
               "--enable-scale-out"]  # without it /inference/v1/generate answers 403
        if cfg.max_model_len:
            cmd += ["--max-model-len", str(cfg.max_model_len)]
        if cfg.dtype:
            cmd += ["--dtype", cfg.dtype]
        if cfg.gpu_memory_utilization:
            cmd += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if cfg.enforce_eager:
            cmd.append("--enforce-eager")
        if cfg.device == "cuda" and cfg.tensor_parallel_size > 1:  # the shard's GPUs, all visible to it
            cmd += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        if self.supports_sleep:
            cmd.append("--enable-sleep-mode")
        cmd += ["--worker-extension-cls", cfg.worker_extension_cls or EXTENSION_CLS]
        return cmd + list(cfg.extra_args)

    def env(self) -> dict[str, str]:
        out = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(staged_extension())}
        if self.cfg.device == "cpu":
            out["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.cpu_kvcache_gib)
        return out


def server_launch(backend: EngineBackend, *, host: str, port: int,
                  api_key: str) -> tuple[list[str], dict[str, str]]:
    """(command line, environment variables to set) of one server: the backend's own variables
    and the token in the one its server reads (`api_key_env`); the command line holds no token.
    The caller starts the child with its environment minus env.TOKEN_VARS plus these."""
    cmd = backend.command(host=host, port=port)
    child = dict(backend.env())
    if backend.api_key_env and api_key:
        child[backend.api_key_env] = api_key
    return cmd, child


def make_backend(cfg: EngineBackendConfig) -> EngineBackend:
    """The one factory from config to backend."""
    if cfg.backend == "embedded":
        return EmbeddedBackend(cfg)
    if cfg.backend == "vllm":
        return VllmBackend(cfg)
    raise ConfigError(f"unknown engine backend {cfg.backend!r}")  # pragma: no cover - Literal guards it
