"""The data plane on its own thread: a pipeline's router and rollout HTTP calls off the control loop.

A pipeline process runs two kinds of traffic: rollouts (tens of requests in flight, through the
router to the shards) and control calls (sleep, wake, weight sync) that the scheduler waits on.
On one event loop a control call queues behind every rollout callback: measured on the CPU
example, a shard sleep that takes 5-15 ms at the engine took 0.2-1.2 s from the pipeline. Here
the router server and the rollout client run on a second event loop in a daemon thread, so the
control loop only ever sees one completion per rollout request.

`DataPlaneThread.run(coro)` runs a coroutine there and is awaited from any other loop
(cancelling the waiter cancels the coroutine). `router_control()` gives the fleet the router's
`RouterControl` methods, executed on the router's own loop (its shard table is not thread-safe),
except a known shard's state change, which applies at once (`ShardTable.flip`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from rlix.errors import EngineStateError
from rlix.inference.router.app import RouterServer

T = TypeVar("T")


class DataPlaneThread:
    """An event loop in a daemon thread, hosting a router server and data-plane coroutines."""

    def __init__(self, name: str = "rlix-data-plane") -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._router_server: Any = None

    def start(self) -> None:
        if self._thread is not None:
            raise EngineStateError(f"{self.name} already started")
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self.loop = loop
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=main, name=self.name, daemon=True)
        self._thread.start()
        ready.wait()

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.loop is not None

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the data-plane loop; await its result from the caller's loop."""
        if not self.alive():
            coro.close()
            raise EngineStateError(f"{self.name} is not running")
        assert self.loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def serve_router(self, router: Any) -> str:
        """Start a RouterServer for `router` on this thread's loop; returns its URL."""
        async def start() -> str:
            self._router_server = RouterServer(router)
            await self._router_server.start()
            return self._router_server.url

        return await self.run(start())

    def router_control(self, router: Any) -> ThreadRouterControl:
        return ThreadRouterControl(router, self)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the router server (held requests end now), then the loop and its thread."""
        if not self.alive():
            return
        if self._router_server is not None:
            server, self._router_server = self._router_server, None
            await self.run(asyncio.wait_for(server.stop(), timeout_s))
        loop, thread = self.loop, self._thread
        assert loop is not None and thread is not None

        async def cancel_rest() -> None:
            current = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not current]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        await self.run(cancel_rest())
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout_s)
        self._thread = None


class ThreadRouterControl:
    """The fleet's `RouterControl` for a router that lives on a DataPlaneThread."""

    def __init__(self, router: Any, plane: DataPlaneThread) -> None:
        self.router, self.plane = router, plane

    async def set_shard(self, rank: int, url: str | None = None, state: str | None = None) -> dict:
        table = self.router.table
        if url is None and state is not None and rank in table.shards and self.plane.alive():
            # a state change takes effect now, not when the busy data-plane loop gets to it
            # (marking a shard preempted waited ~100 ms there); held requests are woken there
            view = table.flip(rank, state).view()
            assert self.plane.loop is not None
            self.plane.loop.call_soon_threadsafe(table.notify)
            return view
        return await self.plane.run(self.router.set_shard(rank, url, state))

    async def remove_shard(self, rank: int) -> None:
        await self.plane.run(self.router.remove_shard(rank))

    async def shards(self) -> list[dict]:
        return await self.plane.run(self.router.shards())
