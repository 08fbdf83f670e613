"""DataPlaneThread: a router and rollout calls on their own loop, driven from another loop."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from kit import KEY, shard_processes
from rlix.errors import EngineStateError, InferenceError, InvalidRequestError
from rlix.inference.fleet.client import RemoteInferenceClient
from rlix.inference.router.data_plane import DataPlaneThread
from rlix.inference.router.router import Router


def test_run_executes_on_the_plane_thread_and_cancels_through():
    async def main() -> None:
        plane = DataPlaneThread("test-plane")
        plane.start()
        caller = threading.get_ident()

        async def where() -> int:
            return threading.get_ident()

        assert await plane.run(where()) not in (caller, None)

        started, cancelled = threading.Event(), threading.Event()

        async def long() -> None:
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        waiter = asyncio.create_task(plane.run(long()))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await asyncio.get_running_loop().run_in_executor(None, cancelled.wait, 5)

        async def boom() -> None:
            raise ValueError("raised on the plane")

        with pytest.raises(ValueError, match="raised on the plane"):
            await plane.run(boom())
        await plane.stop()
        assert not plane.alive()
        with pytest.raises(EngineStateError, match="not running"):
            await plane.run(where())

    asyncio.run(main())


def test_router_on_the_plane_serves_rollouts_and_takes_shard_changes(tiny_model_dir):
    with shard_processes(tiny_model_dir, 1) as procs:
        async def main() -> None:
            plane = DataPlaneThread()
            plane.start()
            router = Router(KEY, hold_timeout_s=30.0)
            url = await plane.serve_router(router)
            control = plane.router_control(router)
            rollout = RemoteInferenceClient(url, {}, KEY, "tiny")
            params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}

            # no active shard yet: the request is held on the plane until one is set active
            held = asyncio.create_task(plane.run(rollout.generate([5, 6, 7], params)))
            await asyncio.sleep(0.3)
            assert not held.done()
            view = await control.set_shard(0, procs[0].url, "active")
            assert view["state"] == "active"
            out = await asyncio.wait_for(held, 60)
            assert len(out["choices"][0]["token_ids"]) == 4
            assert [s["rank"] for s in await control.shards()] == [0]

            # data-plane answers map to typed errors: a bad request is not retryable
            with pytest.raises(InvalidRequestError):
                await plane.run(rollout.generate([5, 6, 7], {"max_tokens": -1}))

            # state changes of a known shard apply at once (flip) and still wake held requests
            assert (await control.set_shard(0, state="preempted"))["state"] == "preempted"
            assert router.table.pick(None) is None
            held = asyncio.create_task(plane.run(rollout.generate([5, 6, 7], params)))
            await asyncio.sleep(0.3)
            assert not held.done()
            await control.set_shard(0, state="active")
            out = await asyncio.wait_for(held, 60)
            assert len(out["choices"][0]["token_ids"]) == 4

            # stopping the plane ends a held request instead of hanging on it
            await control.set_shard(0, state="inactive")
            held = asyncio.create_task(plane.run(rollout.generate([5, 6, 7], params)))
            await asyncio.sleep(0.3)
            await plane.run(rollout.aclose())
            await asyncio.wait_for(plane.stop(), 20)
            with pytest.raises((httpx.HTTPError, InferenceError)):  # 503 or the connection closed
                await asyncio.wait_for(held, 5)
            with pytest.raises(EngineStateError, match="unreachable"):  # the router is gone
                await rollout.generate([5, 6, 7], params)
            await rollout.aclose()

        asyncio.run(main())
