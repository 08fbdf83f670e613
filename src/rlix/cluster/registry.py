"""The job registry of a shared cluster: a named, detached Ray actor around `JobBook`.

It also holds what every job's driver needs to join the cluster (its GPU reservation, the
scheduler's view of the GPUs, the planner's knobs), so a driver started from any shell finds
everything through Ray by name. Its book is saved to Ray's key-value store at every change and
read back when Ray restarts the actor, so a crash of its worker loses no job.

It takes jobs from the head alone: `submit` needs the key the head made at random and handed it
at construction (in the actor's creation arguments, which Ray keeps to restart it: never on a
command line or in a file). Every holder of the cluster's Ray token can call the actor; only the
head knows who is submitting (the kernel tells it a socket peer's uid, rlix.cluster.intake), so
a client cannot put another user's name on a job by calling `submit` itself.
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import ray
from ray.experimental import internal_kv

from rlix.cluster.jobs import FINAL, Job, JobBook, Quotas
from rlix.errors import ConfigError
from rlix.placement import GpuReservation
from rlix.procguard import pid_alive
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import Topology

REGISTRY_NAME = "rlix:jobs"
#: how often the registry looks for jobs whose driver died
DRIVER_CHECK_S = 1.0
NAMESPACE = "rlix"
_KV_KEY = b"rlix:jobs:book"


@dataclass(frozen=True)
class ClusterInfo:
    """What a driver needs to run pipelines on the shared cluster."""

    address: str
    reservation: GpuReservation
    topology: Topology  # what the scheduler hands out (slices of the reserved GPUs)
    gpu_slices: int
    params: PlannerParams
    started_at: float
    #: the head's job submission socket (rlix.cluster.intake); "" where the head serves none
    submit_socket: str = ""


def _kv_put(value: bytes) -> None:
    internal_kv._internal_kv_put(_KV_KEY, value, overwrite=True)


def _kv_get() -> bytes | None:
    return internal_kv._internal_kv_get(_KV_KEY)


def _kv_del() -> None:
    internal_kv._internal_kv_del(_KV_KEY)


@ray.remote(num_cpus=0)
class JobRegistry:
    """See module doc. Every method answers at once except `wait_change`."""

    def __init__(self, info: ClusterInfo, quotas: Quotas, ended: tuple[Job, ...] = (),
                 head_key: bytes = b"") -> None:
        """`ended`: the jobs of the cluster's earlier life (its book file), shown, never run.
        `head_key`: what `submit` must be given (see module doc)."""
        if len(head_key) < 16:
            raise ValueError("the job registry needs the head's key (16 bytes or more) to take jobs")
        self._head_key = head_key
        self.info = info
        saved = _kv_get() if ray.get_runtime_context().was_current_actor_reconstructed else None
        if saved:
            self.book: JobBook = pickle.loads(saved)
        else:
            self.book = JobBook(info.topology.num_gpus, quotas)
            self.book.restore_ended(ended)
        self._changed = asyncio.Event()

    def cluster_info(self) -> ClusterInfo:
        return self.info

    def submit(self, job: Job, head_key: bytes = b"") -> dict:
        """Queue `job` (admitted at once if it fits). From the head only (see module doc)."""
        if not isinstance(head_key, bytes) or not hmac.compare_digest(head_key, self._head_key):
            raise ConfigError("the job registry takes jobs from the cluster's head only: submit with "
                              "`rlix submit`, which names the job's user by the account that submits it")
        return self.book.row(self._after(lambda: self.book.submit(job)).name)

    def attach_driver(self, name: str, pid: int, host: str | None = None) -> dict:
        """The job's driver process is up (its PID on `host`: `rlix down` ends it if it will not
        stop, `watch_drivers` fails its job if it dies)."""
        def change() -> Job:
            job = self.book.get(name)
            job.driver_pid, job.driver_host = pid, host
            return job
        return self.book.row(self._after(change).name)

    def set_state(self, name: str, state: str, reason: str = "") -> dict:
        return self.book.row(self._after(lambda: self.book.set_state(name, state, reason)).name)

    def cancel(self, name: str) -> dict:
        return self.book.row(self._after(lambda: self.book.cancel(name)).name)

    def job(self, name: str) -> dict:
        return self.book.row(name)

    def jobs(self) -> list[dict]:
        return self.book.rows()

    def records(self) -> list[dict]:
        """Every job, whole (what the head's book file keeps)."""
        return [j.record() for j in self.book.jobs.values()]

    def live_jobs(self) -> list[dict]:
        return [j.row() for j in self.book.live()]

    async def wait_change(self, timeout_s: float) -> None:
        """Returns at the next change of the book, or after `timeout_s`."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    async def watch_drivers(self, every_s: float = DRIVER_CHECK_S) -> None:
        """Runs until the actor ends: a live job whose driver (on this machine) died is failed,
        so its place in the cluster's floors goes to the queue. The driver's pipelines went
        with it (Ray ends a dead driver's actors); the scheduler takes their GPUs back."""
        host = socket.gethostname()
        while True:
            lost = self.book.lost_drivers(pid_alive, host)
            if lost:
                def change() -> None:
                    for name in lost:
                        pid = self.book.get(name).driver_pid
                        self.book.set_state(name, "failed", f"its driver (pid {pid}) died; its "
                                                            "pipelines ended with it")
                self._after(change)
            await asyncio.sleep(every_s)

    def forget(self) -> None:
        """The cluster goes down: its saved book goes with it."""
        _kv_del()

    def _after(self, change):  # type: ignore[no-untyped-def]
        result = change()
        _kv_put(pickle.dumps(self.book))
        event, self._changed = self._changed, asyncio.Event()
        event.set()
        return result


def start_registry(info: ClusterInfo, quotas: Quotas, ended: tuple[Job, ...],  # type: ignore[no-untyped-def]
                   head_key: bytes):
    """The registry actor, detached and restarted by Ray when its worker dies (with the same
    arguments: the head's key survives a restart)."""
    return JobRegistry.options(name=REGISTRY_NAME, namespace=NAMESPACE, lifetime="detached",
                               max_restarts=-1, max_task_retries=-1).remote(info, quotas, ended, head_key)


def ask(ref, timeout: float | None = None):  # type: ignore[no-untyped-def]
    """A registry call's answer; its own error (a ConfigError raised in the actor) as that error."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        raise ConfigError(str(exc.cause) if exc.cause else str(exc)) from None


def get_registry() -> Any:
    try:
        return ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
    except ValueError:
        raise ConfigError("no rlix cluster here: the Ray cluster has no job registry (start one with `rlix up`)") \
            from None


__all__ = ["FINAL", "REGISTRY_NAME", "ClusterInfo", "JobRegistry", "ask", "get_registry", "start_registry"]
