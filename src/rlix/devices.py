"""Device memory as measured, for the hand-off of a GPU from one holder to the next.

A holder that gives a GPU up reports `DeviceMemory` after freeing (what its allocator still
reserves, and what the driver says is free on the device); the next holder waits until enough
is free before it allocates (`wait_for_free`). Numbers come from `torch.cuda.mem_get_info` (the
driver's view, every process included) and the caching allocator's counters, never from
bookkeeping. On CPU there is no device memory: the reports carry zeros and `device_free` None.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rlix.errors import ConfigError, GpuMemoryError

#: what a holder may still reserve after it said it freed the GPU without any question asked:
#: allocator remnants and library workspaces. More is tolerated where the device still has room
#: for the next holder (`release_shortfall`)
RELEASE_SLACK_BYTES = 512 << 20
#: a release that leaves too little free is measured again this many times, this far apart
RELEASE_RETRIES = 3
RELEASE_RETRY_S = 0.2


def free_cuda_caches(device: torch.device) -> None:
    """Hand the allocator's cached blocks back to the driver, cuBLAS workspaces included (they
    are allocator memory too and outlive the work that made them)."""
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def cap_process_memory(device: str | torch.device, share: float) -> None:
    """Let this process's allocator take at most `share` of its GPU's memory (a process placed
    on a slice of a shared GPU, `cluster.gpu_slices`): going past it is an out-of-memory error
    in this process, never a neighbour's. Nothing on CPU or at a share of 1."""
    device = torch.device(device)
    if not 0 < share <= 1:
        raise ConfigError(f"a GPU memory share must be in (0, 1], got {share}")
    if device.type != "cuda" or share >= 1:
        return
    torch.cuda.set_per_process_memory_fraction(share, device.index if device.index is not None
                                               else torch.cuda.current_device())


@dataclass(frozen=True)
class DeviceMemory:
    """One holder's view of its GPU at one moment."""

    device: str
    reserved: int  # bytes this process's allocator holds on the device
    allocated: int  # of which live tensors
    device_free: int | None  # bytes free on the whole device (driver), None on CPU
    device_total: int | None
    at: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def memory_report(row: dict[str, Any]) -> DeviceMemory:
    """A `DeviceMemory` from its dict (as a holder in another process sent it); missing fields
    read as nothing held and no device (CPU)."""
    return DeviceMemory(str(row.get("device", "")), int(row.get("reserved") or 0),
                        int(row.get("allocated") or 0), row.get("device_free"), row.get("device_total"),
                        float(row["at"]) if row.get("at") is not None else time.time())


def measure(device: torch.device | str) -> DeviceMemory:
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceMemory(str(device), 0, 0, None, None, time.time())
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(str(device), torch.cuda.memory_reserved(device),
                        torch.cuda.memory_allocated(device), free, total, time.time())


def release_and_measure(device: torch.device | str) -> DeviceMemory:
    """Give the allocator's cached blocks back to the driver, then measure."""
    device = torch.device(device)
    if device.type == "cuda":
        free_cuda_caches(device)
    return measure(device)


def release_shortfall(report: DeviceMemory, *, holder: str, gpu: str, need_bytes: int) -> str | None:
    """Why a release leaves `gpu` unusable for its next holder, or None when it does not.

    A holder's allocator may keep some memory after it let go (library workspaces, a CUDA graph
    pool of a resident engine, fragments): that residue is tolerated as long as the device still
    has `need_bytes` free, what the next holder needs to take the GPU. Only a real shortage is
    a failure: residue that leaves too little free, named with the GPU, the holder and the bytes.
    On CPU (no device memory) nothing is short."""
    if report.device_free is None or report.reserved <= RELEASE_SLACK_BYTES:
        return None
    if report.device_free >= need_bytes:
        return None
    return (f"GPU {gpu}: {holder} still holds {report.reserved / 2**20:.0f} MiB after releasing it, "
            f"and only {report.device_free / 2**30:.2f} GiB of {(report.device_total or 0) / 2**30:.2f} GiB "
            f"is free where the next holder needs {need_bytes / 2**30:.2f} GiB")


async def confirm_release(first: DeviceMemory, remeasure: Callable[[], Awaitable[DeviceMemory]], *,
                          holder: str, gpu: str, need_bytes: int, retries: int | None = None,
                          retry_s: float | None = None) -> DeviceMemory:
    """The release measured in `first` holds, or is measured again (`remeasure`: the holder
    frees and measures once more) up to `retries` times, `retry_s` apart: memory freed by
    another process or an asynchronous free shows up a moment later. Raises GpuMemoryError with
    the shortfall only when the last measurement still leaves too little free."""
    retries = RELEASE_RETRIES if retries is None else retries
    retry_s = RELEASE_RETRY_S if retry_s is None else retry_s
    report = first
    for attempt in range(retries + 1):
        why = release_shortfall(report, holder=holder, gpu=gpu, need_bytes=need_bytes)
        if why is None:
            return report
        if attempt == retries:
            raise GpuMemoryError(f"{why} (measured {retries + 1} times over "
                                 f"{retries * retry_s:.1f} s)")
        await asyncio.sleep(retry_s)
        report = await remeasure()
    return report


def wait_for_free(device: torch.device | str, need_bytes: int, *, holder: str, gpu: str,
                  timeout_s: float = 60.0, poll_s: float = 0.05) -> DeviceMemory:
    """Block until the device has `need_bytes` free (measured), or raise GpuMemoryError naming
    the GPU and the holder that waited. Returns the last measurement."""
    device = torch.device(device)
    deadline = time.monotonic() + timeout_s
    while True:
        report = measure(device)
        if report.device_free is None or report.device_free >= need_bytes:
            return report
        if time.monotonic() >= deadline:
            raise GpuMemoryError(
                f"GPU {gpu}: {holder} needs {need_bytes / 2**30:.2f} GiB but only "
                f"{report.device_free / 2**30:.2f} GiB of {report.device_total / 2**30:.2f} GiB was free "
                f"after waiting {timeout_s:g} s for the previous holder to release it")
        time.sleep(poll_s)
