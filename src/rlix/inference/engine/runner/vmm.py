"""Device memory at a fixed virtual address: unmapped to free it, mapped again at the same place.

Why: decode runs through CUDA graphs, and a graph holds the raw addresses of the KV cache and
of the parameters it read at capture. Memory freed and allocated again through torch's caching
allocator comes back elsewhere, so a sleep through it drops the graphs and the wake pays for
capturing them again in its first steps. The CUDA driver's virtual memory management splits
an allocation in two: a range of virtual addresses (reserved once, kept for the buffer's life)
and the physical memory mapped into it. A sleep unmaps and releases the physical memory (the
driver gets it back at once: `cudaMemGetInfo` shows it free); a wake creates new physical
memory and maps it at the same addresses, so the captured graphs stay valid and a wake is a
map plus a copy (or a zeroing).

The driver is called through ctypes on libcuda.so.1, which ships with the NVIDIA driver: no
extra dependency. Calls run in torch's primary context of the buffer's device. `available`
says whether this can be used on a device; anything that says no (CPU, no driver library, a
device without the capability, no numpy for torch's `__cuda_array_interface__` import, a first
small buffer that does not work through torch) keeps the engine on torch's allocator. Every failing driver call raises `VirtualMemoryError`, with
the call and its CUresult.

The tensor a buffer hands out is built from `__cuda_array_interface__` (torch keeps the
holder, and through it the buffer, alive as long as any view of it lives). While unmapped its
addresses lead nowhere: nothing may read or write it until `remap`. A buffer whose last tensor
goes is released then, unless a CUDA graph capture is in progress (`capturing`, or the current
stream captures): the release waits for the device, which a capture forbids, so it is put off
until the capture ends or the next buffer is made or mapped.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rlix.errors import GpuMemoryError, VirtualMemoryError

log = logging.getLogger(__name__)

CUDA_SUCCESS = 0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_NONE = 0
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0

_CUdeviceptr = ctypes.c_uint64  # CUdeviceptr_v2: unsigned long long
_CUhandle = ctypes.c_uint64  # CUmemGenericAllocationHandle: unsigned long long


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    """CUmemAllocationProp: type, requestedHandleTypes, location, win32HandleMetaData, allocFlags."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _MemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc: location, flags."""

    _fields_ = [("location", _MemLocation), ("flags", ctypes.c_int)]


