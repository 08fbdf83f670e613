"""The fleet's Protocols: what it needs from a launcher, a router and an engine backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rlix.inference.fleet.startup import ShardStartup


@runtime_checkable
class EngineBackend(Protocol):
    """What the fleet needs to start a shard and know when it is ready."""

    name: str
    health_path: str
    startup_timeout_s: float
    #: sleep/wake really frees memory (vLLM refuses sleep mode on CPU)
    supports_sleep: bool
    #: (path, JSON body) posted once the server is healthy, before it is used
    ready_requests: tuple[tuple[str, dict], ...]
    #: the environment variable the server reads its bearer token from (None: it takes none);
    #: a token never goes on a command line, which every user of the machine can read
    api_key_env: str | None
    #: the phases of its start-up and the log text that marks each (startup.PhaseMarkers)
    startup_phases: tuple[tuple[str, tuple[str, ...]], ...]

    def command(self, *, host: str, port: int) -> list[str]: ...

    def env(self) -> dict[str, str]: ...


class ShardLauncher(Protocol):
    """Starts and ends the engine server process of one DP rank."""

    async def start(self, rank: int, gpus: Sequence[int] = ()) -> str:
        """The shard's URL, once healthy; `gpus`: where it is placed (it sees only those)."""
        ...

    async def stop(self, rank: int) -> None: ...

    def pids(self) -> dict[int, int]: ...

    async def dead_ranks(self) -> list[int]:
        """Ranks started and not stopped whose server process has exited."""
        ...

    def startup(self) -> list[ShardStartup]:
        """Each process's start-up as seen now, for progress reports."""
        ...


class RouterControl(Protocol):
    async def set_shard(self, rank: int, url: str | None = None, state: str | None = None) -> dict: ...

    async def remove_shard(self, rank: int) -> None: ...
