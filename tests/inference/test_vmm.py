"""Virtual device memory (runner/vmm.py): a wake maps memory back at the addresses the CUDA graphs
hold, so it is a map and a copy, not a recapture.

CPU: VMM is never used there (the engine's CPU path is unchanged), and the bookkeeping around it
(KV cache, weight store, parked parameters, storage versions) runs over a host stand-in for the
driver whose unmapping poisons the bytes. GPU (`gpu` mark): the buffer itself against the
driver's free memory, a CUDA graph replayed across an unmap, and engines that sleep and wake
without capturing again while they generate the same tokens."""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc

import pytest
import torch
from safetensors.torch import load_file

from rlix.errors import ConfigError, GpuMemoryError
from rlix.inference.engine import weights as weights_module
from rlix.inference.engine.api import SamplingParams
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.engine.runner import kv_cache as kv_cache_module
from rlix.inference.engine.runner import vmm
from rlix.inference.engine.runner.kv_cache import SlotKVCache
from rlix.models.presets import build_preset
from rlix.weights import BucketCache, InProcessEndpoint, ShardUpdater, WeightSync

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MiB = 1 << 20
PROBE = vmm._probe


class HostVirtualBuffer:
    """The VirtualBuffer contract over one host allocation: the address never changes, unmapping
    overwrites every byte (what reads unmapped memory, or memory mapped again without being
    refilled, sees garbage), remapping leaves other garbage."""

    GRANULE = 2 * MiB

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        self.nbytes = -(-nbytes // self.GRANULE) * self.GRANULE
        self._base = torch.empty(self.nbytes, dtype=torch.uint8)
        self.address = self._base.data_ptr()
        self.mapped, self.closed = True, False
        self.unmaps = self.remaps = 0

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        size = dtype.itemsize
        for n in shape:
            size *= n
        return self._base[:size].view(dtype).view(tuple(shape))

    def unmap(self) -> None:
        if self.mapped:
            self._base.fill_(0xFF)
            self.mapped = False
            self.unmaps += 1

    def remap(self) -> None:
        if not self.mapped:
            self._base.fill_(0x7F)
            self.mapped = True
            self.remaps += 1

    def close(self) -> None:
        self.unmap()
        self.closed = True


@pytest.fixture()
def host_vmm(monkeypatch):
    """KV caches and weight stores built from now on use HostVirtualBuffer."""
    monkeypatch.setattr(kv_cache_module, "VirtualBuffer", HostVirtualBuffer)
    monkeypatch.setattr(weights_module, "VirtualBuffer", HostVirtualBuffer)


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    return build_preset("small", tmp_path_factory.mktemp("models") / "small")


async def collect(engine: TorchEngine, prompt: list[int], tag: str) -> list[int]:
    last = None
    async for last in engine.generate(tag, prompt, GREEDY):
        pass
    assert last is not None and last.finished
    return list(last.token_ids)


async def reload(engine: TorchEngine, cache: BucketCache, version: int, updater: ShardUpdater) -> None:
    """After a level-2 sleep: wake the weights, sync them into the adopted layout, wake the KV cache."""
    await engine.wake_up(["weights"])
    report = await WeightSync(cache, {0: InProcessEndpoint(updater)}, "shm").sync(version, [0])
    assert not report.failed
    await engine.wake_up(["kv_cache"])


def param_pointers(engine: TorchEngine) -> list[int]:
    return [p.data_ptr() for p in engine._weights.params.values()]


# -- CPU ---------------------------------------------------------------------------------------

def test_not_available_on_cpu():
    assert not vmm.available("cpu")
    assert not vmm.available(torch.device("cpu"))
    assert vmm.mapped_bytes("cpu") == 0
    if not torch.cuda.is_available():
        assert not vmm.available("cuda")


def test_a_cpu_engine_uses_no_virtual_memory(engine):
    runner = engine._core.runner
    assert not runner.virtual and not runner.cache.virtual and not engine._weights.virtual
    assert engine.sleep_report()["virtual_memory"] is False


def test_virtual_memory_asked_for_where_it_cannot_be_is_refused(tiny_model_dir):
    with pytest.raises(ConfigError, match="virtual memory"):
        TorchEngine.from_pretrained(tiny_model_dir, device="cpu", virtual_memory=True)


def test_a_virtual_kv_cache_frees_and_comes_back_zeroed_at_the_same_address(host_vmm):
    cache = SlotKVCache(num_layers=2, num_rows=4, num_kv_heads=2, head_dim=8, max_len=64,
                        dtype=torch.float32, device=torch.device("cpu"), initial_capacity=8,
                        virtual=True)
    cache.allocate()
    assert cache.capacity == 64  # always max_len: the addresses must not move on growth
    ptr, version = cache.kv.data_ptr(), cache.storage_version
    cache.kv.fill_(3.0)
    assert cache.mapped_bytes() >= cache.nbytes() > 0
    cache.free()
    assert cache.kv is None and cache.nbytes() == 0 and cache.mapped_bytes() == 0
    assert not cache.allocated
    cache.allocate()
    assert cache.kv.data_ptr() == ptr and cache.storage_version == version
    assert torch.count_nonzero(cache.kv) == 0
    assert cache.keys[1].data_ptr() == cache.kv[1, 0].data_ptr()


def test_level2_reloads_into_a_virtual_store_keep_every_address(host_vmm, small_model_dir, prompt):
    """The bookkeeping of issue 35's wake on the host: once a reload landed in a virtual store, a
    level-2 sleep parks the parameters and unmaps (poisons) the store, and the next reload
    brings every parameter back to the same address with `storage_version` unchanged (what the
    CUDA graphs' validity is keyed on) and the same output; a reload that lands elsewhere (the
    per-tensor path) moves them and says so."""
    engine = TorchEngine.from_pretrained(small_model_dir, device="cpu", max_num_seqs=4, max_model_len=128)
    weights, runner = engine._weights, engine._core.runner
    weights.virtual = True  # as the model runner sets it where the driver supports VMM
    # as with CUDA graphs over a virtual KV cache: a sleep keeps what was built over the store
    # (here the fused decoder's layers, which generation then reads without fusing again)
    runner.graphs_survive_sleep = lambda: weights.keeps_addresses()
    sd = load_file(str(small_model_dir / "model.safetensors"))
    updater = ShardUpdater(engine)

    async def main() -> None:
        base = await collect(engine, prompt(9), "base")
        with BucketCache.for_model(sd, bucket_bytes=1 * MiB) as cache:
            cache.build_latest(1, sd)
            await engine.sleep(2)  # loaded from disk: the old path (nothing virtual yet)
            await reload(engine, cache, 1, updater)
            store = weights.store
            assert store is not None and store.virtual and weights.in_virtual_store()
            assert await collect(engine, prompt(9), "first") == base
            assert weights.in_virtual_store()  # the fused q/k/v and gate/up are views of it too
            pointers, version = param_pointers(engine), weights.storage_version
            layers = runner.fused.layers

            for round_ in (2, 3):
                await engine.sleep(2)
                assert engine.sleep_report()["graphs_kept"]
                assert weights.keeps_addresses() and not store.allocated
                assert store._buffer.unmaps >= 1 and weights.mapped_bytes() == 0
                assert all(p.numel() == 0 for p in engine.model.parameters())
                assert engine.sleep_report()["vmm_mapped_bytes"] == 0
                cache.build_latest(round_, sd)
                await reload(engine, cache, round_, updater)
                assert weights.store is store and param_pointers(engine) == pointers
                assert weights.storage_version == version
                assert await collect(engine, prompt(9), f"r{round_}") == base
                assert runner.fused.layers is layers  # not fused again: the same views serve

            # the per-tensor path lands elsewhere: the storage moved, and it is said
            await engine.sleep(2)
            await engine.wake_up()
            await engine.start_weight_update(9)
            await engine.update_weights(load_file(str(small_model_dir / "model.safetensors")))
            assert await engine.finish_weight_update() == 9
            assert weights.storage_version != version and not weights.keeps_addresses()
            assert await collect(engine, prompt(9), "moved") == base

    try:
        asyncio.run(main())
    finally:
        engine.close()


def test_driver_structures_have_cudas_layout():
    """CUmemAllocationProp and CUmemAccessDesc as cuda.h lays them out on 64-bit Linux."""
    prop, access = vmm._AllocationProp, vmm._AccessDesc
    assert ctypes.sizeof(prop) == 32 and ctypes.sizeof(access) == 12
    assert (prop.type.offset, prop.requestedHandleTypes.offset, prop.location.offset,
            prop.win32HandleMetaData.offset, prop.allocFlags.offset) == (0, 4, 8, 16, 24)
    assert ctypes.sizeof(vmm._AllocFlags) == 8 and vmm._AllocFlags.usage.offset == 2
    assert (access.location.offset, access.flags.offset) == (0, 8)
    assert ctypes.sizeof(vmm._CUdeviceptr) == ctypes.sizeof(vmm._CUhandle) == 8


class FakeLibcuda:
    """libcuda.so.1's virtual memory calls as a host-side ledger: what is reserved, created and
    mapped where, which context is current; `fail` makes one call return an error code."""

    GRANULE = 2 * MiB
    PRIMARY = 0x5000

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.reserved: dict[int, int] = {}
        self.created: dict[int, int] = {}
        self.mapped: dict[int, int] = {}  # address -> handle
        self.current: int | None = None
        self.fail: tuple[str, int] | None = None
        self._va, self._handle = 1 << 40, 1

    def __getattr__(self, name: str):  # a function object, as ctypes' are (argtypes can be set)
        return functools.partial(self._call, name)

    def _call(self, name: str, *args):
        self.calls.append(name)
        if self.fail is not None and self.fail[0] == name:
            return self.fail[1]
        return getattr(self, "do_" + name)(*args)

    @staticmethod
    def value(arg) -> int:
        return int(getattr(arg, "value", arg) or 0)

    def do_cuInit(self, flags):
        return 0

    def do_cuGetErrorName(self, code, out):
        out._obj.value = {2: b"CUDA_ERROR_OUT_OF_MEMORY"}.get(code, b"CUDA_ERROR_UNKNOWN")
        return 0

    def do_cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return 0

    def do_cuDeviceGetAttribute(self, out, attribute, device):
        out._obj.value = int(attribute == vmm.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
        return 0

    def do_cuDevicePrimaryCtxRetain(self, out, device):
        out._obj.value = self.PRIMARY
        return 0

    def do_cuCtxGetCurrent(self, out):
        out._obj.value = self.current
        return 0

    def do_cuCtxSetCurrent(self, ctx):
        self.current = ctx.value
        return 0

    def check_prop(self, prop) -> None:
        assert (prop.type, prop.requestedHandleTypes) == (vmm.CU_MEM_ALLOCATION_TYPE_PINNED, 0)
        assert (prop.location.type, prop.location.id) == (vmm.CU_MEM_LOCATION_TYPE_DEVICE, 0)
        assert self.current == self.PRIMARY  # every call runs in torch's primary context

    def do_cuMemGetAllocationGranularity(self, out, prop, option):
        self.check_prop(prop._obj)
        out._obj.value = self.GRANULE
        return 0

    def do_cuMemAddressReserve(self, out, size, alignment, addr, flags):
        assert size % self.GRANULE == 0 and alignment == self.GRANULE
        out._obj.value = self._va
        self.reserved[self._va] = size
        self._va += size
        return 0

    def do_cuMemCreate(self, out, size, prop, flags):
        self.check_prop(prop._obj)
        out._obj.value = self._handle
        self.created[self._handle] = size
        self._handle += 1
        return 0

    def do_cuMemMap(self, address, size, offset, handle, flags):
        assert self.reserved[address] == size == self.created[self.value(handle)] and offset == 0
        assert address not in self.mapped
        self.mapped[address] = self.value(handle)
        return 0

    def do_cuMemSetAccess(self, address, size, desc, count):
        assert address in self.mapped and count == 1
        access = desc._obj
        assert (access.location.type, access.location.id, access.flags) == (1, 0, 3)
        return 0

    def do_cuMemUnmap(self, address, size):
        assert self.mapped.pop(address) and self.reserved[address] == size
        return 0

    def do_cuMemRelease(self, handle):
        del self.created[self.value(handle)]
        return 0

    def do_cuMemAddressFree(self, address, size):
        assert address not in self.mapped and self.reserved.pop(address) == size
        return 0


@pytest.fixture()
def fake_driver(monkeypatch):
    """vmm over FakeLibcuda, with torch's CUDA calls stubbed (this build may have no CUDA)."""
    lib = FakeLibcuda()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    monkeypatch.setattr(vmm, "_driver_instance", None)
    monkeypatch.setattr(vmm, "_available", {})
    monkeypatch.setattr(vmm, "_mapped", {})
    monkeypatch.setattr(vmm, "_orphans", [])
    monkeypatch.setattr(vmm, "_probe", lambda ordinal: None)  # it views memory through torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: lib.calls.append("synchronize"))
    return lib


def test_the_driver_calls_reserve_map_unmap_and_free_in_order(fake_driver):
    lib = fake_driver
    assert vmm.available("cuda:0")
    lib.current = 0x9999  # another context is current on this thread: used, then restored
    buffer = vmm.VirtualBuffer(3 * MiB + 1, "cuda")
    assert lib.current == 0x9999
    assert buffer.nbytes == 4 * MiB and buffer.mapped and buffer.address in lib.mapped
    assert vmm.mapped_bytes("cuda") == 4 * MiB
    address, first = buffer.address, lib.mapped[buffer.address]
    lib.calls.clear()
    buffer.unmap()
    assert lib.calls[0] == "synchronize"  # queued work may still use the memory
    assert [c for c in lib.calls if c.startswith("cuMem")] == ["cuMemUnmap", "cuMemRelease"]
    assert not buffer.mapped and not lib.mapped and not lib.created and vmm.mapped_bytes("cuda") == 0
    buffer.unmap()  # no-op
    buffer.remap()
    assert buffer.address == address and lib.mapped[address] != first
    lib.calls.clear()
    buffer.close()
    assert [c for c in lib.calls if c.startswith("cuMem")] == ["cuMemUnmap", "cuMemRelease", "cuMemAddressFree"]
    assert not lib.reserved and not lib.created and buffer.closed
    with pytest.raises(vmm.VirtualMemoryError, match="closed"):
        buffer.remap()


def test_a_failed_driver_call_is_a_typed_error_and_leaves_nothing_behind(fake_driver):
    lib = fake_driver
    lib.fail = ("cuMemCreate", 2)
    with pytest.raises(vmm.VirtualMemoryError, match="cuMemCreate failed: CUresult 2 "
                                                     r"\(CUDA_ERROR_OUT_OF_MEMORY\)") as caught:
        vmm.VirtualBuffer(MiB, "cuda")
    assert isinstance(caught.value, GpuMemoryError)
    assert (caught.value.call, caught.value.code) == ("cuMemCreate", 2)
    assert not lib.reserved and not lib.created and not lib.mapped
    lib.fail = ("cuMemSetAccess", 1)
    with pytest.raises(vmm.VirtualMemoryError, match="cuMemSetAccess"):
        vmm.VirtualBuffer(MiB, "cuda")
    assert not lib.reserved and not lib.created and not lib.mapped
    lib.fail = None
    buffer = vmm.VirtualBuffer(MiB, "cuda")
    buffer.unmap()
    lib.fail = ("cuMemMap", 1)
    with pytest.raises(vmm.VirtualMemoryError, match="cuMemMap"):
        buffer.remap()
    assert not buffer.mapped and not lib.created and vmm.mapped_bytes("cuda") == 0
    lib.fail = None
    buffer.close()
    assert not lib.reserved


def test_a_buffer_dropped_during_a_capture_is_released_after_it(fake_driver):
    """Its release waits for the device, which a CUDA graph capture forbids."""
    lib = fake_driver
    buffer = vmm.VirtualBuffer(MiB, "cuda")
    with vmm.capturing():
        del buffer
        gc.collect()
        assert lib.reserved and lib.mapped and "synchronize" not in lib.calls
    assert not lib.reserved and not lib.mapped and not lib.created
    assert vmm.mapped_bytes("cuda") == 0 and not vmm._orphans
    dropped = vmm.VirtualBuffer(MiB, "cuda")
    del dropped  # no capture: released at once
    assert not lib.reserved


def test_not_available_where_torch_cannot_view_the_memory(fake_driver, monkeypatch):
    """The probe uses a buffer once through torch (here torch cannot: no CUDA in this build, or
    the fake's addresses); its failure keeps the engine on torch's allocator, leaking nothing."""
    monkeypatch.setattr(vmm, "_probe", PROBE)
    assert not vmm.available("cuda")
    assert not fake_driver.reserved and not fake_driver.created


def test_not_available_where_the_device_says_no(fake_driver, monkeypatch):
    monkeypatch.setattr(fake_driver, "do_cuDeviceGetAttribute",
                        lambda out, attribute, device: setattr(out._obj, "value", 0) or 0)
    assert not vmm.available("cuda")


# -- GPU ---------------------------------------------------------------------------------------

def device_free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.gpu
def test_gpu_unmap_frees_device_memory_and_remap_takes_it_back_at_the_same_address():
    assert vmm.available("cuda")
    size = 256 * MiB
    buffer = vmm.VirtualBuffer(size, "cuda")
    try:
        assert buffer.nbytes >= size and buffer.mapped
        t = buffer.tensor(torch.float32, (size // 4,))
        assert t.data_ptr() == buffer.address and t.is_cuda
        assert vmm.mapped_bytes("cuda") >= buffer.nbytes
        t.fill_(1.5)
        mapped = device_free()
        buffer.unmap()
        unmapped = device_free()
        assert unmapped - mapped >= size
        buffer.remap()
        assert unmapped - device_free() >= size
        assert t.data_ptr() == buffer.address
        t.fill_(2.5)
        assert bool((t == 2.5).all())
    finally:
        buffer.close()
    assert buffer.closed and not buffer.mapped


@pytest.mark.gpu
def test_gpu_tensors_are_views_of_the_buffer_and_survive_an_unmap_when_rewritten():
    buffer = vmm.VirtualBuffer(3 * MiB + 5, "cuda")
    try:
        assert buffer.nbytes % (2 * MiB) == 0 and buffer.nbytes >= 3 * MiB + 5
        pattern = torch.arange(buffer.nbytes // 4, device="cuda", dtype=torch.int32)
        a = buffer.tensor(torch.int32, (buffer.nbytes // 4,))
        b = buffer.tensor(torch.uint8, (buffer.nbytes,))
        a.copy_(pattern)
        assert torch.equal(b.view(torch.int32), pattern)  # the same memory, not a copy
        buffer.unmap()
        buffer.remap()
        a.copy_(pattern)
        assert torch.equal(a, pattern) and torch.equal(b.view(torch.int32), pattern)
    finally:
        buffer.close()


@pytest.mark.gpu
def test_gpu_buffer_lives_as_long_as_its_tensors():
    before = device_free()
    buffer = vmm.VirtualBuffer(128 * MiB, "cuda")
    t = buffer.tensor(torch.float16, (64 * MiB,))
    del buffer
    gc.collect()
    t.fill_(1.0)  # still mapped: the tensor holds the buffer
    assert float(t[-1]) == 1.0
    del t
    gc.collect()
    assert device_free() >= before - 2 * MiB


@pytest.mark.gpu
def test_gpu_a_captured_graph_replays_right_after_unmap_and_remap():
    """The point of it all: a graph holding addresses in the buffer stays valid when the memory
    under them is released and mapped again (contents refilled)."""
    buffer = vmm.VirtualBuffer(4 * MiB, "cuda")
    try:
        x = buffer.tensor(torch.float32, (1024,))
        w = buffer.tensor(torch.float32, (2048,))[1024:]
        x.copy_(torch.arange(1024, device="cuda", dtype=torch.float32))
        w.fill_(1.0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x * 2 + w
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x * 2 + w
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.arange(1024, device="cuda", dtype=torch.float32) * 2 + 1)
        buffer.unmap()
        buffer.remap()
        x.copy_(torch.arange(1024, device="cuda", dtype=torch.float32) * -1)
        w.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.arange(1024, device="cuda", dtype=torch.float32) * -2 + 3)
    finally:
        torch.cuda.synchronize()
        buffer.close()


def gpu_engine(path, **kwargs) -> TorchEngine:
    return TorchEngine.from_pretrained(path, device="cuda", max_num_seqs=8, max_model_len=512, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("level", [2, 1])
def test_gpu_sleep_and_wake_keep_the_graphs_once_weights_are_in_a_virtual_store(small_model_dir, prompt, level):
    """An engine whose weights came back through a reload into the sender's layout (a virtual
    store) sleeps (level 2: reload again; level 1: weights to host and back) and wakes: the free
    memory rises by the weights and KV cache bytes while it sleeps, nothing is captured again,
    and greedy output is what it was before the sleep."""
    engine = gpu_engine(small_model_dir)
    sd = load_file(str(small_model_dir / "model.safetensors"))
    updater = ShardUpdater(engine, device="cuda")

    async def main() -> None:
        assert engine.sleep_report()["virtual_memory"] is True
        base = await collect(engine, prompt(9), "base")
        with BucketCache.for_model(sd, bucket_bytes=4 * MiB) as cache:
            cache.build_latest(1, sd)
            await engine.sleep(2)  # weights from disk: the old path, graphs dropped
            assert not engine.sleep_report()["graphs_kept"]
            await reload(engine, cache, 1, updater)
            assert engine._weights.in_virtual_store()
            assert await collect(engine, prompt(9), "first") == base  # captures what it needs
            weights, kv = engine.weight_bytes(), engine.kv_cache_bytes()
            captures = engine.sleep_report()["graph_captures"]
            pointers, kv_ptr = param_pointers(engine), engine._core.runner.cache.kv.data_ptr()
            for round_ in (2, 3):
                awake = device_free()
                await engine.sleep(level)
                report = engine.sleep_report()
                assert device_free() - awake >= weights + kv, report
                assert engine.last_sleep_freed_bytes >= weights + kv
                assert report["graphs_kept"] and report["vmm_mapped_bytes"] == 0
                assert report["resident_bytes"] is not None
                if level == 2:
                    cache.build_latest(round_, sd)
                    await reload(engine, cache, round_, updater)
                else:
                    await engine.wake_up()
                assert param_pointers(engine) == pointers
                assert engine._core.runner.cache.kv.data_ptr() == kv_ptr
                assert await collect(engine, prompt(9), f"r{round_}") == base
                assert engine.sleep_report()["graph_captures"] == captures

    try:
        asyncio.run(main())
    finally:
        engine.close()


@pytest.mark.gpu
def test_gpu_a_reload_that_lands_elsewhere_recaptures_and_serves_the_same(small_model_dir, prompt):
    """Keeping the graphs is honest: a level-2 reload through the per-tensor path (not into the
    store) moves the parameters, so the graphs are captured again, and output is unchanged."""
    engine = gpu_engine(small_model_dir)
    sd = load_file(str(small_model_dir / "model.safetensors"))

    async def main() -> None:
        base = await collect(engine, prompt(9), "base")
        with BucketCache.for_model(sd, bucket_bytes=4 * MiB) as cache:
            cache.build_latest(1, sd)
            await engine.sleep(2)
            await reload(engine, cache, 1, ShardUpdater(engine, device="cuda"))
        assert await collect(engine, prompt(9), "store") == base
        captures = engine.sleep_report()["graph_captures"]
        await engine.sleep(2)
        assert engine.sleep_report()["graphs_kept"]
        await engine.wake_up()
        await engine.start_weight_update(2)
        await engine.update_weights(load_file(str(small_model_dir / "model.safetensors")))
        assert await engine.finish_weight_update() == 2
        assert await collect(engine, prompt(9), "moved") == base
        assert engine.sleep_report()["graph_captures"] > captures

    try:
        asyncio.run(main())
    finally:
        engine.close()


@pytest.mark.gpu
def test_gpu_without_virtual_memory_the_old_path_recaptures(small_model_dir, prompt):
    """virtual_memory=False: today's behaviour exactly (graphs dropped by every sleep)."""
    engine = gpu_engine(small_model_dir, virtual_memory=False)

    async def main() -> None:
        base = await collect(engine, prompt(9), "base")
        captures = engine.sleep_report()["graph_captures"]
        await engine.sleep(1)
        assert not engine.sleep_report()["graphs_kept"]
        await engine.wake_up()
        assert await collect(engine, prompt(9), "after") == base
        assert engine.sleep_report()["graph_captures"] > captures

    try:
        assert not engine._core.runner.virtual
        asyncio.run(main())
    finally:
        engine.close()
