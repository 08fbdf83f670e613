"""A cached version copied to another node's replica cache over one plain TCP stream.

The shm transport lets shards on the trainer's host map its cache; shards on other Ray nodes
cannot. Instead each such node holds a replica (a BucketCache of the same layout, node_cache.py)
filled from the trainer's cache by this relay, and its shards are synced from the replica over
shared memory exactly as on the trainer's host. Every byte of a version crosses the network once
per node, not once per shard.

The stream is one TCP connection per version, no framing per bucket: the layout says where
every byte goes, so the buckets follow the header back to back. The sender hands each bucket's
memory to `sendall` and the receiver `recv_into`s the replica slot's memory, so a byte is copied
only by the kernel (user -> socket buffer -> user), as a plain socket copy is. Pure: no Ray.

    sender                                     receiver (listening, RelayReceiver)
    header: magic, version, total bytes,  ->   check magic/version/layout, make the replica
            layout JSON, [bucket checksums]
                                          <-   status (0 = go on, else refused + reason)
    bucket 0 bytes, bucket 1 bytes, ...   ->   recv_into the slot (checksums verified if sent)
                                          <-   status (0 = stored and promoted, else why not)

Every socket operation has a timeout (a stalled peer is detected within `timeout_s`), a refusal
or failure is a typed error naming host:port and what failed, and a stream cut short leaves the
replica's other versions intact (BucketCache.write_version).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlix.errors import RlixError, WeightChecksumError, WeightLayoutError, WeightTransferError
from rlix.weights.cache import BucketCache
from rlix.weights.wire import Layout, ReceiveError, bucket_checksum

MAGIC = b"RLIXRLY1"
# magic, version, total bytes, layout JSON length, number of checksums (0 or one per bucket)
_HEAD = struct.Struct("!8sQQII")
_STATUS = struct.Struct("!BI")  # status, length of the reason that follows
OK, REFUSED_LAYOUT, REFUSED_CHECKSUM, FAILED = 0, 1, 2, 3
MAX_LAYOUT_BYTES = 64 << 20  # a sanity bound for what a header may announce
#: bytes per send/recv call: bounds how long one call may take (its timeout), copies nothing
CHUNK = 4 << 20
#: socket buffer size asked for (None: leave Linux's autotuning alone). Explicit buffers turn
#: autotuning off; bench/weight_sync.py --only cross_node measured both on loopback.
SOCK_BUF_BYTES: int | None = None
DEFAULT_TIMEOUT_S = 60.0

CacheOrFactory = BucketCache | Callable[[Layout], BucketCache]


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's own memory as a writable byte memoryview (no copy)."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
        raise WeightTransferError(f"relay needs contiguous host uint8 buckets, got {t.dtype} on {t.device}")
    return memoryview(t.numpy()).cast("B")


def _tune(sock: socket.socket, buf_bytes: int | None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # header and status replies go now
    if buf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf_bytes)


def _recv_exact(sock: socket.socket, view: memoryview, what: Callable[[int], str]) -> None:
    """Fill `view` from the socket; `what(received)` describes the place for the error if the
    peer closes early."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got: got + CHUNK])
        if k == 0:
            raise ConnectionError(f"peer closed the connection {what(got)}")
        got += k


