"""Polling an asyncio loop until a condition holds: the one copy the test folders share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(cond: Callable[[], object], timeout: float, every: float = 0.001) -> None:
    """Poll the event loop every `every` s until cond() holds; AssertionError after `timeout` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(every)
