"""PipelineClient: the hooks a framework's own training loop calls to run as an rlix pipeline.

rlix starts the program named in a pipeline's `external.command`; inside it:

    client = rlix.client.connect()               # the pipeline rlix set up for this program
    client.start(model)                           # its weights now: version 0 (or a resumed step)
    for step in range(client.info.steps):
        ...generate through client.info.base_url, score, build the batch...
        client.report_progress(done, total)       # how far the next batch is (the scheduler's demand)
        client.before_training(step)              # blocks until its training GPUs are free
        ...one optimizer step...
        client.after_training(step, model, metrics={"reward": r})   # weights out, GPUs back

Between the calls rlix moves GPUs: before_training shrinks this and other pipelines' shards off
the training GPUs (their requests in flight go to other shards), after_training writes the new
weights into a page-locked bucket cache in this process's shared memory and hands the GPUs
back; shards that wake there, and those that kept generating, are refit to the new version
before they answer again. Every call is checked on the pipeline's side: out of order, or after
the pipeline ended, it raises a ClientError subclass and changes nothing. The caller imports
nothing else of rlix.

On real GPUs, a model on CUDA given to start() (with its optimizer: `start(model,
optimizer=opt)`) is moved to page-locked host memory whenever the program gives its GPUs back
(at start and after each step) and back at before_training (client/gpu_state.py), with the
native trainer's measured hand-off. after_training then also packs the new version on the
training GPU, and the pipeline's shards asleep there take it device to device (CUDA IPC) before
the state leaves the GPU; the others read the host cache.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

import torch

from rlix import env
from rlix.client.gpu_state import TrainingState
from rlix.client.types import Handoff, PipelineInfo, StepDone, TrainingGrant
from rlix.errors import ClientError, PipelineEndedError
from rlix.training.trainer import weights_for_sync
from rlix.weights.api import PublishedVersion
from rlix.weights.buckets import tensor_checksums
from rlix.weights.cache import BucketCache
from rlix.weights.device_copy import DeviceCopy, copy_to_host

Weights = torch.nn.Module | Mapping[str, torch.Tensor]


def served_weights(source: Weights, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors shards are refit with, as rlix's own trainer sends them (weights_for_sync):
    a model's parameters under its checkpoint names, tied ones once, its persistent buffers;
    a mapping as given; floating ones in the served dtype."""
    if isinstance(source, torch.nn.Module):
        return weights_for_sync(source, dtype)
    return {n: t.detach().to(dtype) if t.is_floating_point() and t.dtype != dtype else t.detach()
            for n, t in source.items()}


