"""The trainer's ranks as Ray processes: `TrainerActor` (one per rank, in its own process) and
`TrainerGroup` (the pipeline's handle on all of a pipeline's ranks, in the pipeline's process).

`TrainerActor` is a thin Ray shell over PolicyTrainer (everything interesting lives in
trainer.py, testable without Ray). Placement is the caller's:
`TrainerActor.options(num_gpus=1).remote(model, train_cfg, device="cuda", rank=r, world_size=n)`.
The weight cache stays in rank 0's process (pinned, or shared memory another process on the host
can map): `publish(version)` snapshots the weights into it and answers where the version's
buckets lie; the pipeline's WeightPath (rlix.weights.refit) then refits shards from there.
Remote callers get typed summaries and references, never the tensors.

`train_gpus > 1` runs the policy as `n` identical ranks: every step splits the batch across
them and all-reduces the gradients in a process group that lives only for that step (a fresh
rendezvous on rank 0's node, see trainer.py), so the ranks hold identical weights afterwards.
Hence what concerns the weights (publish, audit, save) runs on rank 0 only, and what concerns
every rank's GPU or state (reload, offload, train, load) runs on all of them at once.
`TrainerGroup` is a plain class with async methods, used from the pipeline's event loop; a
one-rank group behaves exactly like the single TrainerActor it wraps (its errors pass through
unchanged).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
import torch

from rlix import env
from rlix.config.models import TrainConfig
from rlix.devices import DeviceMemory
from rlix.errors import (RlixError, TrainerDiedError, TrainingError, WeightCacheError, actor_death,
                         one_line)
from rlix.threads import yield_cores_to_control
from rlix.training.fsdp import ShardedPolicyTrainer
from rlix.training.trainer import PolicyTrainer
from rlix.training.types import GroupSpec, TrainSample
from rlix.weights.api import PublishedVersion, VersionRefs
from rlix.weights.buckets import tensor_checksums
from rlix.weights.nodes import relay
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
        train = train or TrainConfig()
        if train.fsdp and int(kwargs.get("world_size", 1)) > 1:
            self.trainer: PolicyTrainer = ShardedPolicyTrainer.from_config(
                model, train, seed=seed, temperature=temperature,
                activation_checkpointing=train.activation_checkpointing, **kwargs)
        else:
            self.trainer = PolicyTrainer.from_config(model, train, seed=seed, temperature=temperature, **kwargs)
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

    # a sharded trainer's version, written by every rank (TrainerGroup.publish drives it)
    def _sharded(self) -> ShardedPolicyTrainer:
        if not isinstance(self.trainer, ShardedPolicyTrainer):
            raise TrainingError("this trainer is not sharded: publish() builds its versions")
        return self.trainer

    def open_version(self, version: int) -> VersionRefs:
        """(Rank 0) Open `version` in the cache; every rank then writes its shard there."""
        return self._sharded().open_version(version)

    def write_shard(self, refs: VersionRefs) -> None:
        with self._state:
            self._run(self._sharded().write_shard, refs)

    def close_version(self, version: int, seconds: float, audit: bool = False) -> PublishedVersion:
        """(Rank 0) Every rank wrote: `version` becomes the one shards are refitted to. `audit`:
        per-tensor checksums of it, computed from the cache."""
        trainer = self._sharded()
        published = trainer.close_version(version, seconds)
        audit_s = 0.0
        if audit:
            t0 = time.perf_counter()
            self._checksums = {int(version): self._audit_checksums(trainer.cached_weights(version))}
            audit_s = time.perf_counter() - t0
        return dataclasses.replace(published, audit_s=audit_s)

    def drop_version(self, version: int) -> None:
        """(Rank 0) A rank failed to write: `version` is dropped, the versions before it stay."""
        self._sharded().drop_version(version)

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

    def save_checkpoint(self, path: str, group: GroupSpec | None = None) -> int:
        """Saves to `path`; returns the step saved (after any step in progress). `group`: the
        rendezvous of sharded ranks, which save together."""
        with self._state:
            self.trainer.save_checkpoint(path, group)
            return self.trainer.step

    def load_checkpoint(self, path: str, group: GroupSpec | None = None) -> int:
        with self._state:
            self.trainer.load_checkpoint(path, group)
            return self.trainer.step

    def step(self) -> int:
        return self.trainer.step

    def close(self) -> None:
        """Free the host cache (its shared memory is unlinked); the actor can then be killed."""
        if self.trainer.cache is not None:
            self.trainer.cache.close()
            self.trainer.cache = None


#: how long close() waits for a rank's own cleanup (it may be stuck in a step) before killing it
CLOSE_TIMEOUT_S = 10.0


def _died(exc: BaseException) -> bool:
    """The rank's process is gone (a merely unreachable actor is not dead)."""
    return isinstance(exc, ray.exceptions.RayActorError) and not isinstance(
        exc, ray.exceptions.ActorUnavailableError)


