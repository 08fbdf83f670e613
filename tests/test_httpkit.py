"""The lean HTTP pool against a raw asyncio server: a kept connection the server closed is not
reused; a request that must not run twice is never sent twice."""

from __future__ import annotations

import asyncio

from rlix.httpkit import HttpPool, UpstreamError


async def _server(handle):  # type: ignore[no-untyped-def]
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    return head + await reader.readexactly(length)


def _answer(body: bytes, close: bool = False) -> bytes:
    extra = b"connection: close\r\n" if close else b""
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def test_a_connection_the_server_closed_is_not_reused():
    async def main() -> tuple[list[bytes], int]:
        bodies, connections = [], 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            bodies.append(await _read_request(reader))
            writer.write(_answer(b"ok"))  # kept alive, then closed: an idle timeout
            await writer.drain()
            writer.close()

        server, url = await _server(handle)
        pool = HttpPool()
        out = []
        for i in range(3):
            resp = await pool.request("POST", url, "/run", b"x%d" % i, retry_stale=False)
            out.append(await resp.read())
            await asyncio.sleep(0.05)  # the server's FIN arrives
        await pool.aclose()
        server.close()
        return out, connections

    out, connections = asyncio.run(main())
    assert out == [b"ok"] * 3 and connections == 3


def test_a_request_that_must_not_run_twice_fails_instead_of_being_resent():
    async def main() -> tuple[int, BaseException | None]:
        seen = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal seen
            while True:
                try:
                    await _read_request(reader)
                except asyncio.IncompleteReadError:
                    return
                seen += 1
                if seen == 1:
                    writer.write(_answer(b"first"))
                    await writer.drain()
                else:  # took the request, then died before answering
                    writer.transport.abort()
                    return

        server, url = await _server(handle)
        pool = HttpPool()
        await (await pool.request("POST", url, "/run", b"a")).read()
        error = None
        try:
            await pool.request("POST", url, "/run", b"b", retry_stale=False)
        except UpstreamError as exc:
            error = exc
        await pool.aclose()
        server.close()
        return seen, error

    seen, error = asyncio.run(main())
    assert isinstance(error, UpstreamError) and seen == 2
