"""The shards' engine, from the pipeline's `engine:` and `vllm:` sections and the run's devices."""

from __future__ import annotations

from pathlib import Path

from rlix.config.models import PipelineConfig
from rlix.inference.fleet.backends import VLLM_DEFAULT_MEMORY_UTILIZATION, EngineBackendConfig
from rlix.pipeline.device_plan import DevicePlan


def served_dtype(devices: DevicePlan) -> str:
    """The dtype the shards serve in. vLLM is told it (its audit hashes the trainer's weights
    cast to it); bfloat16 unless the run names one."""
    return devices.dtype or "bfloat16"


def shard_engine(cfg: PipelineConfig, devices: DevicePlan, model_path: str, vllm_python: str | None,
                 generations_dir: Path) -> EngineBackendConfig:
    """Our embedded engine (recording its generations in `generations_dir` with
    record_rollouts), or a vLLM server run by `vllm_python`."""
    ro, dev = cfg.rollout, devices
    common = dict(model=model_path, served_model_name=cfg.name, device=dev.device,
                  max_model_len=ro.max_model_len, tensor_parallel_size=cfg.tp)
    if cfg.engine == "embedded":
        return EngineBackendConfig(backend="embedded", dtype=dev.dtype, max_num_seqs=ro.max_num_seqs,
                                   cpu_threads=cfg.cpu_threads, capture_graphs=ro.capture_graphs, **common,
                                   record_generations=str(generations_dir) if cfg.record_rollouts else None)
    v = cfg.vllm
    return EngineBackendConfig(
        backend="vllm", python=vllm_python, dtype=served_dtype(dev),
        max_num_seqs=v.max_num_seqs or ro.max_num_seqs,
        # on a slice of a shared GPU vLLM must size its cache to the slice, not the device
        gpu_memory_utilization=v.gpu_memory_utilization or (
            round(VLLM_DEFAULT_MEMORY_UTILIZATION * dev.memory_share, 3) if dev.memory_share < 1 else None),
        enforce_eager=v.enforce_eager, cpu_kvcache_gib=v.cpu_kvcache_gib,
        startup_timeout_s=v.startup_timeout_s, extra_args=tuple(v.extra_args), **common)
