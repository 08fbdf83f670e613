"""Where a pipeline's processes compute, resolved once by `rlix run` for the whole run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlix import env
from rlix.placement import GpuReservation


@dataclass(frozen=True)
class DevicePlan:
    """Where a pipeline's processes compute, as `rlix run` resolved it for the whole run."""

    device: str = "cpu"  # "cpu" | "cuda"
    dtype: str | None = None  # None: the checkpoint's
    #: the run's GPUs as physical devices; None: processes are not placed (tests, no Ray GPUs)
    reservation: GpuReservation | None = None
    release_timeout_s: float = 60.0  # a holder's release confirmation, at most
    #: start a time-shared pipeline's engines on every GPU during set-up (cluster.resident_engines)
    resident_engines: bool = False

    def resident_gpu_sets(self, tp: int, home: Sequence[int]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Where a time-shared pipeline's engines start before any rank is placed: (during
        set-up, in the background). During set-up, one on each GPU of its training `home`, where
        its first shard usually goes (as standalone mode starts its shard during set-up); with
        `resident_engines` (CUDA), one on every other GPU of the node too, in the background
        (slices of one device share a process). Nothing for `tp` > 1 (a shard's GPUs are chosen
        at placement) or several nodes (shards are Ray actors there)."""
        if self.reservation is None or self.multi_node or tp != 1:
            return [], []
        now = [(int(g),) for g in home]
        later = [(g,) for g in self.gpu_ids if (g,) not in now] if self.resident_engines else []
        return now, later

    @property
    def gpu_ids(self) -> list[int]:
        """The scheduler's GPU ids of the run (slices where the GPUs are sliced); [] unplaced."""
        return [s.gpu for s in self.reservation.slots] if self.reservation is not None else []

    @property
    def sleep_level(self) -> int:
        """Shards leaving a GPU drop their weights there (2); on CPU offloading them (1) is
        cheaper and frees nothing another holder could use anyway."""
        return 2 if self.device == "cuda" else 1

    @property
    def memory_share(self) -> float:
        """Of a GPU's memory, what one placed process may use (1/gpu_slices)."""
        return self.reservation.memory_share if self.reservation is not None else 1.0

    @property
    def multi_node(self) -> bool:
        """The run's GPUs are on several nodes: shards are Ray actors on their GPUs' node."""
        return self.reservation is not None and self.reservation.multi_node

    def visible_devices_env(self, gpus: Sequence[int]) -> dict[str, str]:
        assert self.reservation is not None
        out = {env.VISIBLE_DEVICES_VAR: self.reservation.visible_devices(gpus)}
        if self.memory_share < 1:
            out[env.GPU_MEMORY_SHARE_VAR] = repr(self.memory_share)
        return out
