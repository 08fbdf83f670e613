"""Bucket layout and packing: the model's named tensors, in order, in aligned uint8 buckets.

The layout is computed once per model shape (names, dtypes, shapes never change between
training steps), sent once, and cached on both ends; each update then moves whole buckets and
says only (version, bucket index). That keeps per-update metadata and per-transfer handles
independent of the number of tensors: the costs that dominate refits of many-tensor models.
The decoding half lives in wire.py, which must stay free of rlix imports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from rlix.errors import WeightUpdateError
from rlix.weights.wire import (DTYPE_CODES, BucketAssembler, Layout, ReceiveError, TensorEntry,
                             bucket_checksum)

DEFAULT_BUCKET_BYTES = 256 << 20
CPU_BUCKET_BYTES = 64 << 20  # copies at a few GB/s: smaller buckets pipeline better there
DEFAULT_ALIGNMENT = 256

TensorSpec = tuple[str, Sequence[int], torch.dtype]


def default_bucket_bytes(device: str | torch.device) -> int:
    """A sync bucket's size where the trainer's weights live: on CUDA a bucket's fixed cost
    (its message, checks and copy launch, ~80 us) would outweigh moving 64 MiB (~20 us at
    device bandwidth)."""
    return DEFAULT_BUCKET_BYTES if torch.device(device).type == "cuda" else CPU_BUCKET_BYTES


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def named_weights(source: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to sync, by name: a module's parameters (tied ones once, under their first
    name, as the engine knows them) or a state dict with storage-sharing aliases dropped."""
    if isinstance(source, torch.nn.Module):
        return {name: p.detach() for name, p in source.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    for name, t in source.items():
        if not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"{name}: expected a tensor, got {type(t).__name__}")
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) if t.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        out[name] = t.detach()
    return out


