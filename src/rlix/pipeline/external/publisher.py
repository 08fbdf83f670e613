"""ClientPublisher: WeightPath's Publisher for an external pipeline, whose versions the program
builds in a cache of its own process.

The order is WeightPath's, unchanged: `WeightPath.publish(v)` first vacates the host route (no
refit still reads the slot the next build overwrites), then asks its Publisher. Here that ask
only says "the slot is free" (the client's open_version returns on it) and waits for the
client's PublishedVersion (its after_training call), which goes back to WeightPath as if a
trainer had built it.
"""

from __future__ import annotations

import asyncio

from rlix.errors import ClientOrderError
from rlix.weights.api import PublishedVersion


class ClientPublisher:
    def __init__(self) -> None:
        self._free: dict[int, asyncio.Event] = {}
        self._built: dict[int, asyncio.Future[PublishedVersion]] = {}

    def expect(self, version: int) -> None:
        """The client is about to build `version` (its open_version)."""
        self._free[version] = asyncio.Event()
        self._built[version] = asyncio.get_running_loop().create_future()

    async def slot_free(self, version: int) -> None:
        await self._free[version].wait()

    async def publish(self, version: int, audit: bool = False, on_device: bool = False) -> PublishedVersion:
        """(WeightPath's call, after it vacated the slot) Wait for the client's build."""
        if version not in self._built:
            raise ClientOrderError(f"version {version} was not opened by the client")
        self._free[version].set()
        try:
            return await self._built[version]
        finally:
            self._free.pop(version, None)
            self._built.pop(version, None)

    def deliver(self, published: PublishedVersion) -> None:
        """The client built `published.version` in its cache."""
        waiting = self._built.get(published.version)
        if waiting is None or waiting.done():
            raise ClientOrderError(f"version {published.version} was not opened (call open_version first)")
        waiting.set_result(published)