class PipelineClient:
    """See module doc. Made by `connect()`; one per pipeline and process."""

    def __init__(self, actor: object, info: PipelineInfo, call_timeout_s: float | None = None) -> None:
        self._actor = actor
        self.info = info
        self._dtype = getattr(torch, info.served_dtype)
        self._cache: BucketCache | None = None
        self._device_copy: DeviceCopy | None = None
        self.state: TrainingState | None = None  # the CUDA state moved off the GPU between steps
        self._gpus: list[int] = []  # the last grant's
        self._call_timeout_s = call_timeout_s

    # -- the hooks ---------------------------------------------------------------------------
    def start(self, weights: Weights, step: int = 0, *, optimizer: torch.optim.Optimizer | None = None) -> StepDone:
        """Publish the policy's weights as version `step` (0, or the step a resumed run starts
        at) and let the scheduler place the pipeline's shards. Called once, before the first
        before_training. A model on CUDA (and `optimizer`'s state) leaves the GPU here and
        comes back at each before_training (module doc)."""
        if self.state is None:
            self.state = TrainingState.of(weights, optimizer)
        published, checksums = self._build(step, weights, "start", on_device=False)
        self._release()
        return self._call("client_start", step, published, checksums)

    def before_training(self, step: int) -> TrainingGrant:
        """Block until the pipeline's training GPUs are free for `step` (the next one: the
        number of steps done), then bring the training state back onto them. Raises
        ClientOrderError when a step already holds them."""
        grant: TrainingGrant = self._call("client_before_training", int(step))
        self._gpus = grant.gpus
        if self.state is not None:
            self.state.reload(self._where(), self._holder(), self.info.release_timeout_s)
        return grant

    def after_training(self, step: int, weights: Weights, *, metrics: Mapping[str, float] | None = None,
                       next_batch: tuple[int, int] | None = None) -> StepDone:
        """The step trained: `weights` become version step + 1, the training GPUs go back.
        `metrics` (e.g. reward, loss) are the step's row in the run's metrics and summary;
        `next_batch` = (done, total) of the next batch, so the GPUs are handed out knowing it."""
        on_device = self.state is not None and self.state.on_device and self.info.beside_trainer
        published, checksums = self._build(step + 1, weights, "after_training", on_device=on_device)
        self._call("client_publish", int(step), published, checksums)  # shards beside it synced too
        released = self._release()
        return self._call("client_after_training", int(step), {k: float(v) for k, v in (metrics or {}).items()},
                          None if next_batch is None else (int(next_batch[0]), int(next_batch[1])), released)

    def report_progress(self, done: int, total: int) -> None:
        """How far the next batch is: `done` of `total` trajectories collected (the scheduler
        gives shards to pipelines by what they still need)."""
        self._call("client_report_progress", int(done), int(total))

    def clear_progress(self) -> None:
        """Nothing more to generate for now (the scheduler may take every shard)."""
        self._call("client_clear_progress")

    def close(self) -> None:
        """Release the weight cache (the program is done; the pipeline ends with it)."""
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def __enter__(self) -> PipelineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ----------------------------------------------------------------------------
    def _build(self, version: int, weights: Weights, purpose: str, *, on_device: bool
               ) -> tuple[PublishedVersion, dict | None]:
        """Write `weights` as `version` into this process's cache once the pipeline said no
        shard reads the slot. `on_device`: pack them on the training GPU first, fill the cache
        from there, and add the GPU copy's CUDA IPC references (for the shards asleep on it)."""
        tensors = served_weights(weights, self._dtype)
        self._call("client_open_version", version, purpose)
        t0 = time.perf_counter()
        if self._cache is None:
            self._cache = BucketCache.for_model(tensors)
        copied = self._pack_on_device(version, tensors) if on_device else None
        if copied is None:
            self._cache.build_latest(version, tensors)
        else:
            self._cache.write_version(version, lambda host: copy_to_host(copied, host))
        self._cache.promote_active(version)
        published = self._cache.published(version, time.perf_counter() - t0)
        if published.refs is None:
            raise ClientError("this process's weight cache is not in shared memory (/dev/shm has no room for "
                              f"two versions, {2 * published.bytes / 2**20:.0f} MiB): shards cannot read it")
        if copied is not None and self._device_copy is not None:
            published = dataclasses.replace(published, device_refs={0: self._device_copy.refs(version)})
        checksums = dict(tensor_checksums(tensors)) if self.info.audit_weights else None
        return published, checksums

    def _pack_on_device(self, version: int, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """The GPU copy of `version` (rlix.weights.device_copy), or None where the GPU has no
        room for it and a shard's staging beside it."""
        assert self._cache is not None and self.state is not None
        if self._device_copy is None:
            self._device_copy = DeviceCopy(self._cache.layout, self.state.device)
        if not self._device_copy.nbytes and not DeviceCopy.fits(self._device_copy.layout, self.state.device):
            return None
        return self._device_copy.build(version, tensors)

    def _release(self) -> Handoff | None:
        """The GPU copy freed and the training state off the GPU, measured (None: no state)."""
        if self._device_copy is not None:
            self._device_copy.free()
        if self.state is None:
            return None
        released = self.state.release(self._where(), self._holder())
        return Handoff(released, round(self.state.last_release_s, 4), round(self.state.last_reload_s, 4))

    def _where(self) -> str:
        """The training GPUs, as the run numbers them (the device before the first grant)."""
        return ",".join(map(str, self._gpus)) if self._gpus else str(self.state.device if self.state else "cpu")

    def _holder(self) -> str:
        return f"the program of {self.info.name}"

    def _call(self, method: str, *args: object):  # type: ignore[no-untyped-def]
        # deferred as in connect(): Ray is imported only after join_ray_with_token
        import ray
        from ray.exceptions import RayActorError, RayTaskError  # deferred: as ray

        try:
            return ray.get(getattr(self._actor, method).remote(*args), timeout=self._call_timeout_s)
        except RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, ClientError):
                raise type(cause)(str(cause)) from None
            raise ClientError(f"{self.info.name}: {method} failed: {cause!r}"[:2000]) from None
        except RayActorError as exc:
            raise PipelineEndedError(f"{self.info.name}: the pipeline is gone ({type(exc).__name__})") from None


def connect(timeout_s: float = 60.0) -> PipelineClient:
    """The pipeline rlix started this program for (its environment names it). Raises
    ClientError outside such a program."""
    target = env.client_target()
    if target is None:
        raise ClientError("rlix.client.connect(): this program was not started by rlix for a pipeline "
                          "(name it in a config's `external.command`; RLIX_CLIENT_* are unset)")
    env.join_ray_with_token()
    import ray  # deferred: after join_ray_with_token, which must run before Ray's import

    if not ray.is_initialized():
        ray.init(address=target.ray_address, namespace=target.namespace, log_to_driver=False,
                 logging_level=logging.WARNING)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actor = ray.get_actor(target.actor)
            break
        except ValueError:  # not registered yet (it is: rlix starts the program after it)
            if time.monotonic() > deadline:
                raise ClientError(f"rlix.client.connect(): no pipeline actor {target.actor!r} in namespace "
                                  f"{target.namespace!r} after {timeout_s:g} s") from None
            time.sleep(0.2)
    info = ray.get(actor.client_info.remote(), timeout=timeout_s)
    return PipelineClient(actor, info)
