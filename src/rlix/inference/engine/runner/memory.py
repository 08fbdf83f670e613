"""Measure and give back memory, so a sleeping engine's freed bytes are real, not bookkeeping.

Host: resident set size from /proc/self/statm; after dropping tensors, `malloc_trim(0)` makes
glibc hand free heap pages back to the OS (large blocks are unmapped anyway, but glibc's dynamic
mmap threshold keeps many mid-sized tensors on the heap). CUDA: `torch.cuda.mem_get_info` after
emptying the caching allocator; what the process still holds asleep is torch's reserved memory
(CUDA graph pools of graphs kept across the sleep included) plus the virtual buffers' mapped
memory (vmm.py), which torch's allocator does not see.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from functools import lru_cache

import torch

from rlix.devices import free_cuda_caches
from rlix.inference.engine.runner import vmm


def host_rss_bytes() -> int:
    """This process's resident memory in bytes (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


@lru_cache(maxsize=1)
def _malloc_trim():  # type: ignore[no-untyped-def]
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def release_memory(device: torch.device, keep_workspaces: bool = False) -> None:
    """Return freed memory to the OS (host) or the driver (CUDA). `keep_workspaces`: leave
    cuBLAS's workspaces allocated (CUDA graphs kept across a sleep have the workspace of their
    capture baked in: freed, its memory could go to a later capture's tensors, which the kept
    graphs' matmuls would then overwrite)."""
    # Tensors are freed by reference counting as soon as they are dropped; a full collection
    # (100+ ms with a model loaded, paid on every preemption) would only find rare cycles, so
    # only the youngest generation is collected. malloc_trim hands freed host memory back.
    gc.collect(0)
    if device.type == "cuda":  # what the next holder needs is device memory: host stays as it is
        vmm.release_orphans()
        if keep_workspaces:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
        else:
            free_cuda_caches(device)
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def used_bytes(device: torch.device) -> int:
    """What the device's memory use looks like from outside: RSS on CPU, used bytes on CUDA."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    return host_rss_bytes()


def device_resident_bytes(device: torch.device) -> int | None:
    """What this process holds on its CUDA device besides the context: torch's reserved memory
    and the virtual buffers' mapped memory. None on CPU (no device memory to speak of)."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_reserved(device) + vmm.mapped_bytes(device)