def _first_failure(results: Sequence[Any]) -> tuple[int, BaseException] | None:
    """The lowest failed rank, a dead one before any other (its death is what failed the rest)."""
    failed = [(r, x) for r, x in enumerate(results) if isinstance(x, BaseException)]
    return min(failed, key=lambda f: (not _died(f[1]), f[0])) if failed else None


def _worst(reports: Sequence[DeviceMemory]) -> DeviceMemory:
    """The measurement the GPU hand-off must judge by: most memory still reserved, then least free."""
    return max(reports, key=lambda m: (m.reserved, -(m.device_free or 0)))


def split_batch(samples: Sequence[TrainSample], world_size: int) -> list[list[TrainSample]]:
    """Contiguous shares whose sizes differ by at most one; every rank gets at least one sample
    (an empty share cannot take part in the step's collectives like the others)."""
    if len(samples) < world_size:
        raise TrainingError(f"a batch of {len(samples)} samples cannot be split over {world_size} "
                            "data-parallel trainer ranks: each rank needs at least one sample")
    base, extra = divmod(len(samples), world_size)
    out, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        out.append(list(samples[start:start + size]))
        start += size
    return out


class TrainerGroup:
    """The trainer ranks of one pipeline; see the module doc. Build it with `start`."""

    def __init__(self, ranks: Sequence[Any], *, step_timeout_s: float = 300.0, sharded: bool = False) -> None:
        if not ranks:
            raise TrainingError("a trainer group needs at least one rank")
        self.ranks: list[Any] = list(ranks)
        self.step_timeout_s = float(step_timeout_s)
        # FSDP2 ranks (training/fsdp.py): each holds a shard, so every rank publishes and saves
        self.sharded = bool(sharded) and len(self.ranks) > 1
        self._one_host: bool | None = None  # known at the first sharded publish
        self._pids: list[int | None] = [None] * len(self.ranks)  # known once pids() ran

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @classmethod
    def start(cls, model_path: str, train_cfg: TrainConfig | None, rank_options: Sequence[Mapping[str, Any]],
              *, step_timeout_s: float = 300.0, **trainer_kwargs: Any) -> TrainerGroup:
        """One TrainerActor per entry of `rank_options` (its Ray placement), rank r of n. The
        keyword arguments (seed included) go to every rank alike, so the ranks start identical.
        `step_timeout_s` bounds each step's collectives (GroupSpec.timeout_s): a rank whose peer
        died fails after it rather than waiting forever."""
        if not rank_options:
            raise TrainingError("a trainer group needs at least one rank (rank_options is empty)")
        clash = {"rank", "world_size"} & trainer_kwargs.keys()
        if clash:
            raise TrainingError(f"the group sets {sorted(clash)} itself (one rank per rank_options entry)")
        n = len(rank_options)
        ranks = [TrainerActor.options(**dict(opts)).remote(model_path, train_cfg, rank=r, world_size=n,
                                                           **trainer_kwargs)
                 for r, opts in enumerate(rank_options)]
        return cls(ranks, step_timeout_s=step_timeout_s, sharded=bool(train_cfg and train_cfg.fsdp))

    # -- errors -----------------------------------------------------------------------------
    def _rank_error(self, rank: int, exc: BaseException) -> BaseException:
        """`exc` raised by `rank`, as an error that names the rank (several ranks: an error on
        rank 1 must not read as the pipeline's only trainer). A dead rank is TrainerDiedError;
        rlix's own errors keep their type; anything else becomes a TrainingError (one rank: as
        it was raised)."""
        pid = self._pids[rank]
        who = ("the trainer" if self.world_size == 1 else f"trainer rank {rank} of {self.world_size}") + (
            f" (pid {pid})" if pid is not None else "")
        if _died(exc):
            return TrainerDiedError(f"{who} died: {actor_death(exc)}")
        if self.world_size == 1:
            return exc
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, RlixError):
            try:
                return type(cause)(f"{who}: {cause}")
            except TypeError:  # an error type built from more than a message
                pass
        return TrainingError(f"{who} failed: {one_line(exc)}")

    async def _rank0(self, call: Awaitable[Any]) -> Any:
        """Rank 0's answer; its death raised as TrainerDiedError (`_rank_error`), not as Ray's."""
        try:
            return await call
        except ray.exceptions.RayActorError as exc:
            if not _died(exc):
                raise
            raise self._rank_error(0, exc) from exc

    def _raise_first(self, results: Sequence[Any]) -> None:
        """Raise for the first failed rank (see `_first_failure`), naming it."""
        first = _first_failure(results)
        if first is not None:
            err = self._rank_error(*first)
            if err is first[1]:
                raise err
            raise err from first[1]

    async def _on_all(self, calls: Iterable[Awaitable[Any]]) -> list[Any]:
        """Every rank's result, in rank order, once all have answered; the first failure (by
        `_raise_first`) raised after that, so no call is left running behind the error."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        self._raise_first(results)
        return list(results)

    async def _on_all_raw(self, calls: Iterable[Awaitable[Any]]) -> list[Any]:
        """Like `_on_all`, but the lowest failed rank's own exception is raised (a note names
        the rank), so callers can tell a dead rank (RayActorError) from a busy one."""
        results = await asyncio.gather(*calls, return_exceptions=True)
        first = _first_failure(results)
        if first is not None:
            first[1].add_note(f"trainer rank {first[0]} of {self.world_size}")
            raise first[1]
        return list(results)

    # -- GPU hand-off -----------------------------------------------------------------------
    async def reload(self, timeout_s: float = 60.0, where: str | Sequence[str] | None = None) -> DeviceMemory:
        """Every rank back on its GPU (each waits until its GPU has room, measured). `where`
        names the GPUs in errors: one label for all ranks, or one per rank. Returns the worst
        rank's measurement."""
        labels = [where] * self.world_size if where is None or isinstance(where, str) else list(where)
        if len(labels) != self.world_size:
            raise TrainingError(f"{len(labels)} GPU labels for {self.world_size} trainer ranks")
        reports = await self._on_all(a.reload.remote(timeout_s, g) for a, g in zip(self.ranks, labels))
        return _worst(reports)

    async def reload_bytes(self) -> int:
        """The most any rank needs free on its GPU to reload."""
        return max(await self._on_all(a.reload_bytes.remote() for a in self.ranks))

    async def offload(self) -> DeviceMemory:
        """Every rank off its GPU; the worst rank's measurement afterwards, since the release
        check must hold for every GPU the group gives back."""
        return _worst(await self._on_all(a.offload.remote() for a in self.ranks))

    # -- the step ---------------------------------------------------------------------------
    async def _group_spec_base(self) -> tuple[str, int]:
        """Rank 0's node IP and a port free there: the step's rendezvous (a fresh port per step,
        so no communicator outlives its step)."""
        try:
            return await self.ranks[0].rendezvous_address.remote()
        except Exception as exc:  # noqa: BLE001 - named by rank
            self._raise_first([exc])
            raise

    async def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """One data-parallel step: contiguous balanced shares, every rank at once; rank 0's
        metrics (the trainer all-reduces loss and token counts, so they are the batch's). The
        first rank to fail fails the step at once, naming the rank: the others are then stuck in
        a collective only until `step_timeout_s`, and are not waited for."""
        shares = split_batch(samples, self.world_size)
        if self.world_size == 1:
            return await self._rank0(self.ranks[0].train_step.remote(shares[0]))
        host, port = await self._group_spec_base()
        tasks = [asyncio.ensure_future(actor.train_step.remote(
                     share, GroupSpec(host, port, r, self.world_size, timeout_s=self.step_timeout_s)))
                 for r, (actor, share) in enumerate(zip(self.ranks, shares))]
        for t in tasks:  # a rank left behind a failed step still fails later: consume its error
            t.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)  # all done, or one failed
        self._raise_first([t.exception() if t.done() else None for t in tasks])
        return tasks[0].result()

    # -- weights: rank 0 holds the cache (the ranks' weights are identical) -----------------
    async def publish(self, version: int, audit: bool = False, on_device: bool = False) -> PublishedVersion:
        """Rank 0 snapshots its weights into its cache as `version` (see TrainerActor.publish).
        `on_device`: every rank also keeps a copy on its GPU until the offload, for the shards
        there; `device_refs` then holds each such rank's references."""
        if self.sharded:
            return await self._publish_shards(version, audit)
        if not on_device:
            return await self._rank0(self.ranks[0].publish.remote(version, audit))
        results = await self._on_all([self.ranks[0].publish.remote(version, audit, True)]
                                     + [a.build_device_copy.remote(version) for a in self.ranks[1:]])
        published: PublishedVersion = results[0]
        others = {r: refs for r, refs in enumerate(results[1:], start=1) if refs is not None}
        return dataclasses.replace(published, device_refs={**published.device_refs, **others})

    async def _publish_shards(self, version: int, audit: bool) -> PublishedVersion:
        """A sharded version: rank 0 opens it in its cache, every rank writes its rows there
        (no collective: a dim-0 shard is one byte range of the tensor), rank 0 closes it. The
        ranks must share rank 0's host (its cache is in shared memory). No device copy: no rank
        holds the whole model, so shards beside a rank sync from the host cache."""
        if self._one_host is None:
            nodes = await self.node_ids()
            self._one_host = len(set(nodes)) == 1
            if not self._one_host:
                raise TrainingError(f"the FSDP ranks of this trainer run on {len(set(nodes))} nodes; they write "
                                    "their shards into rank 0's shared-memory cache, so they must share its host")
        t0 = time.perf_counter()
        refs = await self._rank0(self.ranks[0].open_version.remote(version))
        try:
            await self._on_all(a.write_shard.remote(refs) for a in self.ranks)
        except BaseException:
            await self._rank0(self.ranks[0].drop_version.remote(version))
            raise
        return await self._rank0(self.ranks[0].close_version.remote(version, time.perf_counter() - t0, audit))

    async def weight_checksums(self, version: int) -> dict[str, int | Digest]:
        """Rank 0's checksums of a version published with `audit`."""
        return await self.ranks[0].weight_checksums.remote(version)

    async def send_version(self, version: int, host: str, port: int) -> float:
        """Rank 0 streams cached `version` to a node cache at host:port (see
        TrainerActor.send_version); the seconds it took."""
        return float(await self.ranks[0].send_version.remote(version, host, port))

    # -- checkpoints ------------------------------------------------------------------------
    async def save_checkpoint(self, path: str) -> int:
        """Rank 0 saves (its weights and optimizer state are every rank's), or with sharded ranks
        every rank its shard; the step saved."""
        if self.sharded:
            host, port = await self._group_spec_base()
            return int((await self._on_all(
                a.save_checkpoint.remote(path, GroupSpec(host, port, r, self.world_size, "gloo", self.step_timeout_s))
                for r, a in enumerate(self.ranks)))[0])
        return int(await self._rank0(self.ranks[0].save_checkpoint.remote(path)))

    async def load_checkpoint(self, path: str) -> int:
        """Every rank resumes from `path` (a filesystem all the ranks' nodes see); the step,
        which every rank must agree on."""
        groups: list[GroupSpec | None] = [None] * self.world_size
        if self.sharded:  # the ranks read their rows together (any number of ranks wrote them)
            host, port = await self._group_spec_base()
            groups = [GroupSpec(host, port, r, self.world_size, "gloo", self.step_timeout_s)
                      for r in range(self.world_size)]
        steps = [int(s) for s in await self._on_all(
            a.load_checkpoint.remote(path, g) for a, g in zip(self.ranks, groups))]
        if len(set(steps)) != 1:
            raise TrainingError(f"the trainer ranks loaded different steps from {path}: {steps}")
        return steps[0]

    # -- processes --------------------------------------------------------------------------
    async def pids(self) -> list[int]:
        """Every rank's process id, in rank order (raises the RayActorError of a dead rank)."""
        pids = await self._on_all_raw(a.pid.remote() for a in self.ranks)
        self._pids = list(pids)
        return pids

    async def pid(self) -> int:
        """Rank 0's process id."""
        self._pids[0] = int(await self.ranks[0].pid.remote())
        return self._pids[0]

    async def node_ids(self) -> list[str]:
        """The Ray node of every rank (where its shared-memory cache would live)."""
        return await self._on_all_raw(a.node_id.remote() for a in self.ranks)

    async def visible_devices(self) -> list[str | None]:
        """CUDA_VISIBLE_DEVICES of every rank, as placement set it."""
        return await self._on_all_raw(a.visible_devices.remote() for a in self.ranks)

    async def ping(self) -> None:
        """Every rank answers; ray.exceptions.RayActorError if one died (the rank in its notes)."""
        await self.pids()

    async def close(self) -> None:
        """Free every rank's cache, then kill every rank. Never raises: a rank may be dead
        already, or stuck in a failed step's collective (its close is waited for a bounded time)."""
        async def close_one(actor: Any) -> None:
            try:
                await asyncio.wait_for(actor.close.remote(), CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - dead or stuck: killed below either way
                pass

        await asyncio.gather(*(close_one(a) for a in self.ranks))
        for actor in self.ranks:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
