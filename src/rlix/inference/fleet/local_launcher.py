"""Shard processes started from this process (tests, single-machine runs), one per launcher
key: what `ShardFleet` asks of a launcher (api.ShardLauncher), with local processes behind it.
Several nodes use the Ray shells in actors.py instead."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from rlix.inference.fleet.api import EngineBackend
from rlix.inference.fleet.shard_process import ShardProcess
from rlix.inference.fleet.startup import ShardStartup


class LocalLauncher:
    """Shard processes started from this process (tests, single-machine runs). `placement`
    gives the environment of a process placed on some GPUs (rlix.placement's visible devices)."""

    def __init__(self, backend: EngineBackend, api_key: str, host: str = "127.0.0.1",
                 log_dir: str | None = None, extra_env: dict[str, str] | None = None,
                 placement: Callable[[Sequence[int]], dict[str, str]] | None = None) -> None:
        self.backend, self.api_key, self.host = backend, api_key, host
        self.log_dir, self.extra_env = log_dir, extra_env
        self.placement = placement
        self.procs: dict[int, ShardProcess] = {}

    async def start(self, rank: int, gpus: Sequence[int] = ()) -> str:
        env = dict(self.extra_env or {})
        if gpus and self.placement is not None:
            env.update(self.placement(gpus))
        proc = ShardProcess(self.backend, self.api_key, self.host, log_dir=self.log_dir,
                            extra_env=env)
        self.procs[rank] = proc
        await asyncio.to_thread(proc.start_ready)
        return proc.url

    async def stop(self, rank: int) -> None:
        proc = self.procs.pop(rank, None)
        if proc is not None:
            await asyncio.to_thread(proc.stop)

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items() if p.pid is not None}

    def startup(self) -> list[ShardStartup]:
        """Each process's start-up as seen now (its phase read from its log while it starts)."""
        return [s for r, p in sorted(self.procs.items()) if (s := p.startup(r)) is not None]

    def server_pids(self) -> dict[int, int]:
        """The servers' own PIDs (each runs under a guard whose PID `pids` gives)."""
        return {r: pid for r, p in self.procs.items() if (pid := p.server_pid()) is not None}

    async def dead_ranks(self) -> list[int]:
        return sorted(r for r, p in self.procs.items() if not p.alive())

    def exit_code(self, rank: int) -> int | None:
        proc = self.procs.get(rank)
        return proc.proc.poll() if proc is not None and proc.proc is not None else None

    def log_tail(self, rank: int, n: int = 5) -> str:
        proc = self.procs.get(rank)
        return proc.log_tail(n) if proc is not None else ""