#: projections engines fuse into one matmul (vLLM's qkv_proj and gate_up_proj; rlix's fused
#: decoder), in the order they are concatenated
FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fusion_order(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors, reordered so that the weights (then the biases) of projections an engine
    fuses are adjacent, in their fusing order, where the first of them was. In a layout planned
    from this order, a receiver that keeps its parameters in the bucket layout (one flat buffer)
    takes each fused matrix as a view of it instead of a concatenated copy."""
    def group_of(name: str) -> tuple[tuple[str, int, str], int] | None:
        """((parent module, group, weight or bias), position in the group), if fusable."""
        head, _, attr = name.rpartition(".")
        parent, _, module = head.rpartition(".")
        for g, members in enumerate(FUSED_GROUPS):
            if module in members:
                return (parent, g, attr), members.index(module)
        return None

    groups: dict[tuple[str, int, str], dict[int, str]] = {}
    for name in tensors:
        found = group_of(name)
        if found is not None:
            groups.setdefault(found[0], {})[found[1]] = name
    out: dict[str, torch.Tensor] = {}
    for name in tensors:
        if name in out:
            continue
        found = group_of(name)
        members = groups[found[0]] if found is not None else {}
        if found is not None and len(members) == len(FUSED_GROUPS[found[0][1]]):
            for position in sorted(members):  # a complete group: all of it, here
                out[members[position]] = tensors[members[position]]
        else:
            out[name] = tensors[name]
    return out


def tensor_checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Per-tensor checksums of the raw bytes, computed where the tensors are (a shard's GPU
    parameters, a trainer's weights): the audit that a shard serves exactly what was sent."""
    return {n: bucket_checksum(t.detach().contiguous().reshape(-1).view(torch.uint8))
            for n, t in tensors.items()}


def plan_layout(tensors: Mapping[str, torch.Tensor] | Iterable[TensorSpec],
                bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                alignment: int = DEFAULT_ALIGNMENT) -> Layout:
    """Place tensors in order: each at the next aligned offset of the current bucket; one that
    does not fit starts a new bucket, and one larger than a bucket fills the rest of the current
    bucket and continues in the next ones (split)."""
    specs = ([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
             if isinstance(tensors, Mapping) else [(n, tuple(s), d) for n, s, d in tensors])
    if alignment < 8 or alignment & (alignment - 1):
        raise WeightUpdateError(f"alignment must be a power of two >= 8, got {alignment}")
    cap = bucket_bytes // alignment * alignment
    if cap <= 0:
        raise WeightUpdateError(f"bucket size {bucket_bytes} is smaller than the alignment {alignment}")
    entries: list[TensorEntry] = []
    sizes: list[int] = []
    bucket, used = 0, 0
    for name, shape, dtype in specs:
        if dtype not in DTYPE_CODES:
            raise WeightUpdateError(f"{name}: dtype {dtype} cannot be synced")
        entry = TensorEntry(name, dtype, tuple(int(d) for d in shape), 0, 0)
        n = entry.nbytes
        offset = _align(used, alignment)
        if n and offset + n > cap and (n <= cap or offset >= cap):
            sizes.append(_align(used, alignment))  # close this bucket, start the next one
            bucket, offset = bucket + 1, 0
        entries.append(TensorEntry(entry.name, dtype, entry.shape, bucket, offset))
        if offset + n <= cap:
            used = offset + n
            continue
        spill = n - (cap - offset)  # split: fill this bucket, whole buckets, then a tail
        sizes.append(cap)
        while spill > cap:
            sizes.append(cap)
            spill -= cap
        bucket, used = len(sizes), spill
    if used or not sizes and entries:
        sizes.append(max(_align(used, alignment), alignment))
    try:
        return Layout(entries, sizes, cap, alignment)
    except ReceiveError as exc:  # a planning bug, never a user error
        raise WeightUpdateError(f"internal: planned an invalid layout: {exc}") from None


def bucket_views(layout: Layout, flat: torch.Tensor) -> list[torch.Tensor]:
    """Split one flat uint8 host buffer (all buckets end to end) into per-bucket views."""
    if flat.dtype != torch.uint8 or flat.numel() < layout.total_bytes:
        raise WeightUpdateError(f"buffer of {flat.numel()} bytes is too small for layout "
                                f"{layout.layout_id} ({layout.total_bytes} bytes)")
    return [flat[o: o + s] for o, s in zip(layout.bucket_offsets(), layout.bucket_sizes)]


def pack(layout: Layout, tensors: Mapping[str, torch.Tensor],
         buckets: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Copy `tensors` into their buckets (allocated here unless given) and return the buckets.

    Every tensor of the layout must be given with its layout shape and dtype. Copies from a GPU
    into pinned buckets are issued asynchronously and waited for once at the end.
    """
    if buckets is None:
        buckets = [torch.zeros(s, dtype=torch.uint8) for s in layout.bucket_sizes]
    if len(buckets) != layout.num_buckets:
        raise WeightUpdateError(f"{len(buckets)} buckets given, layout has {layout.num_buckets}")
    missing = [e.name for e in layout.entries if e.name not in tensors]
    extra = [n for n in tensors if n not in layout.index]
    if missing or extra:
        raise WeightUpdateError(f"tensors do not match layout {layout.layout_id}: missing "
                                f"{missing[:5]}, unexpected {extra[:5]}")
    cuda_used = False
    for entry in layout.entries:
        src = tensors[entry.name]
        if tuple(src.shape) != entry.shape or src.dtype != entry.dtype:
            raise WeightUpdateError(f"{entry.name}: {src.dtype} {tuple(src.shape)} does not match the "
                                    f"layout's {entry.dtype} {entry.shape}")
        if entry.nbytes == 0:
            continue
        cuda_used |= src.is_cuda
        _scatter(layout, buckets, entry, src)
    if cuda_used:
        torch.cuda.synchronize()
    return list(buckets)


def _scatter(layout: Layout, buckets: Sequence[torch.Tensor], entry: TensorEntry,
             src: torch.Tensor) -> None:
    if layout.num_parts[layout.index[entry.name]] == 1:
        dst = buckets[entry.bucket][entry.offset: entry.offset + entry.nbytes]
        dst.view(entry.dtype).view(entry.shape).copy_(src, non_blocking=True)
        return
    _scatter_bytes(layout, buckets, entry, src.contiguous().reshape(-1).view(torch.uint8), 0)


def _scatter_bytes(layout: Layout, buckets: Sequence[torch.Tensor], entry: TensorEntry,
                   data: torch.Tensor, start: int) -> None:
    """Bytes [start, start + len(data)) of `entry`'s tensor into its buckets, across the
    bucket boundaries it spans."""
    bucket, offset, skip = entry.bucket, entry.offset, start
    while skip >= layout.bucket_sizes[bucket] - offset:  # the bucket where byte `start` lies
        skip -= layout.bucket_sizes[bucket] - offset
        bucket, offset = bucket + 1, 0
    offset += skip
    done, remaining = 0, data.numel()
    while remaining:
        take = min(remaining, layout.bucket_sizes[bucket] - offset)
        buckets[bucket][offset: offset + take].copy_(data[done: done + take], non_blocking=True)
        done, remaining, bucket, offset = done + take, remaining - take, bucket + 1, 0


def pack_rows(layout: Layout, buckets: Sequence[torch.Tensor], name: str, rows: torch.Tensor,
              first_row: int) -> None:
    """Rows [first_row, first_row + len(rows)) of tensor `name` (its first dimension) into the
    buckets, leaving its other rows alone: how the ranks of a sharded trainer each write their
    shard of a tensor (a dim-0 shard is one contiguous byte range of the full tensor). `rows`
    must have the layout's dtype; copies from a GPU are waited for here."""
    entry = layout.entries[layout.index[name]]
    if rows.dtype != entry.dtype or tuple(rows.shape[1:]) != entry.shape[1:] \
            or not 0 <= first_row <= first_row + rows.shape[0] <= (entry.shape[0] if entry.shape else 1):
        raise WeightUpdateError(f"{name}: rows {first_row}..{first_row + rows.shape[0]} of {rows.dtype} "
                                f"{tuple(rows.shape[1:])} do not fit the layout's {entry.dtype} {entry.shape}")
    if rows.numel() == 0:
        return
    row_bytes = entry.nbytes // entry.shape[0]
    _scatter_bytes(layout, buckets, entry, rows.contiguous().reshape(-1).view(torch.uint8),
                   first_row * row_bytes)
    if rows.is_cuda:
        torch.cuda.synchronize(rows.device)


def unpack(layout: Layout, buckets: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of the layout from a full set of buckets: views where a tensor lies in one
    bucket, reassembled copies for split tensors."""
    assembler = BucketAssembler(layout)
    out: dict[str, torch.Tensor] = {}
    for index, bucket in enumerate(buckets):
        out.update(assembler.feed(index, bucket))
    if assembler.pending() or len(out) != len(layout.entries):
        raise WeightUpdateError(f"buckets incomplete: {assembler.pending()[:5]} never finished")
    return out
