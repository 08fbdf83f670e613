"""PipelineActor: the Ray actor of one pipeline, and its coordinator as the scheduler sees it.

Thin: everything is in PipelineRunner. It is an async actor, so the scheduler's
`resize_inference` runs while the pipeline's own loop waits in `request()` for GPUs. The run
mode's name is read here, once, to pick the hooks that are the mode from then on.

This module stays light (the runner, and with it torch and transformers, is imported by the
constructor): a process that receives this actor's handle loads its class to learn its methods,
and the scheduler receives one with every registration. With the runner imported here, each
registration made the scheduler import torch first, holding every call behind it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from rlix.config.models import LoggingConfig, PipelineConfig
from rlix.errors import ClientError
from rlix.pipeline.hooks import ColocatedHooks, RLixHooks
from rlix.pipeline.device_plan import DevicePlan
from rlix.pipeline.scheduler_hooks import SchedulerHooks
from rlix.scheduler.service import get_scheduler
from rlix.threads import favour_control_latency

if TYPE_CHECKING:
    from rlix.pipeline.external.runner import ExternalRunner


def make_hooks(mode: str, cfg: PipelineConfig, gpus: list[int], handle: Any,
               devices: DevicePlan | None = None, metrics_path: str | None = None) -> RLixHooks:
    """The strategy of a run mode: "rlix" time-shares through the scheduler (on any of the
    run's GPUs, `devices`); "standalone" runs on the fixed `gpus`. `metrics_path`: the
    pipeline's metrics.jsonl, named to the scheduler for its dashboard's curves."""
    if mode == "rlix":
        return SchedulerHooks(get_scheduler(), cfg.name, cfg.train_gpus, handle,
                              devices.gpu_ids if devices is not None else [], metrics_path=metrics_path)
    return ColocatedHooks(gpus, cfg.train_gpus)


@ray.remote(num_cpus=0)
class PipelineActor:
    def __init__(self, cfg: dict, *, mode: str, run_dir: str, api_key: str, gpus: list[int],
                 resume: bool = False, devices: DevicePlan | None = None,
                 vllm_python: str | None = None, experiment_log: dict | None = None,
                 actor_name: str | None = None) -> None:
        from rlix.pipeline.external.runner import ExternalRunner  # deferred: see the module doc
        from rlix.pipeline.runner import PipelineRunner  # deferred: see the module doc

        favour_control_latency()  # the control loop runs beside the data-plane thread
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        config = PipelineConfig.model_validate(cfg)
        hooks = make_hooks(mode, config, gpus, ray.get_runtime_context().current_actor, devices,
                           metrics_path=str(Path(run_dir).resolve() / config.name / "metrics.jsonl"))
        common: dict[str, Any] = dict(run_dir=run_dir, api_key=api_key, resume=resume, devices=devices,
                                      vllm_python=vllm_python,
                                      experiment_log=LoggingConfig.model_validate(experiment_log)
                                      if experiment_log is not None else None)
        self.runner: PipelineRunner
        self.external: ExternalRunner | None = None  # `external:` pipelines: their program's calls land here
        if config.external is not None:
            if actor_name is None:
                raise ValueError(f"{config.name}: an external pipeline's actor needs its name (actor_name)")
            self.runner = self.external = ExternalRunner(config, hooks, actor_name=actor_name, **common)
        else:
            self.runner = PipelineRunner(config, hooks, **common)

    async def setup(self) -> dict:
        return await self.runner.setup()

    async def run(self) -> dict:
        return await self.runner.run()

    async def resize_inference(self, remove: list[int], add: dict[int, list[int]]) -> Any:
        return await self.runner.resize_inference(remove, add)

    async def reassert_shards(self, shards: dict[int, list[int]], wake: bool = True) -> Any:
        return await self.runner.reassert_shards(shards, wake)

    async def progress(self, since: int | None = None) -> dict:
        return self.runner.progress(since)

    async def summary(self) -> dict:
        return self.runner.summary()

    async def shutdown(self) -> dict[str, float]:
        return await self.runner.shutdown()

    # -- rlix.client's calls (external pipelines only; see pipeline/external/runner.py) ------------
    def _client(self) -> ExternalRunner:
        if self.external is None:
            raise ClientError(f"{self.runner.cfg.name} is rlix's own pipeline, not an external one")
        return self.external

    async def client_info(self) -> Any:
        return self._client().client_info()

    async def client_open_version(self, version: int, purpose: str) -> Any:
        return await self._client().client_open_version(version, purpose)

    async def client_start(self, step: int, published: Any, checksums: dict | None) -> Any:
        return await self._client().client_start(step, published, checksums)

    async def client_before_training(self, step: int) -> Any:
        return await self._client().client_before_training(step)

    async def client_publish(self, step: int, published: Any, checksums: dict | None) -> Any:
        return await self._client().client_publish(step, published, checksums)

    async def client_after_training(self, step: int, metrics: dict, next_batch: tuple[int, int] | None,
                                    handoff: Any) -> Any:
        return await self._client().client_after_training(step, metrics, next_batch, handoff)

    async def client_report_progress(self, done: int, total: int) -> None:
        await self._client().client_report_progress(done, total)

    async def client_clear_progress(self) -> None:
        await self._client().client_clear_progress()