def _recv_bytes(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    _recv_exact(sock, memoryview(buf), lambda got: f"after {got} of {n} bytes of {what}")
    return bytes(buf)


def _send_status(sock: socket.socket, status: int, reason: str = "") -> None:
    data = reason.encode()[:4096]
    sock.sendall(_STATUS.pack(status, len(data)) + data)


def _recv_status(sock: socket.socket, what: str) -> tuple[int, str]:
    status, n = _STATUS.unpack(_recv_bytes(sock, _STATUS.size, what))
    return status, _recv_bytes(sock, n, what).decode(errors="replace") if n else ""


def encode_header(layout: Layout, version: int, checksums: list[int] | None = None) -> bytes:
    """What a sender writes before the buckets (public so tests can speak the protocol)."""
    text = layout.to_json().encode()
    sums = list(checksums or [])
    if sums and len(sums) != layout.num_buckets:
        raise WeightTransferError(f"{len(sums)} checksums for {layout.num_buckets} buckets")
    return (_HEAD.pack(MAGIC, int(version), layout.total_bytes, len(text), len(sums)) + text
            + struct.pack(f"!{len(sums)}Q", *sums))


def send_version(cache: BucketCache, version: int, host: str, port: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, *, checksums: bool = False,
                 sock_buf_bytes: int | None = SOCK_BUF_BYTES) -> float:
    """Send cached `version` to the receiver listening at host:port; returns the seconds from
    connect to the receiver's confirmation that the version is stored. The version is leased
    for the duration, so it cannot be rebuilt under the stream. `checksums`: send per-bucket
    checksums (computed once per version by the cache) for the receiver to verify.

    Raises WeightTransferError (cannot connect, connection lost, timed out, receiver failed),
    WeightLayoutError or WeightChecksumError (the receiver refused), WeightCacheError (not cached)."""
    where = f"relay of version {version} to {host}:{port}"
    version = int(version)
    t0 = time.perf_counter()
    with cache.lease(version) as buckets:
        head = encode_header(cache.layout, version, cache.checksums(version) if checksums else None)
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as exc:
            raise WeightTransferError(f"{where}: cannot connect: {exc}") from None
        stage = "header"
        try:
            with sock:
                _tune(sock, sock_buf_bytes)
                sock.sendall(head)
                status, reason = _recv_status(sock, "the receiver's answer to the header")
                _raise_refusal(status, reason, where)
                for i, bucket in enumerate(buckets):
                    stage = f"bucket {i} of {len(buckets)}"
                    view = _byte_view(bucket)
                    for pos in range(0, len(view), CHUNK):
                        sock.sendall(view[pos: pos + CHUNK])
                stage = "the receiver's confirmation"
                status, reason = _recv_status(sock, stage)
                _raise_refusal(status, reason, where)
        except (OSError, ConnectionError) as exc:  # socket.timeout is an OSError
            kind = "timed out" if isinstance(exc, TimeoutError) else "failed"
            raise WeightTransferError(f"{where} {kind} at {stage}: {exc or type(exc).__name__}") from None
    return time.perf_counter() - t0


def _raise_refusal(status: int, reason: str, where: str) -> None:
    if status == OK:
        return
    cls = {REFUSED_LAYOUT: WeightLayoutError, REFUSED_CHECKSUM: WeightChecksumError}.get(status, WeightTransferError)
    raise cls(f"{where}: receiver refused: {reason}")


@dataclass(frozen=True)
class Received:
    """One version stored in a replica by RelayReceiver.receive."""

    version: int
    bytes: int
    seconds: float  # accept to stored and promoted
    peer: str  # host:port of the sender
    verified: bool  # per-bucket checksums came with it and matched


class RelayReceiver:
    """Listens on host:port (port 0: any free port, read `.port`) for one sender per receive()."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, sock_buf_bytes: int | None = SOCK_BUF_BYTES) -> None:
        self.timeout_s = timeout_s
        self.sock_buf_bytes = sock_buf_bytes
        try:
            self._listen = socket.create_server((host, int(port)), backlog=4)
        except OSError as exc:
            raise WeightTransferError(f"relay receiver cannot listen on {host}:{port}: {exc}") from None
        if sock_buf_bytes:  # accepted sockets inherit it; the window scale is fixed at the handshake
            self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sock_buf_bytes)
        self.host, self.port = host, self._listen.getsockname()[1]
        self._cancelled = threading.Event()
        self._conn: socket.socket | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def receive(self, cache_or_factory: CacheOrFactory, *, version: int | None = None,
                accept_timeout_s: float | None = None, promote: bool = True) -> tuple[BucketCache, Received]:
        """Accept one sender and store the version it sends in the replica: `cache_or_factory`
        is the replica, or (first use) a function making it from the sender's layout. `version`:
        refuse any other. Returns the replica and what was received. Raises WeightTransferError
        (no sender within the timeout, connection lost, cancelled), WeightLayoutError (the
        layout differs from the replica's) or WeightChecksumError; the replica's other versions
        stay intact either way."""
        me = f"relay receiver {self.address}"
        conn, peer = self._accept(accept_timeout_s if accept_timeout_s is not None else self.timeout_s, me)
        self._conn = conn
        t0 = time.perf_counter()
        stage = "header"
        got_version, sums, total = version, None, 0
        try:
            with conn:
                conn.settimeout(self.timeout_s)
                _tune(conn, self.sock_buf_bytes)
                try:
                    cache, got_version, sums = self._header(conn, cache_or_factory, version, me, peer)
                    total = cache.layout.total_bytes

                    def fill(buckets: list[torch.Tensor]) -> None:
                        # the go-ahead is sent once the slot is held: a replica that cannot take
                        # this version (its slots are being synced) refuses before any bytes flow
                        nonlocal stage
                        _send_status(conn, OK)
                        done = 0
                        for i, bucket in enumerate(buckets):
                            stage = f"bucket {i} of {len(buckets)}"
                            _recv_exact(conn, _byte_view(bucket),
                                        lambda got: f"after {done + got} of {total} bytes")
                            done += bucket.numel()
                            if self._cancelled.is_set():
                                raise ConnectionError("cancelled")
                            if sums is not None:
                                have = bucket_checksum(bucket)
                                if have != sums[i]:
                                    raise WeightChecksumError(
                                        f"{me}: version {got_version} from {peer}: bucket {i} checksum "
                                        f"{have:#x} != sender's {sums[i]:#x}: bytes corrupted in transfer")

                    cache.write_version(got_version, fill, checksums=sums)
                    if promote:
                        cache.promote_active(got_version)
                except RlixError as exc:  # refused: tell the sender why, then raise it here
                    status = (REFUSED_LAYOUT if isinstance(exc, WeightLayoutError) else
                              REFUSED_CHECKSUM if isinstance(exc, WeightChecksumError) else FAILED)
                    text = str(exc) if str(exc).startswith(me) else f"{me}: version {got_version} from {peer}: {exc}"
                    with contextlib.suppress(OSError):
                        _send_status(conn, status, text)
                    if text == str(exc):
                        raise
                    try:
                        named = type(exc)(text)  # the same type, with host:port in its message
                    except TypeError:
                        raise exc from None
                    raise named from None
                stage = "confirmation"
                _send_status(conn, OK)
        except (OSError, ConnectionError) as exc:
            if self._cancelled.is_set():
                raise WeightTransferError(f"{me}: cancelled during {stage}") from None
            kind = "timed out" if isinstance(exc, TimeoutError) else "failed"
            raise WeightTransferError(f"{me}: receive from {peer} {kind} at {stage}: "
                                      f"{exc or type(exc).__name__}; the replica's other versions are intact"
                                      ) from None
        finally:
            self._conn = None
        return cache, Received(int(got_version), total, time.perf_counter() - t0, peer, sums is not None)

    def _accept(self, timeout_s: float, me: str) -> tuple[socket.socket, str]:
        """One connection within timeout_s, polling so that cancel() is seen promptly."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._cancelled.is_set():
                raise WeightTransferError(f"{me}: cancelled while waiting for the sender")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightTransferError(f"{me}: no sender connected within {timeout_s:.1f} s")
            self._listen.settimeout(min(left, 0.2))
            try:
                conn, addr = self._listen.accept()
                return conn, f"{addr[0]}:{addr[1]}"
            except TimeoutError:
                continue
            except OSError as exc:
                if self._cancelled.is_set():
                    raise WeightTransferError(f"{me}: cancelled while waiting for the sender") from None
                raise WeightTransferError(f"{me}: accept failed: {exc}") from None

    def _header(self, conn: socket.socket, cache_or_factory: CacheOrFactory, expect: int | None,
                me: str, peer: str) -> tuple[BucketCache, int, list[int] | None]:
        magic, version, total, n_layout, n_sums = _HEAD.unpack(_recv_bytes(conn, _HEAD.size, "the header"))
        if magic != MAGIC:
            raise WeightTransferError(f"{me}: {peer} is not a relay sender (magic {magic!r})")
        if n_layout > MAX_LAYOUT_BYTES:
            raise WeightTransferError(f"{me}: {peer} announced a {n_layout}-byte layout")
        text = _recv_bytes(conn, n_layout, "the layout")
        sums = list(struct.unpack(f"!{n_sums}Q", _recv_bytes(conn, 8 * n_sums, "the checksums"))) if n_sums else None
        if expect is not None and version != int(expect):
            raise WeightTransferError(f"{me}: {peer} sent version {version}, version {expect} was asked for")
        try:
            layout = Layout.from_json(text)
        except ReceiveError as exc:
            raise WeightLayoutError(f"{me}: layout from {peer} refused: {exc}") from None
        if total != layout.total_bytes or (sums is not None and len(sums) != layout.num_buckets):
            raise WeightLayoutError(f"{me}: header from {peer} announces {total} bytes and {n_sums} "
                                    f"checksums for a layout of {layout.total_bytes} bytes in "
                                    f"{layout.num_buckets} buckets")
        cache = cache_or_factory if isinstance(cache_or_factory, BucketCache) else cache_or_factory(layout)
        if cache.layout.layout_id != layout.layout_id:
            raise WeightLayoutError(f"{me}: version {version} from {peer} has layout {layout.layout_id} "
                                    f"({layout.total_bytes} bytes, {layout.num_buckets} buckets) but the replica "
                                    f"holds layout {cache.layout.layout_id} ({cache.layout.total_bytes} bytes, "
                                    f"{cache.layout.num_buckets} buckets)")
        return cache, version, sums

    def cancel(self) -> None:
        """Make a receive() in another thread stop soon with WeightTransferError."""
        self._cancelled.set()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv_into

    def close(self) -> None:
        self.cancel()
        with contextlib.suppress(OSError):
            self._listen.close()

    def __enter__(self) -> RelayReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["RelayReceiver", "Received", "encode_header", "send_version"]
