"""PipelineActor: the Ray actor of one pipeline, and its coordinator as the scheduler sees it.

Thin: everything is in PipelineRunner. It is an async actor, so the scheduler's
`resize_inference` runs while the pipeline's own loop waits in `request()` for GPUs.
"""

from __future__ import annotations

from typing import Any

import ray


@ray.remote(num_cpus=0)
class PipelineActor:
    def __init__(self, cfg: dict, *, mode: str, run_dir: str, api_key: str, gpus: list[int],
                 resume: bool = False) -> None:
        import logging

        from rlix.config.models import PipelineConfig
        from rlix.pipeline.runner import PipelineRunner
        from rlix.threads import favour_control_latency

        favour_control_latency()  # the control loop runs beside the data-plane thread
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        scheduler = None
        if mode == "rlix":
            from rlix.scheduler.service import get_scheduler

            scheduler = get_scheduler()
        self.runner = PipelineRunner(PipelineConfig.model_validate(cfg), mode=mode, run_dir=run_dir,
                                     api_key=api_key, gpus=gpus, scheduler=scheduler,
                                     self_handle=ray.get_runtime_context().current_actor,
                                     resume=resume)

    async def setup(self) -> dict:
        return await self.runner.setup()

    async def run(self) -> dict:
        return await self.runner.run()

    async def resize_inference(self, remove: list[int], add: dict[int, list[int]]) -> Any:
        return await self.runner.resize_inference(remove, add)

    async def progress(self) -> dict:
        return self.runner.progress()

    async def summary(self) -> dict:
        return self.runner.summary()

    async def shutdown(self) -> dict[str, float]:
        return await self.runner.shutdown()
