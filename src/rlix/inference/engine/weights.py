"""The served parameters: where they live while asleep, and how an update replaces them.

Update rule (start -> update... -> finish): every incoming tensor is checked against the served
parameter of that name (known name, same shape, same dtype) and copied into a staging tensor on
the serving device; nothing served changes. On finish the update must cover *every* parameter
(tied aliases such as lm_head.weight / model.embed_tokens.weight count once), unless it was
started with allow_partial=True, which lets it cover any subset, except right after a level-2
sleep where there is nothing to fall back on. The staged tensors are then copied over the
served ones between two engine steps (already validated, so the copy cannot fail half-way);
after a level-2 sleep they simply become the parameters. Any refusal discards the staging and
leaves the old weights serving.

On CUDA the host->device copies are issued without waiting (page-locked sources, such as the
weight cache's shared memory as a shard maps it, then copy at full bandwidth while the next
bucket is being taken apart) and waited for once, when the update is judged at finish: the
bytes handed in must therefore stay unchanged until finish or abort (rlix's senders lease the
cache slot for the whole sync). A reload after a level-2 sleep stages each batch (a bucket)
into one allocation, not one per tensor (after a level-2 sleep every allocation is a fresh
cudaMalloc, and the staged tensors become the parameters); tensors that are views of one
source buffer come over in one copy of the span they cover.

Where the sender's bucket layout covers exactly the served parameters (`ServedWeights.adopt`),
a reload lands instead: the parameters' storage becomes a `WeightStore`, one flat buffer with
the layout's buckets end to end, and each arriving bucket is one copy into it (no per-tensor
work); every parameter is a view of it, and projections laid out adjacent (buckets.fusion_order)
fuse as views too. In-place updates of loaded weights take the per-tensor path above.

On CUDA with virtual memory management (`virtual`, runner/vmm.py) the store's buffer keeps its
device addresses for its whole life: a level-2 sleep unmaps it (the memory goes back to the
driver) and the reload after the wake maps new memory at the same addresses and lands there; a
level-1 sleep copies it to pinned host memory before unmapping, and the wake copies it back.
While every parameter is a view of such a store, a sleep parks the parameters (they read as
empty tensors while asleep) and the wake or reload puts the same views back, so
`storage_version` does not move and the CUDA graphs captured over them stay valid. Weights
outside a store (loaded from disk, before any adopted reload) keep the per-tensor paths.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rlix.errors import WeightUpdateError
from rlix.inference.engine.runner.vmm import VirtualBuffer
from rlix.weights.wire import Layout

ALIGN = 256  # bytes: each parameter carved out of a shared staging buffer starts on this boundary
SEGMENT_GRANULE = 2 << 20  # bytes: CUDA's caching allocator rounds large segments to this


@dataclass(frozen=True)
class ParamSpec:
    name: str  # canonical name (the first alias transformers lists)
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def aligned_bytes(spec: ParamSpec) -> int:
    return -(-spec.numel * spec.dtype.itemsize // ALIGN) * ALIGN


def stage_reload(checked: list[tuple[ParamSpec, torch.Tensor]], device: torch.device) -> dict[str, torch.Tensor]:
    """A reload's batch (each spec with its incoming tensor) staged in ONE allocation on
    `device`, as one view per spec, each on an ALIGN boundary. Tensors that are contiguous views
    of one source buffer (a bucket: of the host cache, or of the trainer's device copy) come
    over in one copy of the span they cover and keep their relative offsets; the others (a
    tensor split over buckets, reassembled) are placed after them and copied one by one.
    Hundreds of small copies cost more than the bytes (a copy's launch outweighs a small
    tensor's transfer). The copies are issued without waiting."""
    groups: dict[int, list[tuple[ParamSpec, torch.Tensor]]] = {}
    single: list[tuple[ParamSpec, torch.Tensor]] = []
    for spec, tensor in checked:
        if tensor.is_contiguous() and tensor.numel():
            groups.setdefault(tensor.untyped_storage().data_ptr(), []).append((spec, tensor))
        else:
            single.append((spec, tensor))
    spans: list[tuple[int, int, list[tuple[ParamSpec, torch.Tensor]]]] = []  # (base, bytes, members)
    for members in groups.values():
        base = min(t.data_ptr() for _, t in members)
        # the span keeps offsets relative to its first tensor: they must be aligned (a bucket's are)
        aligned = [(s, t) for s, t in members if (t.data_ptr() - base) % ALIGN == 0]
        single.extend((s, t) for s, t in members if (t.data_ptr() - base) % ALIGN)
        if len(aligned) < 2:
            single.extend(aligned)
            continue
        end = max(t.data_ptr() + t.numel() * t.element_size() for _, t in aligned)
        spans.append((base, end - base, aligned))
    offsets, total = [], 0
    for _, size, _ in spans:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    placed = []
    for spec, _ in single:
        placed.append(total)
        total += aligned_bytes(spec)
    flat = torch.empty(total, dtype=torch.uint8, device=device)

    def view(at: int, spec: ParamSpec) -> torch.Tensor:
        return flat[at: at + spec.numel * spec.dtype.itemsize].view(spec.dtype).view(spec.shape)

    out: dict[str, torch.Tensor] = {}
    for (base, size, members), at in zip(spans, offsets):
        storage = members[0][1].untyped_storage()
        source = torch.empty(0, dtype=torch.uint8, device=members[0][1].device).set_(
            storage, base - storage.data_ptr(), (size,))
        flat[at: at + size].copy_(source, non_blocking=True)
        for spec, tensor in members:
            out[spec.name] = view(at + tensor.data_ptr() - base, spec)
    for (spec, tensor), at in zip(single, placed):
        out[spec.name] = view(at, spec)
        out[spec.name].copy_(tensor.detach(), non_blocking=True)
    return out


class WeightStore:
    """Parameter storage in a sender's bucket layout: one flat buffer, the buckets end to end, so
    bucket i is one slice of it and every tensor (a split one too) one contiguous view. The views
    are made once; freeing resizes the storage to nothing, and allocating again re-points every
    view at the new memory (nothing that still holds one keeps the bytes alive). A `virtual`
    store's buffer is a VirtualBuffer: freeing unmaps it and allocating maps new memory at the
    same addresses, so the views (and what captured them) stay where they are."""

    def __init__(self, layout: Layout, device: torch.device, virtual: bool = False) -> None:
        self.layout = layout
        # whole 2 MiB pages (the CUDA caching allocator's segment granule): no tail of its
        # segment is left for another allocation, which would keep the segment from being
        # returned to the driver when the store is freed
        self.nbytes = -(-layout.total_bytes // SEGMENT_GRANULE) * SEGMENT_GRANULE
        self.virtual = virtual
        self._buffer = VirtualBuffer(self.nbytes, device) if virtual else None
        self.flat = (self._buffer.tensor(torch.uint8, (self.nbytes,)) if self._buffer is not None
                     else torch.empty(self.nbytes, dtype=torch.uint8, device=device))
        self._host: torch.Tensor | None = None  # a virtual store's pinned copy (level-1 sleep)
        offsets = layout.bucket_offsets()
        self.buckets = [self.flat[o: o + n] for o, n in zip(offsets, layout.bucket_sizes)]
        self.views: dict[str, torch.Tensor] = {}
        for e in layout.entries:
            start = offsets[e.bucket] + e.offset
            self.views[e.name] = (self.flat[start: start + e.nbytes].view(e.dtype).view(e.shape)
                                  if e.nbytes else torch.empty(e.shape, dtype=e.dtype, device=device))
        #: per bucket, the tensors it completes (their last byte lies in it), as views
        self.completes: list[dict[str, torch.Tensor]] = [{} for _ in layout.bucket_sizes]
        for parts in layout.parts_by_bucket:
            for part in parts:
                entry = layout.entries[part.entry]
                if part.start + part.nbytes == entry.nbytes:
                    self.completes[part.bucket][entry.name] = self.views[entry.name]
        self._completes_ids = {id(m) for m in self.completes}

    @property
    def allocated(self) -> bool:
        if self._buffer is not None:
            return self._buffer.mapped
        return self.flat.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        """Memory for the store again (its contents undefined: a reload lands in it)."""
        if self._buffer is not None:
            self._buffer.remap()
        elif not self.allocated:
            self.flat.untyped_storage().resize_(self.nbytes)

    def free(self) -> None:
        if self._buffer is not None:
            self._buffer.unmap()
        else:
            self.flat.untyped_storage().resize_(0)

    def close(self) -> None:
        """Free the store for good (a virtual one gives its addresses back too): nothing may
        use its views after."""
        self.free()
        self._host = None
        if self._buffer is not None:
            self._buffer.close()

    def offload(self) -> None:
        """A virtual store to (reused) pinned host memory, then unmapped."""
        assert self._buffer is not None and self.allocated
        if self._host is None:
            self._host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        self._host.copy_(self.flat, non_blocking=True)
        self._buffer.unmap()  # waits for the device: the copy has landed

    def restore(self) -> None:
        """Map a virtual store's memory again at the same addresses and copy the host copy back."""
        assert self._buffer is not None and self._host is not None
        self._buffer.remap()
        self.flat.copy_(self._host, non_blocking=True)
        torch.cuda.synchronize(self.flat.device)

    def drop_host_copy(self) -> None:
        self._host = None

    def mapped_bytes(self) -> int:
        """Device memory mapped into a virtual store now (0 otherwise, or while it sleeps)."""
        return self._buffer.nbytes if self._buffer is not None and self._buffer.mapped else 0

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is a view of this store's (allocated) memory."""
        return self.allocated and tensor.untyped_storage().data_ptr() == self.flat.untyped_storage().data_ptr()

    def is_completion(self, named: Mapping[str, torch.Tensor]) -> bool:
        """Whether `named` is one of this store's own per-bucket mappings (landed in place)."""
        return id(named) in self._completes_ids


class ServedWeights:
    """The model's unique parameters, by canonical name, with their aliases and sleep states.

    `virtual`: reload stores are VirtualBuffers (module docstring), whose addresses a sleep
    keeps; only on CUDA devices that support it (the model runner decides)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, virtual: bool = False) -> None:
        self.device = device
        self.virtual = virtual
        self.params: dict[str, torch.nn.Parameter] = {}
        self.alias_of: dict[str, str] = {}
        by_identity: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            canonical = by_identity.setdefault(id(param), name)
            self.alias_of[name] = canonical
            self.params.setdefault(canonical, param)
        self.specs = {n: ParamSpec(n, tuple(p.shape), p.dtype) for n, p in self.params.items()}
        self.loaded = True  # False after a level-2 sleep until a full update arrives
        self.on_device = True
        self.storage_version = 0  # bumped whenever parameter storage moves (CUDA graphs)
        self.values_version = 0  # bumped whenever parameter values change (prepacked copies)
        self._host_backup: dict[str, torch.Tensor] = {}
        self.adopted: Layout | None = None  # a sender's layout reloads land in (adopt)
        self.store: WeightStore | None = None
        #: while a virtual store sleeps: each parameter's view of it, put back by the wake
        #: (level 1) or compared with what a reload brings (level 2)
        self._parked: dict[str, torch.Tensor] | None = None

    def adopt(self, layout: Layout) -> bool:
        """Let reloads land in `layout` if it sends every served parameter exactly once, with
        its shape and dtype (aliases by any of their names); False leaves the per-tensor path."""
        seen: set[str] = set()
        for e in layout.entries:
            canonical = self.alias_of.get(e.name)
            spec = self.specs.get(canonical) if canonical is not None else None
            if spec is None or spec.shape != e.shape or spec.dtype != e.dtype or canonical in seen:
                return False
            seen.add(canonical)
        if len(seen) != len(self.specs):
            return False
        self.adopted = layout
        return True

    def reload_store(self) -> WeightStore:
        """The store a reload lands in, allocated, in the adopted layout (only while unloaded:
        no parameter is a view of an old store then)."""
        assert self.adopted is not None and not self.loaded
        if self.store is None or self.store.layout.layout_id != self.adopted.layout_id:
            if self.store is not None:
                self.store.close()
            self.store = WeightStore(self.adopted, self.device, virtual=self.virtual)
        self.store.allocate()
        return self.store

    def _free_store(self) -> None:
        if self.store is not None:
            self.store.free()

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def mapped_bytes(self) -> int:
        """Device memory mapped into the virtual weight store now (0 without one)."""
        return self.store.mapped_bytes() if self.store is not None else 0

    def in_virtual_store(self) -> bool:
        """Whether every parameter is a view of a mapped virtual store (a sleep then keeps
        their addresses)."""
        store = self.store
        return (store is not None and store.virtual and store.allocated and self.loaded
                and self.on_device
                and all(p.numel() == 0 or store.holds(p.data) for p in self.params.values()))

    def keeps_addresses(self) -> bool:
        """Whether the parameters come back where they are now after a sleep: in a virtual
        store, or already parked by a sleep that kept them (the CUDA graphs may stay)."""
        return self._parked is not None or self.in_virtual_store()

    def _park(self) -> None:
        """Set each parameter's view of the virtual store aside; the parameters read as empty
        tensors until the views come back (nothing can touch unmapped memory through them)."""
        self._parked = {name: param.data for name, param in self.params.items()}
        for param in self.params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)

    def offload(self) -> None:
        """Sleep level 1: CUDA weights go to (reused, pinned) host buffers; CPU weights stay.
        A virtual store is copied out whole and unmapped, its addresses kept."""
        if self.device.type == "cuda" and self.loaded and self.in_virtual_store():
            assert self.store is not None
            self._park()
            self.store.offload()
        elif self.device.type == "cuda" and self.loaded:
            for name, param in self.params.items():
                backup = self._host_backup.get(name)
                if backup is None:
                    backup = torch.empty(param.shape, dtype=param.dtype, pin_memory=True)
                    self._host_backup[name] = backup
                backup.copy_(param.data, non_blocking=True)
            # One wait for all the copies instead of one per tensor; only then let go of the
            # device storage.
            torch.cuda.synchronize(self.device)
            for param in self.params.values():
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
            self._free_store()  # wake brings them back as tensors of their own
            self.storage_version += 1
        self.on_device = False

    def discard(self) -> None:
        """Sleep level 2: drop the weights (and any host backup); they must be reloaded. A
        virtual store is unmapped, its addresses kept for the reload to land in."""
        if self.keeps_addresses():
            assert self.store is not None
            if self._parked is None:
                self._park()
            self.store.free()
            self.store.drop_host_copy()
            self._host_backup.clear()
            self.loaded = False
            self.on_device = False
            return  # storage_version: the reload says whether the addresses moved (swap_in)
        for param in self.params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)
        self._free_store()
        self._host_backup.clear()
        self.loaded = False
        self.on_device = False
        self.storage_version += 1

    def wake(self) -> None:
        """Back on the device: from the host backup (level 1), or still unloaded (level 2)."""
        if self.loaded and self.device.type == "cuda" and self._parked is not None:
            assert self.store is not None
            self.store.restore()
            for name, param in self.params.items():
                param.data = self._parked[name]
            self._parked = None
        elif self.loaded and self.device.type == "cuda" and self._host_backup:
            for name, param in self.params.items():
                param.data = self._host_backup[name].to(self.device, non_blocking=True)
            torch.cuda.synchronize(self.device)
            self.storage_version += 1
        self.on_device = True

    def swap_in(self, staged: Mapping[str, torch.Tensor], complete: bool) -> None:
        """Loaded weights are overwritten in place (storage stays put, so CUDA graphs stay
        valid); after a level-2 sleep the staged tensors become the parameters, and the
        storage counts as moved unless every parameter is back at its parked address."""
        for name, tensor in staged.items():
            param = self.params[name]
            if self.loaded:
                param.data.copy_(tensor)
            else:
                param.data = tensor
        if not self.loaded:
            parked, self._parked = self._parked, None
            if parked is None or any(p.numel() and parked[n].data_ptr() != p.data.data_ptr()
                                     for n, p in self.params.items()):
                self.storage_version += 1
        self.values_version += 1
        if complete:
            self.loaded = True


class WeightStaging:
    """One update session: validated copies of the incoming tensors, invisible to generation."""

    def __init__(self, weights: ServedWeights, version: int, allow_partial: bool) -> None:
        self.weights = weights
        self.version = version
        # After a level-2 sleep there are no old weights to keep for the parameters not sent.
        self.allow_partial = allow_partial and weights.loaded
        self.staged: dict[str, torch.Tensor] = {}
        self._cuda = weights.device.type == "cuda"
        self._copies: list[torch.cuda.Event] = []  # one per add(): its copies issued so far
        self._store: WeightStore | None = None  # a reload landing in the store (bucket_target)
        self._landed: set[str] = set()  # names (the sender's) completed in the store

    def bucket_target(self, index: int) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]] | None:
        """Where bucket `index` goes when this is a reload into an adopted layout: the store's
        slice for it, and the tensors it completes there (to hand to take_landed once the bytes
        are copied in); None means send named tensors as usual."""
        if self.weights.loaded or self.weights.adopted is None:
            return None
        if self._store is None:
            self._store = self.weights.reload_store()
        return self._store.buckets[index], self._store.completes[index]

    def take_landed(self, named: Mapping[str, torch.Tensor]) -> bool:
        """Note the tensors of a bucket copied into the store; False if `named` is not one of
        the store's own mappings (then it must be staged with add())."""
        if self._store is None or not self._store.is_completion(named):
            return False
        self._landed.update(named)
        return True

    def abandon(self) -> None:
        """An aborted reload frees what it landed (nothing serves from it)."""
        if self._store is not None and not self.weights.loaded:
            self._store.free()

    def add(self, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Validate the whole batch first, then stage it; raise WeightUpdateError on any mismatch."""
        checked: list[tuple[ParamSpec, torch.Tensor]] = []
        for name, tensor in named_tensors.items():
            canonical = self.weights.alias_of.get(name)
            if canonical is None:
                raise WeightUpdateError(f"unknown parameter {name!r}")
            spec = self.weights.specs[canonical]
            if not isinstance(tensor, torch.Tensor):
                raise WeightUpdateError(f"{name}: expected a tensor, got {type(tensor).__name__}")
            if tuple(tensor.shape) != spec.shape:
                raise WeightUpdateError(
                    f"{name}: shape {tuple(tensor.shape)} does not match the served {spec.shape}")
            if tensor.dtype != spec.dtype:
                raise WeightUpdateError(
                    f"{name}: dtype {tensor.dtype} does not match the served {spec.dtype}")
            checked.append((spec, tensor))
        if not self._cuda:
            for spec, tensor in checked:
                staged = torch.empty(spec.shape, dtype=spec.dtype, device=self.weights.device)
                staged.copy_(tensor.detach())
                self.staged[spec.name] = staged
            return
        # A reload (level-2 sleep: these become the parameters) takes one allocation per batch;
        # an in-place update stages tensor by tensor, freed once copied over the served ones.
        if not self.weights.loaded:
            self.staged.update(stage_reload(checked, self.weights.device))
        else:
            for spec, tensor in checked:
                staged = torch.empty(spec.shape, dtype=spec.dtype, device=self.weights.device)
                staged.copy_(tensor.detach(), non_blocking=True)
                self.staged[spec.name] = staged
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.weights.device))
        self._copies.append(event)

    def wait_copies(self) -> None:
        """Block until every copy issued by add() has landed (one wait per update)."""
        for event in self._copies:
            event.synchronize()
        self._copies.clear()

    def missing(self) -> list[str]:
        return [n for n in self.weights.specs if n not in self.staged]

    def check_complete(self) -> bool:
        """True if the update covers every parameter; raises if it must and does not. Waits for
        the staging copies first: the staged tensors are served right after this."""
        self.wait_copies()
        if self._landed:
            if self._cuda:
                torch.cuda.synchronize(self.weights.device)  # the buckets' copies into the store
            for name in self._landed:
                self.staged[self.weights.alias_of[name]] = self._store.views[name]
        missing = self.missing()
        if missing and not self.allow_partial:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            why = (" (after a level-2 sleep every parameter must be sent)"
                   if not self.weights.loaded else "")
            raise WeightUpdateError(f"update incomplete: {len(missing)} parameters never arrived: "
                                    f"{shown}{why}")
        return not missing
