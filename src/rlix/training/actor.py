"""TrainerActor: a thin Ray shell over PolicyTrainer, one per trainer rank.

Everything interesting lives in trainer.py (testable without Ray). Placement is the caller's:
`TrainerActor.options(num_gpus=1).remote(model, train_cfg, device="cuda", rank=r, world_size=n)`.
The weight cache stays in this process (pinned, or shared memory another process on the host
can map): `publish(version)` snapshots the weights into it and answers where the version's
buckets lie; the pipeline's WeightPath (rlix.weights.refit) then refits shards from there.
Remote callers get typed summaries and references, never the tensors.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch

from rlix import env
from rlix.config.models import TrainConfig
from rlix.devices import DeviceMemory
from rlix.errors import WeightCacheError
from rlix.threads import yield_cores_to_control
from rlix.training.trainer import PolicyTrainer
from rlix.training.types import GroupSpec, TrainSample
from rlix.weights.nodes import relay
from rlix.weights.api import PublishedVersion, VersionRefs
from rlix.weights.buckets import tensor_checksums
from rlix.weights.vllm.names import Digest, vllm_digests


def _samples(samples: Sequence[TrainSample | Mapping[str, Any]]) -> list[TrainSample]:
    return [s if isinstance(s, TrainSample) else TrainSample(**s) for s in samples]


@ray.remote(num_cpus=0)
class TrainerActor:
    """One PolicyTrainer rank, configured by the pipeline's `train:` section.

    `cpu_threads` caps torch's threads
    (several trainers and shards on a few cores: oversubscription cost 7x); other keyword
    arguments (device, dtype, rank, world_size, cache_host...) go to PolicyTrainer."""

    def __init__(self, model: str, train: TrainConfig | None = None, *, seed: int = 0,
                 temperature: float = 1.0, cpu_threads: int | None = None,
                 engine: str = "embedded", served_dtype: str = "bfloat16", **kwargs: Any) -> None:
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        self.trainer = PolicyTrainer.from_config(model, train or TrainConfig(), seed=seed,
                                                 temperature=temperature, **kwargs)
        # the shards' engine: how their served weights are audited
        self.engine = engine
        self.served_dtype = getattr(torch, served_dtype)
        self._checksums: dict[int, dict[str, int | Digest]] = {}
        # a checkpoint asked for while a step trains (Ctrl-C, a failure elsewhere) waits for it:
        # weights, optimizer state and step counter are saved as one consistent state
        self._state = threading.Lock()
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
        with self._state:
            return self._run(self.trainer.train_step, _samples(samples), group=group)

    def compute_logprobs(self, samples: Sequence[TrainSample | Mapping[str, Any]]) -> list[list[float]]:
        return self._run(self.trainer.compute_logprobs, _samples(samples))

    def publish(self, version: int, audit: bool = False, on_device: bool = False) -> PublishedVersion:
        """Snapshot the weights into the cache as `version` and make it the version shards are
        refitted to (the cache keeps at most two); the answer says where its buckets lie.
        `audit`: also keep per-tensor checksums of it, computed where the weights are (the GPU),
        for `weight_checksums`. `on_device`: keep a copy on the GPU too until the offload, for
        the shards asleep on this GPU (its references in `device_refs`)."""
        audit_s = 0.0
        if audit:
            t0 = time.perf_counter()
            self._checksums = {int(version): self._audit_checksums(self.trainer.state_for_sync())}
            audit_s = time.perf_counter() - t0
        published = self.trainer.publish(version, on_device)
        return dataclasses.replace(published, audit_s=audit_s)

    def build_device_copy(self, version: int) -> VersionRefs | None:
        """The other ranks' part of `publish(on_device=True)`: the GPU copy only (rank 0 keeps
        the host cache); its references, or None where there is none (no room, not on CUDA)."""
        if self.trainer.build_device_copy(version) is None:
            return None
        copy = self.trainer.device_copy
        return copy.refs(version) if copy is not None else None

    def _audit_checksums(self, state: Mapping[str, torch.Tensor]) -> dict[str, int | Digest]:
        """What a shard's served weights are compared with: per-tensor checksums (rlix's engine
        serves the tensors as sent), or vLLM's own digests of them fused and cast as vLLM serves."""
        if self.engine != "vllm":
            return dict(tensor_checksums(state))
        embed, head = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
        if head is not None and embed is not None and head.data_ptr() == embed.data_ptr():
            state = {n: t for n, t in state.items() if n != "lm_head.weight"}  # tied: vLLM holds one
        return dict(vllm_digests(state, self.served_dtype))

    def weight_checksums(self, version: int) -> dict[str, int | Digest]:
        """Per-tensor checksums of a version published with `audit`."""
        if int(version) not in self._checksums:
            raise WeightCacheError(f"no checksums of version {version} (publish it with audit=True)")
        return self._checksums[int(version)]

    def send_version(self, version: int, host: str, port: int) -> float:
        """Stream cached `version` to a replica on another node (a NodeCacheActor listening at
        host:port, rlix.weights.nodes.relay), where this cache's shared memory cannot be mapped;
        returns the seconds it took. The version is leased meanwhile, so no build overwrites it."""
        if self.trainer.cache is None:
            raise WeightCacheError("no weight cache yet: publish a version first")
        return relay.send_version(self.trainer.cache, int(version), host, int(port))

    def offload(self) -> DeviceMemory:
        """Offload, then the device memory measured afterwards (the release confirmation)."""
        return self.trainer.offload()

    def reload_bytes(self) -> int:
        """What this rank needs free on its GPU to reload (the hand-off check's need)."""
        return self.trainer.reload_bytes()

    def reload(self, timeout_s: float = 60.0, gpu: str | None = None) -> DeviceMemory:
        """Reload once the GPU has room (measured); GpuMemoryError naming `gpu` otherwise."""
        return self.trainer.reload(timeout_s, gpu)

    def visible_devices(self) -> str | None:
        """CUDA_VISIBLE_DEVICES of this process, as placement set it."""
        return env.visible_devices()

    def pid(self) -> int:
        return os.getpid()

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and a port free on it now: the master address of a data-parallel step
        (rank 0's; a fresh port per step, so no communicator outlives its step)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), int(port)

    def node_id(self) -> str:
        """The Ray node this trainer runs on (where its shared-memory cache lives)."""
        return ray.get_runtime_context().get_node_id()

    def save_checkpoint(self, path: str) -> int:
        """Saves to `path`; returns the step saved (after any step in progress)."""
        with self._state:
            self.trainer.save_checkpoint(path)
            return self.trainer.step

    def load_checkpoint(self, path: str) -> int:
        with self._state:
            self.trainer.load_checkpoint(path)
            return self.trainer.step

    def step(self) -> int:
        return self.trainer.step

    def close(self) -> None:
        """Free the host cache (its shared memory is unlinked); the actor can then be killed."""
        if self.trainer.cache is not None:
            self.trainer.cache.close()
            self.trainer.cache = None
