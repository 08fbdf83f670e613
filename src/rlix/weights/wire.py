"""The receiving side of a bucketed weight transfer, in torch and the standard library only.

This file is loaded unchanged inside a real vLLM server (as a worker extension) as well as by
rlix's embedded engine, so both backends decode the same buckets. It must never import rlix,
numpy or pydantic.

A layout is computed once by the sender and sent once (as compact JSON); every update then only
says (version, bucket index, size, optional checksum) per bucket. A tensor lives at an aligned
offset of one bucket; a tensor larger than what is left of a bucket continues at offset 0 of the
next buckets, so its parts follow from (bucket, offset, size) and the bucket sizes alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import secrets
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

FORMAT = 1
SHM_DIR = "/dev/shm"

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
for _code, _attr in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_code] = getattr(torch, _attr)
DTYPE_CODES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class ReceiveError(Exception):
    """A refused or failed receive. `kind` is one of: layout, version, checksum, transfer,
    incomplete; rlix maps it to its typed WeightUpdateError subclasses."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    bucket: int  # bucket holding the first byte
    offset: int  # byte offset of the first byte in that bucket

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Part:
    """One contiguous piece of a tensor inside one bucket."""

    entry: int  # index into Layout.entries
    bucket: int
    offset: int  # in the bucket
    start: int  # byte offset of this piece within the tensor
    nbytes: int


def _canonical(payload: dict) -> str:
    return json.dumps(payload, separators=(",", ":"), sort_keys=True)


class Layout:
    """Where every named tensor lives in the buckets; immutable, validated on construction."""

    def __init__(self, entries: Iterable[TensorEntry], bucket_sizes: Iterable[int],
                 bucket_bytes: int, alignment: int) -> None:
        self.entries = tuple(entries)
        self.bucket_sizes = tuple(int(s) for s in bucket_sizes)
        self.bucket_bytes = int(bucket_bytes)
        self.alignment = int(alignment)
        self._check_header()
        self.index = {e.name: i for i, e in enumerate(self.entries)}
        if len(self.index) != len(self.entries):
            raise ReceiveError("layout", "layout names a tensor twice")
        self.parts_by_bucket: list[list[Part]] = [[] for _ in self.bucket_sizes]
        self.num_parts: list[int] = []
        self._derive_parts()
        self.layout_id = hashlib.sha256(_canonical(self._payload()).encode()).hexdigest()[:16]

    @property
    def num_buckets(self) -> int:
        return len(self.bucket_sizes)

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    def bucket_offsets(self) -> list[int]:
        """Start of each bucket when all buckets are laid end to end in one host buffer."""
        out, pos = [], 0
        for size in self.bucket_sizes:
            out.append(pos)
            pos += size
        return out

    def is_split(self, i: int) -> bool:
        return self.num_parts[i] > 1

    def specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {e.name: (e.shape, e.dtype) for e in self.entries}

    def _check_header(self) -> None:
        a, cap = self.alignment, self.bucket_bytes
        if a <= 0 or a & (a - 1) or a < 8:
            raise ReceiveError("layout", f"alignment must be a power of two >= 8, got {a}")
        if cap <= 0 or cap % a:
            raise ReceiveError("layout", f"bucket size {cap} must be a positive multiple of {a}")
        for i, size in enumerate(self.bucket_sizes):
            if size <= 0 or size > cap or size % a:
                raise ReceiveError("layout", f"bucket {i} has size {size}: must be in (0, {cap}] "
                                             f"and a multiple of {a}")

    def _derive_parts(self) -> None:
        spans: list[tuple[int, int, int]] = []  # (bucket, start, end) of every part, to check overlap
        for i, e in enumerate(self.entries):
            if e.offset % self.alignment or e.offset < 0:
                raise ReceiveError("layout", f"{e.name}: offset {e.offset} is not aligned to {self.alignment}")
            if any(d < 0 for d in e.shape):
                raise ReceiveError("layout", f"{e.name}: negative dimension in {e.shape}")
            if not 0 <= e.bucket < self.num_buckets:
                raise ReceiveError("layout", f"{e.name}: bucket {e.bucket} out of range")
            remaining, bucket, offset, start, count = e.nbytes, e.bucket, e.offset, 0, 0
            while remaining > 0:
                if bucket >= self.num_buckets or offset >= self.bucket_sizes[bucket]:
                    raise ReceiveError("layout", f"{e.name}: runs past the end of the buckets")
                take = min(remaining, self.bucket_sizes[bucket] - offset)
                self.parts_by_bucket[bucket].append(Part(i, bucket, offset, start, take))
                spans.append((bucket, offset, offset + take))
                remaining -= take
                start += take
                bucket, offset, count = bucket + 1, 0, count + 1
            if e.nbytes == 0:  # empty tensors are emitted with the bucket they name
                self.parts_by_bucket[e.bucket].append(Part(i, e.bucket, e.offset, 0, 0))
                count = 1
            self.num_parts.append(count)
        spans.sort()
        for (b0, _, end0), (b1, start1, _) in zip(spans, spans[1:]):
            if b0 == b1 and start1 < end0:
                raise ReceiveError("layout", f"tensors overlap in bucket {b0} at byte {start1}")

    def _payload(self) -> dict:
        codes = sorted({DTYPE_CODES[e.dtype] for e in self.entries})
        which = {c: i for i, c in enumerate(codes)}
        return {
            "format": FORMAT, "alignment": self.alignment, "bucket_bytes": self.bucket_bytes,
            "bucket_sizes": list(self.bucket_sizes), "dtypes": codes,
            "tensors": [[e.name, which[DTYPE_CODES[e.dtype]], list(e.shape), e.bucket, e.offset]
                        for e in self.entries],
        }

    def to_json(self) -> str:
        return _canonical({**self._payload(), "id": self.layout_id})

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ReceiveError("layout", f"layout format {data.get('format')!r}, expected {FORMAT}")
            codes = data["dtypes"]
            unknown = [c for c in codes if c not in DTYPES]
            if unknown:
                raise ReceiveError("layout", f"unknown dtype code(s) {unknown}")
            entries = [TensorEntry(str(n), DTYPES[codes[d]], tuple(int(x) for x in shape), int(b), int(o))
                       for n, d, shape, b, o in data["tensors"]]
            layout = cls(entries, data["bucket_sizes"], data["bucket_bytes"], data["alignment"])
        except ReceiveError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ReceiveError("layout", f"malformed layout JSON: {exc!r}") from None
        if data.get("id") not in (None, layout.layout_id):
            raise ReceiveError("layout", f"layout id {data.get('id')} does not match its content "
                                         f"({layout.layout_id})")
        return layout

    def check_against(self, specs: Mapping[str, tuple[Iterable[int], torch.dtype]],
                      require_all: bool = True) -> None:
        """Refuse a layout that does not fit the receiving model: unknown names, other shapes or
        dtypes, or (with require_all) model tensors the layout never sends."""
        problems: list[str] = []
        for e in self.entries:
            spec = specs.get(e.name)
            if spec is None:
                problems.append(f"{e.name}: not a tensor of the receiving model")
                continue
            shape, dtype = tuple(spec[0]), spec[1]
            if shape != e.shape:
                problems.append(f"{e.name}: shape {e.shape} but the model has {shape}")
            if dtype != e.dtype:
                problems.append(f"{e.name}: dtype {e.dtype} but the model has {dtype}")
        if require_all:
            problems += [f"{n}: the model has it but the layout does not send it"
                         for n in specs if n not in self.index]
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise ReceiveError("layout", f"layout {self.layout_id} does not match the model: {shown}")