_P = ctypes.POINTER
_SIGNATURES: dict[str, list[Any]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, _P(ctypes.c_char_p)],
    "cuDeviceGet": [_P(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [_P(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [_P(ctypes.c_void_p), ctypes.c_int],
    "cuCtxGetCurrent": [_P(ctypes.c_void_p)],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuMemGetAllocationGranularity": [_P(ctypes.c_size_t), _P(_AllocationProp), ctypes.c_int],
    "cuMemAddressReserve": [_P(_CUdeviceptr), ctypes.c_size_t, ctypes.c_size_t, _CUdeviceptr,
                            ctypes.c_ulonglong],
    "cuMemAddressFree": [_CUdeviceptr, ctypes.c_size_t],
    "cuMemCreate": [_P(_CUhandle), ctypes.c_size_t, _P(_AllocationProp), ctypes.c_ulonglong],
    "cuMemRelease": [_CUhandle],
    "cuMemMap": [_CUdeviceptr, ctypes.c_size_t, ctypes.c_size_t, _CUhandle, ctypes.c_ulonglong],
    "cuMemUnmap": [_CUdeviceptr, ctypes.c_size_t],
    "cuMemSetAccess": [_CUdeviceptr, ctypes.c_size_t, _P(_AccessDesc), ctypes.c_size_t],
}


class _Driver:
    """libcuda's virtual memory calls, typed, each checked; one per process."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._fns: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            self._fns[name] = fn
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._granularity: dict[int, int] = {}
        self._lock = threading.RLock()
        self.call("cuInit", 0)

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._fns["cuGetErrorName"](code, ctypes.byref(name)) != CUDA_SUCCESS or not name.value:
            return "unknown"
        return name.value.decode()

    def call(self, name: str, *args: Any) -> None:
        code = self._fns[name](*args)
        if code != CUDA_SUCCESS:
            raise VirtualMemoryError(f"{name} failed: CUresult {code} ({self.error_name(code)})",
                                     call=name, code=code)

    def device(self, ordinal: int) -> int:
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ordinal)
        return dev.value

    def supports_vmm(self, ordinal: int) -> bool:
        value = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(value),
                  CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, self.device(ordinal))
        return value.value == 1

    @contextmanager
    def context(self, ordinal: int) -> Iterator[None]:
        """Run the enclosed calls in the device's primary context (torch's), restoring whatever
        context the thread had."""
        with self._lock:
            ctx = self._contexts.get(ordinal)
            if ctx is None:
                ctx = ctypes.c_void_p()
                # retained once and never released: torch's runtime holds it for the process too
                self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), self.device(ordinal))
                self._contexts[ordinal] = ctx
        current = ctypes.c_void_p()
        self.call("cuCtxGetCurrent", ctypes.byref(current))
        switch = current.value != ctx.value
        if switch:
            self.call("cuCtxSetCurrent", ctx)
        try:
            yield
        finally:
            if switch:
                self.call("cuCtxSetCurrent", current)

    def properties(self, ordinal: int) -> _AllocationProp:
        """Pinned device memory on this device, no exportable handle, no compression."""
        prop = _AllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device(ordinal)
        prop.win32HandleMetaData = None
        return prop

    def granularity(self, ordinal: int) -> int:
        if ordinal not in self._granularity:
            size = ctypes.c_size_t()
            prop = self.properties(ordinal)
            self.call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(prop),
                      CU_MEM_ALLOC_GRANULARITY_MINIMUM)
            self._granularity[ordinal] = int(size.value)
        return self._granularity[ordinal]

    def reserve(self, nbytes: int, alignment: int) -> int:
        ptr = _CUdeviceptr()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), nbytes, alignment, 0, 0)
        return int(ptr.value)

    def map_new(self, address: int, nbytes: int, ordinal: int) -> int:
        """Create physical memory of nbytes, map it at address, allow the device to read and
        write it; returns its handle. Undoes what it did when a step fails."""
        handle = _CUhandle()
        prop = self.properties(ordinal)
        self.call("cuMemCreate", ctypes.byref(handle), nbytes, ctypes.byref(prop), 0)
        try:
            self.call("cuMemMap", address, nbytes, 0, handle, 0)
        except VirtualMemoryError:
            self.call("cuMemRelease", handle)
            raise
        access = _AccessDesc()
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = prop.location.id
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        try:
            self.call("cuMemSetAccess", address, nbytes, ctypes.byref(access), 1)
        except VirtualMemoryError:
            self.call("cuMemUnmap", address, nbytes)
            self.call("cuMemRelease", handle)
            raise
        return int(handle.value)

    def unmap(self, address: int, nbytes: int, handle: int) -> None:
        self.call("cuMemUnmap", address, nbytes)
        self.call("cuMemRelease", handle)

    def free_range(self, address: int, nbytes: int) -> None:
        self.call("cuMemAddressFree", address, nbytes)


_driver_lock = threading.RLock()  # re-entrant: a buffer may be finalised while it is held
_driver_instance: _Driver | None = None
_available: dict[int, bool] = {}
_mapped: dict[int, int] = {}  # device index -> bytes mapped now
_captures = 0  # CUDA graph captures in progress (cuda_graphs.py marks them with `capturing`)
#: buffers whose last tensor went during a capture, released after it
_orphans: list[VirtualBuffer] = []


def _driver() -> _Driver:
    global _driver_instance
    with _driver_lock:
        if _driver_instance is None:
            _driver_instance = _Driver()
        return _driver_instance


def _ordinal(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def available(device: torch.device | str) -> bool:
    """Whether VirtualBuffer can be used on `device`: a CUDA device whose driver library loads
    and which supports virtual memory management (and numpy, which torch's import of
    `__cuda_array_interface__` needs). Never raises; False on CPU."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("numpy") is None:
        return False
    try:
        torch.cuda.init()
        ordinal = _ordinal(device)
        if ordinal not in _available:
            why = _probe(ordinal) if _driver().supports_vmm(ordinal) else "the device does not support it"
            if why is not None:
                log.warning("CUDA virtual memory is not used on cuda:%d (%s): a sleep drops the "
                            "CUDA graphs", ordinal, why)
            _available[ordinal] = why is None
        return _available[ordinal]
    except (OSError, AttributeError, RuntimeError, GpuMemoryError) as exc:
        log.warning("CUDA virtual memory is not used (%s: %s)", type(exc).__name__, exc)
        return False


def _probe(ordinal: int) -> str | None:
    """Use a buffer once (view it from torch, write and read it across an unmap): why that
    fails here, or None. Run once per device, so that a torch or a driver that does not take
    to it leaves the engine on torch's allocator instead of failing its first allocation."""
    try:
        buffer = VirtualBuffer(1, torch.device("cuda", ordinal))
    except Exception as exc:  # noqa: BLE001 - any failure means: not here
        return f"{type(exc).__name__}: {exc}"
    try:
        view = buffer.tensor(torch.uint8, (buffer.nbytes,))
        for value in (7, 9):
            view.fill_(value)
            if int(view[-1]) != value or int(view[0]) != value:
                return "a byte written through torch did not read back"
            buffer.unmap()
            buffer.remap()
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        buffer.close()


def mapped_bytes(device: torch.device | str) -> int:
    """Bytes of physical memory all VirtualBuffers hold on `device` now (0 on CPU). Torch's
    allocator does not see them (`memory_reserved` leaves them out)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    with _driver_lock:
        return _mapped.get(_ordinal(device), 0)


def _account(ordinal: int, delta: int) -> None:
    with _driver_lock:
        _mapped[ordinal] = _mapped.get(ordinal, 0) + delta


@contextmanager
def capturing() -> Iterator[None]:
    """Mark a CUDA graph capture: a buffer whose last tensor goes meanwhile is released after it
    (its release waits for the device, which would break the capture)."""
    global _captures
    with _driver_lock:
        _captures += 1
    try:
        yield
    finally:
        with _driver_lock:
            _captures -= 1
            idle = _captures == 0
        if idle:
            release_orphans()


def _capture_in_progress() -> bool:
    with _driver_lock:
        if _captures:
            return True
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:  # noqa: BLE001 - no CUDA in this build or process: nothing captures
        return False


def release_orphans() -> None:
    """Release the buffers dropped during a capture (nothing views them any more)."""
    with _driver_lock:
        if _captures or not _orphans:
            return
        orphans = list(_orphans)
        _orphans.clear()
    for buffer in orphans:
        buffer.close()


class _ArrayInterface:
    """What torch.as_tensor reads: the whole range as bytes. Holds the buffer, so the buffer
    lives as long as any tensor built from it."""

    def __init__(self, buffer: VirtualBuffer) -> None:
        self.buffer = buffer
        self.__cuda_array_interface__ = {"shape": (buffer.nbytes,), "typestr": "|u1",
                                         "data": (buffer.address, False), "version": 2}


class VirtualBuffer:
    """A range of device virtual addresses, reserved once, with physical memory mapped into it
    or not. Sizes are rounded up to the driver's allocation granularity. Built mapped."""

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        if nbytes <= 0:
            raise ValueError(f"a virtual buffer needs a positive size, got {nbytes}")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"virtual buffers live on CUDA devices, not {device}")
        self._handle: int | None = None
        self._closed = True  # until the addresses are reserved
        self._orphaned = False
        torch.cuda.init()  # the primary context must exist before the driver calls
        release_orphans()  # memory a capture kept from being released, before taking more
        self.ordinal = _ordinal(device)
        self.device = torch.device("cuda", self.ordinal)
        self._driver = _driver()
        with self._driver.context(self.ordinal):
            granularity = self._driver.granularity(self.ordinal)
            self.nbytes = -(-nbytes // granularity) * granularity
            self.address = self._driver.reserve(self.nbytes, granularity)
        self._closed = False
        try:
            self.remap()
        except BaseException:
            self.close()
            raise

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """A tensor of `dtype` and `shape` over the start of the range, whose data_ptr is
        `address` for the buffer's whole life. Torch views the memory (checked: never a copy)
        and keeps this buffer alive while the tensor or any view of it lives; the buffer holds
        no tensor, so it is closed once the last one goes."""
        if self._closed:
            raise VirtualMemoryError("the virtual buffer is closed")
        numel = 1
        for n in shape:
            numel *= int(n)
        size = numel * dtype.itemsize
        if size > self.nbytes:
            raise ValueError(f"{tuple(shape)} of {dtype} needs {size} bytes; the buffer has {self.nbytes}")
        raw = torch.as_tensor(_ArrayInterface(self), device=self.device)
        if raw.data_ptr() != self.address or raw.device != self.device:
            raise VirtualMemoryError(
                f"torch did not view the virtual buffer at {self.address:#x} on {self.device} "
                f"(got {raw.data_ptr():#x} on {raw.device}): it would have copied it")
        return raw[:size].view(dtype).view(tuple(shape))

    def unmap(self) -> None:
        """Give the physical memory back to the driver (the addresses stay reserved). Waits for
        the device first: queued work may still use the memory. No-op when unmapped."""
        if self._handle is None:
            return
        torch.cuda.synchronize(self.device)
        with self._driver.context(self.ordinal):
            self._driver.unmap(self.address, self.nbytes, self._handle)
        self._handle = None
        _account(self.ordinal, -self.nbytes)

    def remap(self) -> None:
        """New physical memory at the same addresses; its contents are undefined (the caller
        zeroes or copies into it). No-op when mapped."""
        if self._closed:
            raise VirtualMemoryError("the virtual buffer is closed")
        if self._handle is not None:
            return
        release_orphans()
        with self._driver.context(self.ordinal):
            self._handle = self._driver.map_new(self.address, self.nbytes, self.ordinal)
        _account(self.ordinal, self.nbytes)

    def close(self) -> None:
        """Unmap and give the addresses back; nothing built from this buffer may be used after."""
        if self._closed:
            return
        self.unmap()
        with self._driver.context(self.ordinal):
            self._driver.free_range(self.address, self.nbytes)
        self._closed = True

    def __del__(self) -> None:
        # the last tensor over the buffer is gone (each holds the buffer through its holder)
        try:
            if self._closed or self._orphaned:
                return
            if _capture_in_progress():  # kept alive by the list until the capture ends
                self._orphaned = True
                with _driver_lock:
                    _orphans.append(self)
                return
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
            pass
