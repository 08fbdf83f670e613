"""Helpers the scheduler's asyncio tests share (one copy each)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import polling

T = TypeVar("T")

#: how long a condition the scheduler should reach at once may take on a busy 2-core machine
TIMEOUT = 2.0


def run(coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
    """Run one test's coroutine to the end; a hung one fails after `timeout` s, not the suite's."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(cond: Callable[[], object], timeout: float = TIMEOUT) -> None:
    """Poll the event loop until cond() holds; AssertionError after `timeout` s."""
    await polling.until(cond, timeout)
