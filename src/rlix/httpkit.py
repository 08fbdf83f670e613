"""HTTP helpers every layer shares: a lean HTTP/1.1 keep-alive pool, bearer headers, free ports.

The pool carries the router's calls to its shards, the control fan-out and the weight-sync calls.

Why not httpx: on this 2-core CPU httpx's async stack cost ~2 ms per proxied request, more than
the router's whole budget; this pool of keep-alive connections on asyncio streams costs ~0.3 ms.
It speaks just what the engine servers answer: Content-Length or chunked bodies, read whole or
as lines (SSE). A reused connection that turns out closed before any answer arrived (the server's
keep-alive timeout) is retried once on a fresh one; any other transport failure is an
`UpstreamError`, which the relay treats as a dead shard.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
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


#: request bodies larger than this are refused with 413 before they are read (a 10 MB body
#: held a shard's event loop for 10-20 s and ~2 GB of memory while it was parsed)
MAX_BODY_BYTES = 4 * 2**20


class RequestGuard:
    """ASGI middleware for rlix's servers (engine and router), around every POST:

    - a body over `max_body` gets 413 before it is read (Content-Length), or as soon as the
      bytes read pass it (chunked);
    - once the body is in, the connection is watched: if the client goes away before the answer
      is complete, the handler is cancelled, which aborts its engine request (non-streamed
      requests included: they used to generate to the end for nobody).

    Plain ASGI, one task per POST, for the reason BearerAuth is (the shard's HTTP loop also
    answers the control calls a preemption waits for)."""

    def __init__(self, app: Any, max_body: int = MAX_BODY_BYTES, paths: tuple[str, ...] | None = None) -> None:
        """`paths`: only POSTs to paths with these prefixes are guarded (None: all)."""
        self.app, self.max_body, self.paths = app, max_body, paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or \
                (self.paths is not None and not scope["path"].startswith(self.paths)):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await self._too_large(send, int(length))
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await self._too_large(send, size)
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
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

    async def _too_large(self, send: Any, size: int) -> None:
        body = json.dumps({"error": {"message": f"request body of {size} bytes exceeds the limit of "
                                                f"{self.max_body} bytes", "type": "PayloadTooLargeError",
                                     "param": None, "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
