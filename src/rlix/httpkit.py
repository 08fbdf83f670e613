"""HTTP helpers every layer shares: a lean HTTP/1.1 keep-alive pool, bearer headers, free ports.

The pool carries the router's calls to its shards, the control fan-out and the weight-sync calls.

Why not httpx: its async stack costs several times more per proxied request than the router's
whole budget on a small CPU (docs/BENCHMARKS.md, router overhead); this pool of keep-alive
connections on asyncio streams does the same work in a fraction of it.
It speaks just what the engine servers answer: Content-Length or chunked bodies, read whole or
as lines (SSE). A reused connection that turns out closed before any answer arrived (the server's
keep-alive timeout) is retried once on a fresh one; any other transport failure is an
`UpstreamError`, which the relay treats as a dead shard.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from rlix.errors import ConfigError

STREAM_LIMIT = 16 * 2**20  # longest line readuntil accepts (long prompt_token_ids in SSE)
_TRANSPORT = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (the usual small race with other binders applies)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback: "localhost", 127.0.0.0/8, ::1, or an
    IPv4-mapped 127.x (how a dual-stack socket shows an IPv4 loopback peer or bind)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def check_ray_address(address: str, timeout_s: float = 3.0) -> None:
    """A Ray address (`host:port` or `ray://host:port`) must accept a connection within
    `timeout_s`: Ray itself retries an unreachable one for minutes. "auto" is left to Ray.
    ConfigError (one line) otherwise."""
    if address == "auto":
        return
    hostport = address.split("://", 1)[1] if "://" in address else address
    host, _, port = hostport.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"Ray address {address!r} (--address or RAY_ADDRESS): give host:port or "
                          "ray://host:port (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"no Ray cluster answers at {address} ({exc.strerror or exc})") from None


def bearer(api_key: str) -> dict[str, str]:
    """The Authorization header every rlix server expects."""
    return {"Authorization": f"Bearer {api_key}"}


class UpstreamError(Exception):
    """The connection to a shard failed (refused, reset, closed mid-answer, garbled)."""


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class UpstreamResponse:
    """Status and headers are read; the body is read by `read()` or `lines()`, exactly once."""

    def __init__(self, pool: HttpPool, key: tuple[str, int], conn: _Conn, status: int,
                 headers: dict[bytes, bytes]) -> None:
        self._pool, self._key, self._conn = pool, key, conn
        self.status_code = status
        self.headers = headers
        self._done = False
        length = headers.get(b"content-length")
        self._length = int(length) if length is not None else None
        self._chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        self._reusable = headers.get(b"connection", b"").lower() != b"close" and \
            (self._length is not None or self._chunked)

    async def _chunks(self) -> AsyncIterator[bytes]:
        r = self._conn.reader
        try:
            if self._length is not None:
                if self._length:
                    yield await r.readexactly(self._length)
            elif self._chunked:
                while True:
                    size = int((await r.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                    if size == 0:
                        while await r.readuntil(b"\r\n") != b"\r\n":  # trailers
                            pass
                        break
                    data = await r.readexactly(size + 2)
                    yield data[:-2]
            else:  # body until EOF
                while data := await r.read(65536):
                    yield data
        except _TRANSPORT as exc:
            self._reusable = False
            raise UpstreamError(f"connection lost mid-answer: {exc!r}") from None
        self._done = True

    async def read(self) -> bytes:
        try:
            return b"".join([c async for c in self._chunks()])
        finally:
            await self.aclose()

    def json(self, body: bytes) -> Any:
        return json.loads(body)

    async def lines(self) -> AsyncIterator[str]:
        """The body as text lines (without line ends); the connection is released at the end."""
        buf = b""
        try:
            async for chunk in self._chunks():
                buf += chunk
                *full, buf = buf.split(b"\n")
                for line in full:
                    yield line.rstrip(b"\r").decode()
            if buf:
                yield buf.rstrip(b"\r").decode()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self._done and self._reusable:
            self._pool._release(self._key, conn)
        else:
            conn.close()


class HttpPool:
    """Keep-alive connections per (host, port); one request at a time per connection."""

    def __init__(self, connect_timeout_s: float = 5.0, max_idle_per_host: int = 512) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._keys: dict[str, tuple[str, int]] = {}

    def _key(self, base: str) -> tuple[str, int]:
        key = self._keys.get(base)
        if key is None:
            parts = urlsplit(base)
            key = self._keys[base] = (parts.hostname or "127.0.0.1", parts.port or 80)
        return key

    def _release(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.close()

    async def _open(self, key: tuple[str, int]) -> _Conn:
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(*key, limit=STREAM_LIMIT),
                                          self.connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {exc!r}") from None
        return _Conn(r, w)

    def _idle_conn(self, key: tuple[str, int]) -> _Conn | None:
        """A kept connection the server has not closed yet (one it closed reads EOF)."""
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()
        return None

    async def request(self, method: str, base: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None, retry_stale: bool = True) -> UpstreamResponse:
        """`retry_stale`: a kept connection that fails before any answer is retried once on a
        new one. Off for a request that must not run twice (the server may have died after
        taking it): such a failure is then an UpstreamError."""
        key = self._key(base)
        head = [f"{method} {path} HTTP/1.1", f"host: {key[0]}:{key[1]}", f"content-length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        raw = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        conn = self._idle_conn(key)
        reused = conn is not None
        if conn is None:
            conn = await self._open(key)
        try:
            while True:
                try:
                    conn.writer.write(raw)
                    await conn.writer.drain()
                    status_line = await conn.reader.readuntil(b"\r\n")
                    break
                except _TRANSPORT as exc:
                    conn.close()
                    if not (reused and retry_stale):
                        raise UpstreamError(f"{key[0]}:{key[1]} {path}: {exc!r}") from None
                    conn, reused = await self._open(key), False  # a stale keep-alive connection
            try:
                status = int(status_line.split(b" ", 2)[1])
                headers_out: dict[bytes, bytes] = {}
                while (line := await conn.reader.readuntil(b"\r\n")) != b"\r\n":
                    name, _, value = line.partition(b":")
                    headers_out[name.strip().lower()] = value.strip()
            except (*_TRANSPORT, IndexError) as exc:
                conn.close()
                raise UpstreamError(f"{key[0]}:{key[1]} {path}: bad answer: {exc!r}") from None
        except asyncio.CancelledError:  # a caller's timeout: the answer would land on the next user
            conn.close()
            raise
        return UpstreamResponse(self, key, conn, status, headers_out)

    async def exchange(self, method: str, base: str, path: str, body: bytes = b"",
                       headers: dict[str, str] | None = None, retry_stale: bool = True) -> tuple[int, bytes]:
        """`request`, its answer read whole: (status, body)."""
        resp = await self.request(method, base, path, body, headers, retry_stale)
        return resp.status_code, await resp.read()

    async def post_json(self, base: str, path: str, obj: Any, headers: dict[str, str]) -> tuple[int, bytes]:
        return await self.exchange("POST", base, path, json.dumps(obj).encode(),
                                   {"content-type": "application/json", **headers})

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()


#: data-plane request bodies larger than this are refused with 413 before they are read (a 10 MB
#: body held a shard's event loop for 10-20 s and ~2 GB of memory while it was parsed)
MAX_BODY_BYTES = 4 * 2**20
#: control-plane bodies (pause, sleep, abort, an admin call...): small JSON objects; a 100 MB body
#: sent to one raised the server's memory by 200 MB a request before this bound
MAX_CONTROL_BODY_BYTES = 2**20
#: JSON nested deeper than this is refused (400) before it is parsed: Python's json recurses
#: once per level, and 100,000 levels raised RecursionError (a 500) on every path
MAX_JSON_DEPTH = 64
#: the most characters of an error message a server sends back (an error quoting a huge input
#: would otherwise echo it)
MAX_ERROR_CHARS = 1000

#: the most bytes of a request head (its line and headers) rlix's servers read: 431 beyond
#: (uvicorn's httptools protocol has no bound of its own: a 50 MB header was read whole)
MAX_HEAD_BYTES = 64 * 2**10
#: seconds a connection may take to send a request head, on a new connection or after an answer
#: (a connection that never sends one would otherwise hold its socket until the client leaves)
HEAD_TIMEOUT_S = 30.0

#: methods whose handlers never read a body: only its announced size is checked
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS"})


def capped(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters (marked), for error messages that quote an input."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


_DEPTH_LUT: Any = None


def _depth_lut() -> Any:
    """numpy and its byte table, loaded once (a server loads it when its app is made, not
    when the first suspicious body comes)."""
    global _DEPTH_LUT
    if _DEPTH_LUT is None:
        import numpy as np  # deferred: only servers need it, not every importer of httpkit

        lut = np.zeros(256, dtype=np.int8)
        lut[list(b"[{")] = 1
        lut[list(b"]}")] = -1
        _DEPTH_LUT = np, lut
    return _DEPTH_LUT


_KEEP_QUOTES_AND_BRACKETS = bytes(b for b in range(256) if b not in b'"[]{}')


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `body` nests arrays and objects deeper than `limit` (brackets inside
    strings do not count), decided without parsing it.

    Cheap on every body: fewer than `limit` opening brackets anywhere (almost every request)
    cannot be deeper, two byte counts. Otherwise C-speed passes: escaped backslashes and quotes
    dropped (`bytes.replace`), every byte but quotes and brackets dropped (`translate`), then
    numpy marks what lies between quotes and takes the running depth's maximum. Where the text
    is not valid JSON the parser stops at the first fault, and up to there this depth is the
    parser's, so a body it passes cannot make the parser recurse deeper than `limit`."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    s = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _KEEP_QUOTES_AND_BRACKETS)
    if s.count(b"[") + s.count(b"{") <= limit:
        return False
    np, lut = _depth_lut()
    arr = np.frombuffer(s, dtype=np.uint8)
    inside = np.bitwise_xor.accumulate(arr == ord('"'), dtype=np.uint8)  # 1 within a string
    steps = np.where(inside == 0, lut[arr], 0).astype(np.int32)
    return int(np.cumsum(steps).max()) > limit


@dataclass(frozen=True)
class BodyPolicy:
    """How `RequestGuard` treats the request bodies of one path."""

    #: larger bodies get 413 before they are read (Content-Length) or once the bytes read pass it
    max_bytes: int
    #: once the body is in, a caller that goes away cancels the handler (the data plane: its
    #: engine request is aborted); off for the control plane, which a caller's timeout must not cut
    watch: bool = False
    #: an application/octet-stream body is not JSON (a safetensors upload): not depth-checked
    binary: bool = False


def _error(status: int, message: str, type_: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()


class RequestGuard:
    """ASGI middleware for rlix's servers (engine and router), around every request, before any
    handler runs (why: a body is bounded and checked before any work is done on it):

    - a body over its path's `BodyPolicy.max_bytes` gets 413 before it is read (Content-Length),
      or as soon as the bytes read pass it (chunked); the connection is then closed;
    - a body nesting JSON deeper than `max_depth` gets 400 before any parser sees it;
    - with `watch`, once the body is in, the connection is watched: if the client goes away
      before the answer is complete, the handler is cancelled, which aborts its engine request
      (non-streamed requests included: otherwise they generate to the end for nobody).

    GET, HEAD and OPTIONS bodies are never read (only their announced size is checked). Plain
    ASGI, one task per request, for the reason BearerAuth is (the shard's HTTP loop also answers
    the control calls a preemption waits for)."""

    def __init__(self, app: Any, max_body: int = MAX_BODY_BYTES, paths: tuple[str, ...] | None = None,
                 policy: Callable[[str], BodyPolicy] | None = None, max_depth: int = MAX_JSON_DEPTH) -> None:
        """`policy(path)` gives each path's policy; without one, POSTs to paths with the `paths`
        prefixes (None: all) get `max_body` and are watched, other paths `MAX_CONTROL_BODY_BYTES`."""
        self.app, self.max_depth = app, max_depth
        if policy is None:
            data, control = BodyPolicy(max_body, watch=True), BodyPolicy(MAX_CONTROL_BODY_BYTES)
            policy = (lambda path: data) if paths is None else \
                (lambda path: data if path.startswith(paths) else control)
        self.policy = policy
        _depth_lut()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy(scope["path"])
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > policy.max_bytes:
            await self._too_large(send, int(length), policy.max_bytes)
            return
        if scope["method"] in _BODILESS:
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > policy.max_bytes:
                await self._too_large(send, size, policy.max_bytes)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        del chunks
        if not (policy.binary and _content_type(scope).startswith(b"application/octet-stream")) \
                and json_too_deep(body, self.max_depth):
            await _send_json(send, 400, _error(400, f"the request body nests JSON deeper than "
                                                    f"{self.max_depth} levels", "BadRequestError"))
            return
        if not policy.watch:
            await self.app(scope, replay_body(body, receive), send)
            return
        gone = asyncio.Event()
        sent_body = False

        async def replay() -> dict:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        handler = asyncio.ensure_future(self.app(scope, replay, send))

        async def watch() -> None:
            message = await receive()  # after the body: only a disconnect (or the end) comes
            if message["type"] == "http.disconnect" and not handler.done():
                gone.set()
                handler.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await handler
        except asyncio.CancelledError:
            if not gone.is_set():  # cancelled from outside (server shutdown): not ours to hide
                raise
        finally:
            watcher.cancel()

    @staticmethod
    async def _too_large(send: Any, size: int, limit: int) -> None:
        await _send_json(send, 413, _error(413, f"request body of {size} bytes exceeds the limit of "
                                                f"{limit} bytes", "PayloadTooLargeError"), close=True)


def bounded_http_protocol(max_head: int = MAX_HEAD_BYTES, head_timeout_s: float = HEAD_TIMEOUT_S) -> Any:
    """uvicorn's `http` protocol for rlix's servers: its httptools protocol with the request
    head bounded: a head over `max_head` bytes gets 431 and the connection closes (what uvicorn
    buffers of a head is then bounded too), and a connection that sends no complete head for
    `head_timeout_s` (new, or idle after an answer while uvicorn's own keep-alive timer is
    disarmed by a byte) is closed. "auto" where httptools is missing."""
    try:
        # deferred: uvicorn's internal module, only where a server is made (it may be missing)
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class BoundedHeadHttpTools(HttpToolsProtocol):
        """Bytes fed while a request head is incomplete (from the parser's message-begin to
        its headers-complete callback) are counted (httptools buffers a header whole until it
        ends, so the raw bytes are what is bounded); a head that came whole in one read is
        measured when it is complete, before any handler sees it."""

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_bytes, self._mid_head, self._head_timer, self._refused = 0, False, None, False
            self._arm()

        def _refuse(self) -> None:
            self._refused = True
            body = _error(431, f"request head over {max_head} bytes", "RequestHeaderFieldsTooLarge")
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: "
                                 b"application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(body), body))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)  # the parser's callbacks run here
            if self._mid_head and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > max_head:
                    self._refuse()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._mid_head, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._mid_head = False
            self._disarm()
            if len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > max_head:
                self._refuse()  # no handler runs; what follows in this read is dropped below
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._mid_head:
                self._arm()  # idle until the next head

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedHeadHttpTools


def _content_type(scope: dict) -> bytes:
    return next((v for k, v in scope["headers"] if k == b"content-type"), b"").lower()


def replay_body(body: bytes, receive: Any) -> Any:
    """A `receive` that hands the already-read body over once, then defers to the real one."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_json(send: Any, status: int, body: bytes, close: bool = False) -> None:
    """An answer sent before the app saw the request; `close`: the body was left unread."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
