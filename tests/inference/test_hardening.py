"""Engine server and router under bad or vanishing callers, against real server processes:
body limits (413 before the body is read), a client that goes away (its request is aborted on
every path), dead shards (DOWN, routed around, back when they answer), the admin API (token,
4xx for malformed bodies) and `rlix router` as a real process."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from kit import AUTH, KEY, shard_processes

from rlix.inference.server.openai_schema import GenerateSamplingParams as SP
from rlix.httpkit import free_port
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.router.app import RouterServer
from rlix.inference.router.router import Router

LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}
BODIES = {
    "generate": ("/inference/v1/generate", {"token_ids": [5, 6, 7], "sampling_params": LONG}),
    "completions": ("/v1/completions", {"model": "tiny", "prompt": "once", **LONG}),
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **LONG}),
}


@pytest.fixture(scope="module")
def shard(tiny_model_dir):
    with shard_processes(tiny_model_dir, 1, max_model_len=512) as (proc,):
        yield proc


async def running(url: str) -> int:
    client = RemoteInferenceClient(None, {0: url}, KEY)
    try:
        return int((await client.load([0]))[0]["running"])
    finally:
        await client.aclose()


def raw_post(url: str, path: str, headers: dict[str, str], body: bytes, timeout: float = 10) -> tuple[int, float]:
    """A POST over a plain socket, the body sent in pieces while watching for an early answer
    (a server that refuses a body answers before it is all sent): the status and how long the
    answer took."""
    host, port = url.split("//")[1].split(":")
    t0 = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(head.encode() + b"\r\n")
        for i in range(0, len(body), 2**16):
            if select.select([s], [], [], 0)[0]:
                break  # answered already
            try:
                s.sendall(body[i:i + 2**16])
            except OSError:
                break
        answer = s.recv(65536)
    return int(answer.split(b" ", 2)[1]), time.perf_counter() - t0


def test_a_body_over_the_limit_gets_413_unread_and_the_shard_stays_responsive(shard):
    big = 10 * 2**20
    # announced by Content-Length: refused before a byte of it is read
    status, took = raw_post(shard.url, "/v1/completions",
                            {**AUTH, "content-type": "application/json", "content-length": str(big)}, b"")
    assert status == 413 and took < 2
    # chunked: refused once the bytes read pass the limit
    chunk = b"x" * 2**20
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(10)) + b"0\r\n\r\n"
    status, _ = raw_post(shard.url, "/inference/v1/generate",
                         {**AUTH, "content-type": "application/json", "transfer-encoding": "chunked"}, body)
    assert status == 413
    t0 = time.perf_counter()
    assert httpx.get(shard.url + "/health", timeout=5).status_code == 200
    assert time.perf_counter() - t0 < 1
    r = httpx.post(shard.url + "/inference/v1/generate", headers=AUTH, timeout=30,
                   json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 200  # a normal body still goes through


@pytest.mark.parametrize("kind", sorted(BODIES))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_client_that_goes_away_aborts_its_request(shard, kind, stream):
    path, body = BODIES[kind]

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30, headers=AUTH) as http:
            task = asyncio.create_task(http.post(shard.url + path, json={**body, "stream": stream}))
            deadline = time.monotonic() + 20
            while await running(shard.url) < 1:
                assert time.monotonic() < deadline, "the request never started"
                await asyncio.sleep(0.01)
            task.cancel()  # the client closes its connection
            await asyncio.gather(task, return_exceptions=True)
        deadline = time.monotonic() + 5
        while await running(shard.url) > 0:
            assert time.monotonic() < deadline, "the engine kept generating for a client that left"
            await asyncio.sleep(0.02)

    asyncio.run(main())


def test_a_router_client_that_goes_away_aborts_the_shards_request(shard):
    async def main() -> None:
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        try:
            await router.set_shard(0, shard.url, "active")
            async with httpx.AsyncClient(timeout=30) as http:
                path, body = BODIES["generate"]
                task = asyncio.create_task(http.post(server.url + path, json=body))
                while await running(shard.url) < 1:
                    await asyncio.sleep(0.01)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            deadline = time.monotonic() + 5
            while await running(shard.url) > 0:
                assert time.monotonic() < deadline, "the shard kept generating for a caller that left"
                await asyncio.sleep(0.02)
            status, took = await asyncio.to_thread(raw_post, server.url, "/v1/completions",
                                                   {"content-length": str(50 * 2**20)}, b"")
            assert status == 413 and took < 2
        finally:
            await server.stop()

    asyncio.run(main())


def test_a_dead_shard_goes_down_requests_go_around_it_and_it_comes_back(tiny_model_dir):
    async def main() -> None:
        with shard_processes(tiny_model_dir, 2, max_model_len=256) as (a, b):
            router = Router(KEY, hold_timeout_s=3)
            await router.set_shard(0, a.url, "active")
            await router.set_shard(1, b.url, "active")
            try:
                b_port = b.port
                b.stop()  # nothing listens on shard 1 now: connection refused
                outs = await asyncio.gather(*(router.generate([1, 2, 3], SP(max_tokens=3, ignore_eos=True)) for _ in range(6)))
                assert all(len(o.token_ids) == 3 for o in outs)  # none lost
                view = {s["rank"]: s for s in await router.shards()}
                assert view[1]["state"] == "down" and "connect" in view[1]["down_reason"]
                assert [s["rank"] for s in router.down_shards()] == [1]
                # no live shard left: the error says why, not "cut by preemption"
                a.stop()
                with pytest.raises(Exception, match=r"no active shard within 3 s; shard \d down"):
                    await router.generate([1, 2, 3], SP(max_tokens=3, ignore_eos=True))
                # a server answers at shard 1's address again: the router's probe brings it back
                with shard_processes(tiny_model_dir, 1, max_model_len=256) as (c,):
                    await router.set_shard(1, c.url)  # url changed (as a fleet replacement sets it)
                    await router.set_shard(1, state="active")
                    out = await router.generate([1, 2, 3], SP(max_tokens=3, ignore_eos=True))
                    assert len(out.token_ids) == 3
                assert b_port  # (the old port is gone with its process)
            finally:
                await router.close()

    asyncio.run(main())


def test_admin_api_needs_the_token_and_refuses_malformed_bodies_with_4xx(shard):
    async def main() -> None:
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        try:
            async with httpx.AsyncClient(timeout=10, base_url=server.url) as http:
                assert (await http.get("/router/shards")).status_code == 401
                assert (await http.post("/router/shards", json={"rank": 0, "url": shard.url})).status_code == 401
                assert (await http.delete("/router/shards/0")).status_code == 401
                bad = [b"{not json", b"[1, 2]", b'{"rank": "zero"}', b'{"url": "http://x"}',
                       b'{"rank": 0, "state": "sideways", "url": "http://x"}', b'{"rank": 5}']
                for body in bad:
                    r = await http.post("/router/shards", content=body, headers=AUTH)
                    assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
                    assert "Traceback" not in r.text
                r = await http.delete("/router/shards/abc", headers=AUTH)
                assert 400 <= r.status_code < 500
                r = await http.get("/router/shards", headers=AUTH)
                assert r.status_code == 200 and r.json()["shards"] == []
            async with httpx.AsyncClient(timeout=10, base_url=shard.url, headers=AUTH) as http:
                for path in ("/abort_requests", "/update_weights", "/init_weight_transfer_engine"):  # (wake_up reads its query, as vLLM)
                    r = await http.post(path, content=b"{oops")
                    assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        finally:
            await server.stop()

    asyncio.run(main())


def test_rlix_router_serves_shards_a_user_started(shard):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rlix.cli", "router", "--shard", shard.url,
                             "--port", str(port), "--api-key", "admin", "--shard-api-key", KEY],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        r = httpx.get(f"http://127.0.0.1:{port}/router/shards", headers={"Authorization": "Bearer admin"})
        assert r.json()["active"] == [0]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(10)
