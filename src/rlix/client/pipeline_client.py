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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from rlix import env
from rlix.client.types import PipelineInfo, StepDone, TrainingGrant
from rlix.errors import ClientError, PipelineEndedError
from rlix.training.trainer import weights_for_sync
from rlix.weights.buckets import tensor_checksums
from rlix.weights.cache import BucketCache

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
        self._call_timeout_s = call_timeout_s

    # -- the hooks ---------------------------------------------------------------------------
    def start(self, weights: Weights, step: int = 0) -> StepDone:
        """Publish the policy's weights as version `step` (0, or the step a resumed run starts
        at) and let the scheduler place the pipeline's shards. Called once, before the first
        before_training."""
        return self._publish(step, weights, "client_start", step)

    def before_training(self, step: int) -> TrainingGrant:
        """Block until the pipeline's training GPUs are free for `step` (the next one: the
        number of steps done). Raises ClientOrderError when a step already holds them."""
        return self._call("client_before_training", int(step))

    def after_training(self, step: int, weights: Weights, *, metrics: Mapping[str, float] | None = None,
                       next_batch: tuple[int, int] | None = None) -> StepDone:
        """The step trained: `weights` become version step + 1, the training GPUs go back.
        `metrics` (e.g. reward, loss) are the step's row in the run's metrics and summary;
        `next_batch` = (done, total) of the next batch, so the GPUs are handed out knowing it."""
        return self._publish(step + 1, weights, "client_after_training", int(step),
                             {k: float(v) for k, v in (metrics or {}).items()},
                             None if next_batch is None else (int(next_batch[0]), int(next_batch[1])))

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
    def _publish(self, version: int, weights: Weights, verb: str, *args: object) -> StepDone:
        """Write `weights` as `version` into this process's cache once the pipeline said no
        shard reads the slot, then make the call `verb` with its references."""
        tensors = served_weights(weights, self._dtype)
        self._call("client_open_version", version, "start" if verb == "client_start" else "after_training")
        t0 = time.perf_counter()
        if self._cache is None:
            self._cache = BucketCache.for_model(tensors)
        self._cache.build_latest(version, tensors)
        self._cache.promote_active(version)
        published = self._cache.published(version, time.perf_counter() - t0)
        if published.refs is None:
            raise ClientError("this process's weight cache is not in shared memory (/dev/shm has no room for "
                              f"two versions, {2 * published.bytes / 2**20:.0f} MiB): shards cannot read it")
        checksums = dict(tensor_checksums(tensors)) if self.info.audit_weights else None
        return self._call(verb, *args, published, checksums)

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