def bucket_checksum(bucket: torch.Tensor) -> int:
    """A position-sensitive 61-bit checksum computed with torch ops, so a CPU sender and a GPU
    receiver agree on it without copying the bucket anywhere. Not cryptographic."""
    flat = bucket.reshape(-1)
    if flat.dtype != torch.uint8:
        raise ValueError("bucket_checksum expects a flat uint8 tensor")
    modulus, h = (1 << 61) - 1, flat.numel() % ((1 << 61) - 1)
    words = flat[: flat.numel() // 4 * 4].view(torch.int32)
    cols, block = 256, 1 << 16  # 64 MiB of words per block bounds the int64 temporaries
    full = words.numel() // cols * cols
    for k, r0 in enumerate(range(0, full // cols, block)):
        rows = words[r0 * cols: min(full, (r0 + block) * cols)].view(-1, cols)
        rowsum = rows.sum(dim=1, dtype=torch.int64)  # |.| < 2**39
        wr = torch.arange(rowsum.numel(), dtype=torch.int64, device=flat.device) % 127 + 1
        a = int((rowsum * wr).sum())  # < 2**16 rows * 2**46: no int64 overflow
        b = sum(c * w for w, c in enumerate(rows.sum(dim=0, dtype=torch.int64).tolist(), 1))
        h = (h * 1_000_003 + a * 7919 + b + k) % modulus
    for i, byte in enumerate(flat[full * 4:].tolist()):
        h = (h * 257 + byte + i) % modulus
    return h


class BucketAssembler:
    """Turns arriving buckets into named tensors: views into the bucket where a tensor lies in
    one bucket; a split tensor is copied piece by piece and emitted once every piece arrived.

    `destination(name)` may return a tensor of the right shape and dtype to assemble a split
    tensor in place (an engine's staging buffer), which saves allocating a whole extra tensor.
    """

    def __init__(self, layout: Layout,
                 destination: Callable[[str], torch.Tensor | None] | None = None) -> None:
        self.layout = layout
        self.destination = destination
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}  # entry -> (bytes, pieces left)
        self._views: dict[int, tuple[tuple[int, str, int], list[tuple[str, torch.Tensor]]]] = {}

    def pending(self) -> list[str]:
        return [self.layout.entries[i].name for i in self._pending]

    def reset(self) -> None:
        self._pending.clear()

    def drop_cached_views(self) -> None:
        self._views.clear()

    def feed(self, index: int, bucket: torch.Tensor, cache_views: bool = False
             ) -> list[tuple[str, torch.Tensor]]:
        """Named tensors completed by bucket `index`. With cache_views (persistent memory such as
        a mapped shared-memory segment), views built for this same memory are reused."""
        layout = self.layout
        if not 0 <= index < layout.num_buckets:
            raise ReceiveError("transfer", f"bucket index {index} out of range 0..{layout.num_buckets - 1}")
        if bucket.dtype != torch.uint8 or bucket.dim() != 1 or bucket.numel() < layout.bucket_sizes[index]:
            raise ReceiveError("transfer", f"bucket {index}: expected a flat uint8 tensor of at least "
                                           f"{layout.bucket_sizes[index]} bytes, got {bucket.dtype} "
                                           f"{tuple(bucket.shape)}")
        key = (bucket.data_ptr(), str(bucket.device), bucket.numel())
        cached = self._views.get(index) if cache_views else None
        if cached is not None and cached[0] == key:
            whole = cached[1]
        else:
            whole = []
            typed: dict[torch.dtype, torch.Tensor] = {}
            for part in layout.parts_by_bucket[index]:
                entry = layout.entries[part.entry]
                if layout.num_parts[part.entry] == 1:
                    whole.append((entry.name, _view(bucket, entry, part.offset, typed)))
            if cache_views:
                self._views[index] = (key, whole)
        out = list(whole)
        for part in layout.parts_by_bucket[index]:
            if layout.num_parts[part.entry] > 1:
                done = self._add_piece(part, bucket)
                if done is not None:
                    out.append(done)
        return out

    def _add_piece(self, part: Part, bucket: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        entry = self.layout.entries[part.entry]
        held = self._pending.get(part.entry)
        if held is None:
            dest = self.destination(entry.name) if self.destination is not None else None
            if dest is not None and (tuple(dest.shape) != entry.shape or dest.dtype != entry.dtype
                                     or not dest.is_contiguous()):
                raise ReceiveError("layout", f"{entry.name}: destination is {dest.dtype} "
                                             f"{tuple(dest.shape)}, layout says {entry.dtype} {entry.shape}")
            if dest is None:
                dest = torch.empty(entry.shape, dtype=entry.dtype, device=bucket.device)
            held = (dest, self.layout.num_parts[part.entry])
        dest, left = held
        raw = dest.reshape(-1).view(torch.uint8)
        raw[part.start: part.start + part.nbytes].copy_(
            bucket[part.offset: part.offset + part.nbytes], non_blocking=True)
        if left == 1:
            self._pending.pop(part.entry, None)
            return entry.name, dest
        self._pending[part.entry] = (dest, left - 1)
        return None


def _view(bucket: torch.Tensor, entry: TensorEntry, offset: int,
          typed: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype, device=bucket.device)
    base = typed.get(entry.dtype)
    if base is None:
        usable = bucket.numel() // entry.dtype.itemsize * entry.dtype.itemsize
        base = typed[entry.dtype] = bucket[:usable].view(entry.dtype)
    return base.as_strided(entry.shape, _strides(entry.shape), base.storage_offset()
                           + offset // entry.dtype.itemsize)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(out))


class ReceiveSession:
    """One update on the receiving side: the version it is for, which buckets arrived, and
    (when verifying) that each bucket's bytes match the sender's checksum."""

    def __init__(self, assembler: BucketAssembler, version: int, verify: bool = False) -> None:
        self.assembler = assembler
        self.version = int(version)
        self.verify = verify
        self.received: set[int] = set()
        assembler.reset()

    def accept(self, header: Mapping, bucket: torch.Tensor, cache_views: bool = False
               ) -> list[tuple[str, torch.Tensor]]:
        """Check the bucket (check()) and return the named tensors it completes."""
        self.check(header, bucket)
        return self.assembler.feed(int(header["bucket"]), bucket, cache_views=cache_views)

    def check(self, header: Mapping, bucket: torch.Tensor) -> torch.Tensor:
        """Validate one bucket against this update (version, index, size, checksum), mark it
        received, and return exactly its bytes (for receivers that copy whole buckets)."""
        layout = self.assembler.layout
        version, index = header.get("version"), header.get("bucket")
        if version != self.version:
            raise ReceiveError("version", f"bucket for version {version} arrived during the update "
                                          f"to version {self.version}")
        if not isinstance(index, int) or not 0 <= index < layout.num_buckets:
            raise ReceiveError("transfer", f"bucket index {index!r} out of range")
        if index in self.received:
            raise ReceiveError("transfer", f"bucket {index} arrived twice")
        if header.get("nbytes") != layout.bucket_sizes[index]:
            raise ReceiveError("layout", f"bucket {index} has {header.get('nbytes')} bytes, the layout "
                                         f"says {layout.bucket_sizes[index]}")
        view = bucket[: layout.bucket_sizes[index]]
        if self.verify:
            expected = header.get("checksum")
            if expected is None:
                raise ReceiveError("checksum", f"bucket {index} carries no checksum but verification is on")
            got = bucket_checksum(view)
            if got != expected:
                raise ReceiveError("checksum", f"bucket {index} checksum {got:#x} != sender's "
                                               f"{int(expected):#x}: bytes corrupted in transfer")
        self.received.add(index)
        return view

    def close(self) -> None:
        layout = self.assembler.layout
        missing = [i for i in range(layout.num_buckets) if i not in self.received]
        if missing or self.assembler.pending():
            raise ReceiveError("incomplete", f"update to version {self.version} is incomplete: "
                                             f"{len(missing)} of {layout.num_buckets} buckets never arrived")


class ShmSegment:
    """A named POSIX shared-memory file under /dev/shm, mapped as one flat uint8 tensor.

    Plain files (not multiprocessing.shared_memory) so that attaching never registers the
    segment with another process's resource tracker, which would unlink it on exit.
    """

    def __init__(self, name: str, nbytes: int, fd: int, owner: bool) -> None:
        self.name, self.nbytes, self.owner = name, nbytes, owner
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            self._map = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        path = os.path.join(SHM_DIR, name)
        self._unlink = weakref.finalize(self, _unlink_quietly, path) if owner else None

    @classmethod
    def create(cls, nbytes: int, prefix: str = "rlix") -> ShmSegment:
        if nbytes <= 0:
            raise ValueError("a shared-memory segment needs at least one byte")
        if prefix not in _REAPED:
            _REAPED.add(prefix)
            reap_orphaned_segments(prefix)
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # fail now (ENOSPC), not with SIGBUS later
        except BaseException:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name))
            raise
        return cls(name, nbytes, fd, owner=True)

    @classmethod
    def attach(cls, name: str) -> ShmSegment:
        if "/" in name or name.startswith("."):
            raise ReceiveError("transfer", f"bad shared-memory name {name!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except OSError as exc:
            raise ReceiveError("transfer", f"cannot open shared memory {name!r}: {exc}") from None
        return cls(name, os.fstat(fd).st_size, fd, owner=False)

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)  # the mapping's view dropped, so it can close
        try:
            self._map.close()
        except BufferError:
            pass  # views are still alive; the mapping goes when they do
        if self._unlink is not None:
            self._unlink()


_REAPED: set[str] = set()  # prefixes this process already swept


def reap_orphaned_segments(prefix: str = "rlix") -> list[str]:
    """Unlink segments named `{prefix}-{pid}-{hex}` whose creating process is gone (a trainer
    killed without close() leaves its cache in /dev/shm). Run once per process and prefix, at
    the first create(). Returns the names removed."""
    removed = []
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        pid, _, tail = name[len(prefix) + 1:].partition("-") if name.startswith(prefix + "-") else ("", "", "")
        if not (pid.isdigit() and tail and set(tail) <= set("0123456789abcdef")):
            continue
        if _gone(int(pid)):  # its segments are orphans
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    return removed


def _gone(pid: int) -> bool:
    """No process `pid` runs: none exists, or it is a zombie (dead, not yet waited for: a
    SIGKILLed Ray worker whose raylet died stays one until init reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, not ours to signal
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(") ", 1)[1][0] == "Z"
    except OSError:
        return False


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmMapper:
    """Receiver-side cache of attached segments: each is mapped once and reused across updates."""

    def __init__(self) -> None:
        self._segments: dict[str, ShmSegment] = {}

    def bucket(self, name: str, offset: int, nbytes: int) -> torch.Tensor:
        seg = self._segments.get(name)
        if seg is None:
            seg = self._segments[name] = ShmSegment.attach(name)
        if offset < 0 or offset + nbytes > seg.nbytes:
            raise ReceiveError("transfer", f"bucket [{offset}, {offset + nbytes}) is outside "
                                           f"segment {name!r} of {seg.nbytes} bytes")
        return seg.tensor[offset: offset + nbytes]

    def close(self) -> None:
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()


def open_cuda_ipc(handle: tuple) -> torch.Tensor:
    """Rebuild a bucket shared by the sender with reduce_tensor (same GPU, another process)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor  # deferred: CUDA IPC only

    return rebuild_cuda_tensor(*handle)
