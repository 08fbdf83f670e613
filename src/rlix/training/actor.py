"""TrainerActor: a thin Ray shell over PolicyTrainer, one per trainer rank.

Everything interesting lives in trainer.py (testable without Ray). Placement is the caller's:
`TrainerActor.options(num_gpus=1).remote(model, device="cuda", rank=r, world_size=n)`. The
weight cache stays in this process (pinned, or shared memory another process on the host can
map); remote callers get a small summary of it, never the tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray

from rlix.threads import yield_cores_to_control
from rlix.training.types import GroupSpec, TrainSample


def _samples(samples: Sequence[TrainSample | Mapping[str, Any]]) -> list[TrainSample]:
    return [s if isinstance(s, TrainSample) else TrainSample(**s) for s in samples]


@ray.remote(num_cpus=0)
class TrainerActor:
    """One PolicyTrainer rank; keyword arguments go to PolicyTrainer unchanged."""

    def __init__(self, model: str, cpu_threads: int | None = None, **kwargs: Any) -> None:
        from rlix.training.trainer import PolicyTrainer

        if cpu_threads:  # several trainers and shards on a few cores: oversubscription costs 7x
            import torch

            torch.set_num_threads(cpu_threads)

        self.trainer = PolicyTrainer(model, **kwargs)
        # On a CPU device forward/backward run on a thread of their own that yields the cores to
        # control threads (rlix.threads), so cache builds, syncs and the shards' control calls
        # stay prompt. On CUDA they stay on the calling thread (the current device is per thread).
        self._compute: ThreadPoolExecutor | None = None
        if self.trainer.device.type == "cpu":
            self._compute = ThreadPoolExecutor(1, thread_name_prefix="rlix-train",
                                               initializer=yield_cores_to_control)

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._compute is None:
            return fn(*args, **kwargs)
        return self._compute.submit(fn, *args, **kwargs).result()

    def train_step(self, samples: Sequence[TrainSample | Mapping[str, Any]],
                   group: GroupSpec | None = None) -> dict[str, float]:
        return self._run(self.trainer.train_step, _samples(samples), group=group)

    def compute_logprobs(self, samples: Sequence[TrainSample | Mapping[str, Any]]) -> list[list[float]]:
        return self._run(self.trainer.compute_logprobs, _samples(samples))

    def build_cache(self, version: int) -> dict[str, Any]:
        """Snapshot the weights as `version`; returns version, num_buckets, bytes, seconds and
        the cache's shared-memory segment names (empty when it is pinned instead)."""
        started = time.perf_counter()
        cache = self.trainer.build_cache(version)
        return {"version": int(version), "num_buckets": cache.layout.num_buckets,
                "bytes": cache.layout.total_bytes, "seconds": time.perf_counter() - started,
                "versions": list(cache.versions()),
                "shm_segments": [s.name for s in cache.shm_segments()]}

    def promote_active(self, version: int) -> None:
        if self.trainer.cache is None:
            from rlix.errors import WeightCacheError

            raise WeightCacheError("no weight cache yet: call build_cache first")
        self.trainer.cache.promote_active(version)

    def offload(self) -> None:
        self.trainer.offload()

    def reload(self) -> None:
        self.trainer.reload()

    def save_checkpoint(self, path: str) -> str:
        return str(self.trainer.save_checkpoint(path))

    def load_checkpoint(self, path: str) -> int:
        self.trainer.load_checkpoint(path)
        return self.trainer.step

    def step(self) -> int:
        return self.trainer.step

    def sync_shards(self, version: int, urls: Mapping[int, str], api_key: str,
                    wake: list[int] | None = None) -> dict[str, Any]:
        """Push cached `version` to these engine servers ({dp rank: url}) and only those, waking
        the ranks in `wake` first: the cache lives here, so the selective sync runs here
        (rlix.weights.push)."""
        if self.trainer.cache is None:
            from rlix.errors import WeightCacheError

            raise WeightCacheError("no weight cache yet: call build_cache first")
        if getattr(self, "_pusher", None) is None:
            from rlix.weights.push import ShardWeightPusher

            self._pusher = ShardWeightPusher(lambda: self.trainer.cache, api_key)
        return self._pusher.sync(version, {int(r): u for r, u in urls.items()}, wake or ())

    def close(self) -> None:
        """Free the host cache (its shared memory is unlinked); the actor can then be killed."""
        if getattr(self, "_pusher", None) is not None:
            self._pusher.close()
            self._pusher = None
        if self.trainer.cache is not None:
            self.trainer.cache.close()
            self.trainer.cache = None
