"""Page-locking host memory that something else allocated (a shared-memory mapping).

The GPU's copy engines read page-locked memory directly; from ordinary pageable memory the
driver bounces every copy through a staging buffer of its own (several times slower:
docs/BENCHMARKS.md) and the copy cannot overlap anything. torch only pins memory it allocates
itself, so a shared-memory segment (the weight cache, or its mapping in a shard) is
registered with cudaHostRegister instead. Registering costs time per GiB: do it once per
mapping and keep it for the mapping's lifetime.

A registration must end before its memory is unmapped: CUDA keeps translating the address to
the old physical pages, so a later mapping at the same address would send copies there (seen:
a cache whose bytes never reached its segment). A PinnedRange therefore holds the memory alive
and unregisters when released or garbage-collected, before the memory can go.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from rlix.errors import WeightTransferError

T = TypeVar("T")

log = logging.getLogger(__name__)

PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered


class PinnedRange:
    """One registered range [ptr, ptr + nbytes), holding `owner` (what keeps the memory mapped)
    until `release()` (idempotent) or garbage collection unregisters it."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.ptr, self.nbytes = int(ptr), int(nbytes)
        self._owner = owner
        self._finalizer = weakref.finalize(self, _unregister, self.ptr)
        self._finalizer.atexit = False  # the process's exit releases everything anyway

    @property
    def live(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()
        self._owner = None


def page_lock(ptr: int, nbytes: int, owner: Any) -> PinnedRange | None:
    """Register [ptr, ptr + nbytes) (memory just mapped, kept mapped by `owner`) as page-locked.
    None, with a warning, if CUDA refuses: the memory still works, only host<->GPU copies from
    it run at pageable speed. Raises WeightTransferError if a stale registration covers it and
    cannot be removed (copies would go to another mapping's pages)."""
    if nbytes <= 0 or not torch.cuda.is_available():
        return None
    err = _in_own_thread(lambda: int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, PORTABLE)))
    if err == ALREADY_REGISTERED:
        # Fresh memory cannot be registered yet by anyone: what is there is a stale registration
        # of an earlier mapping at this address. Drop it and register this one.
        log.warning("a stale page-locked registration covered %#x; replacing it", ptr)
        _in_own_thread(lambda: int(torch.cuda.cudart().cudaHostUnregister(ptr)))
        err = _in_own_thread(lambda: int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, PORTABLE)))
        if err == ALREADY_REGISTERED:
            raise WeightTransferError(f"host memory at {ptr:#x} is covered by a stale page-locked "
                                      f"registration that cannot be removed; copies would go astray")
    if err:
        log.warning("cudaHostRegister of %d bytes at %#x failed with cudaError %d; copies from "
                    "this memory run at pageable speed", nbytes, ptr, err)
        return None
    return PinnedRange(ptr, nbytes, owner)


def page_lock_tensor(tensor: torch.Tensor) -> PinnedRange | None:
    """Page-lock the whole host storage under `tensor` (e.g. a mapped segment); the range keeps
    that storage (and so the mapping) alive while registered."""
    storage = tensor.untyped_storage()
    return page_lock(storage.data_ptr(), storage.nbytes(), storage)


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.synchronize()  # an async copy may still be reading the range
        err = _in_own_thread(lambda: int(torch.cuda.cudart().cudaHostUnregister(ptr)))
    except Exception as exc:  # noqa: BLE001 - a finaliser must not raise; say why instead
        log.warning("unregistering page-locked memory at %#x failed: %s", ptr, exc)
        return
    if err:
        log.warning("cudaHostUnregister(%#x) failed with cudaError %d", ptr, err)


def _in_own_thread(call: Callable[[], T]) -> T:
    """Run a CUDA runtime call in a short-lived thread: a failed call leaves its error as that
    thread's "last error", where no later kernel-launch check of ours can trip over it. The
    thread uses the caller's device (a new thread would start on device 0 and create a context
    there)."""
    out: list[T] = []
    err: list[BaseException] = []
    device = torch.cuda.current_device()

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            out.append(call())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            err.append(exc)

    t = threading.Thread(target=run, name="rlix-page-lock")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]
