"""A shard in another process, reached over a multiprocessing Connection (request, reply).

Only control messages cross the pipe (a few hundred bytes per bucket); the bytes themselves go
by the transport (shared memory, CUDA IPC, NCCL). If the sender dies mid-update the receiving
loop sees the pipe close, aborts the engine's update (old weights keep serving) and raises.

`python tests/weights/pipe_shard.py --state FILE` runs a shard process over a ModelEngine (tests
and benchmarks); it reads the authkey (hex) from stdin and prints the port it listens on.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch

from rlix import env, errors
from rlix.errors import WeightTransferError, WeightUpdateError
from rlix.weights.shard_updater import ShardUpdater
from rlix.weights.wire import DTYPE_CODES, DTYPES
from rlix.weights.transport import Message

from model_engine import ModelEngine


class ConnectionEndpoint:
    """The driver's side of a shard served by serve_connection() in another process."""

    one_call = False

    def __init__(self, conn: Connection, name: str = "remote shard", transport_ranks: int = 1,
                 timeout: float = 120.0) -> None:
        self.conn, self.name, self.transport_ranks, self.timeout = conn, name, transport_ranks, timeout
        self._lock = threading.Lock()
        self._broken: str | None = None

    def call(self, op: str, **kwargs: Any) -> Any:
        """One blocking round trip; errors come back as the receiver's typed error."""
        with self._lock:
            if self._broken:
                raise WeightTransferError(f"{self.name}: connection unusable ({self._broken})")
            try:
                self.conn.send((op, kwargs))
                if not self.conn.poll(self.timeout):
                    self._broken = f"no answer to {op} within {self.timeout:.0f}s"
                    raise WeightTransferError(f"{self.name}: {self._broken}")
                reply = self.conn.recv()
            except (EOFError, OSError) as exc:
                self._broken = f"connection lost during {op}: {type(exc).__name__}"
                raise WeightTransferError(f"{self.name}: {self._broken}") from None
        if reply[0] == "ok":
            return reply[1]
        cls = getattr(errors, reply[1], None)
        if not (isinstance(cls, type) and issubclass(cls, WeightUpdateError)) or cls is errors.WeightSyncError:
            cls = WeightUpdateError
        raise cls(f"{self.name}: {reply[2]}")

    async def _acall(self, op: str, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.call, op, **kwargs)

    async def init_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        return await self._acall("init", init_info=init_info)

    async def start(self, version: int, layout_id: str, transfer: dict[str, Any]) -> None:
        await self._acall("start", version=version, layout_id=layout_id, transfer=transfer)

    async def push(self, message: Message) -> None:
        await self._acall("bucket", message=message)

    async def finish(self, version: int) -> int:
        return int(await self._acall("finish", version=version))

    async def abort(self, reason: str) -> None:
        await self._acall("abort", reason=reason)

    def close(self) -> None:
        try:
            self.call("close")
        except WeightUpdateError:
            pass
        self.conn.close()


def serve_connection(conn: Connection, receiver: ShardUpdater,
                     handlers: Mapping[str, Callable[..., Any]] | None = None) -> None:
    """Answer requests until `close` or until the peer goes away. Returns normally when idle at
    that point; raises WeightTransferError (after aborting the update) if it was mid-update."""
    loop = asyncio.new_event_loop()
    ops: dict[str, Callable[..., Any]] = {
        "init": lambda init_info: receiver.init_transfer(init_info),
        "start": lambda **kw: loop.run_until_complete(receiver.start(**kw)),
        "bucket": lambda message: loop.run_until_complete(receiver.bucket(message)),
        "finish": lambda version: loop.run_until_complete(receiver.finish(version)),
        "abort": lambda reason: loop.run_until_complete(receiver.abort(reason)),
        "version": lambda: receiver.engine.weight_version,
        **(handlers or {}),
    }
    try:
        while True:
            try:
                op, kwargs = conn.recv()
            except (EOFError, OSError):
                _peer_gone(loop, receiver)
                return
            if op == "close":
                _reply(conn, ("ok", None))
                return
            try:
                fn = ops.get(op)
                if fn is None:
                    raise WeightUpdateError(f"unknown request {op!r}")
                reply: tuple = ("ok", fn(**kwargs))
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller, typed
                reply = ("err", type(exc).__name__, str(exc))
            if not _reply(conn, reply):
                _peer_gone(loop, receiver)
                return
    finally:
        loop.close()


def _reply(conn: Connection, reply: tuple) -> bool:
    try:
        conn.send(reply)
        return True
    except (OSError, EOFError):
        return False


def _peer_gone(loop: asyncio.AbstractEventLoop, receiver: ShardUpdater) -> None:
    version = receiver.updating
    if version is None:
        return
    got, total = receiver.progress()
    reason = (f"the sender disconnected during the update to version {version} after {got} of "
              f"{total} buckets; update aborted, old weights keep serving")
    loop.run_until_complete(receiver.abort(reason))
    raise WeightTransferError(reason)


class PipeShard:
    """A shard process over a ModelEngine, reached over a pipe; started and ended by its own pid."""

    def __init__(self, state_path: str, device: str = "cpu", name: str = "shard",
                 start_timeout: float = 120.0, call_timeout: float = 120.0,
                 adopt_layouts: bool = True) -> None:
        authkey = os.urandom(16)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--state", state_path, "--device", device]
            + ([] if adopt_layouts else ["--copy-per-tensor"]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env.nccl_child_env())
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(authkey.hex().encode() + b"\n")
        self.proc.stdin.close()
        ready, _, _ = select.select([self.proc.stdout], [], [], start_timeout)
        line = self.proc.stdout.readline().decode().strip() if ready else ""
        if not line.startswith("port "):
            self.kill()
            raise WeightTransferError(f"receiver process did not start (got {line!r})")
        conn = Client(("127.0.0.1", int(line.split()[1])), authkey=authkey)
        self.endpoint = ConnectionEndpoint(conn, name=name, timeout=call_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, op: str, **kwargs: Any) -> Any:
        return self.endpoint.call(op, **kwargs)

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.endpoint.close()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _initial_state(path: str, device: str) -> dict[str, torch.Tensor]:
    if path.endswith(".json"):
        with open(path) as fh:
            spec = json.load(fh)
        return {n: torch.zeros(shape, dtype=DTYPES[dtype], device=device) for n, (shape, dtype) in spec.items()}
    return {n: t.to(device) for n, t in torch.load(path, weights_only=True).items()}


def write_spec(path: str, tensors: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> str:
    """A receiver's initial state as shapes only (zeros), for big models: {name: (shape, dtype)}."""
    with open(path, "w") as fh:
        json.dump({n: [list(shape), DTYPE_CODES[dtype]] for n, (shape, dtype) in tensors.items()}, fh)
    return path


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="rlix weight receiver process (tests, benchmarks)")
    p.add_argument("--state", required=True, help="torch.save'd dict of the initial named tensors, "
                                                  "or a .json spec {name: [shape, dtype]} (zeros)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--copy-per-tensor", action="store_true",
                   help="do not adopt the bucket layout: stage tensor by tensor, as most engines do")
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints where a stuck receiver is
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    engine = ModelEngine(_initial_state(args.state, args.device), adopt_layouts=not args.copy_per_tensor)
    receiver = ShardUpdater(engine, device=args.device)
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        print(f"port {listener.address[1]}", flush=True)
        conn = listener.accept()

    def dump(path: str) -> str:
        torch.save({n: t.cpu() for n, t in engine.served().items()}, path)
        return path

    def cuda_memory(reset: bool = False) -> tuple[int, int]:
        dev = torch.device(args.device)
        if dev.type != "cuda":
            return 0, 0
        torch.cuda.synchronize(dev)
        out = torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)
        if reset:
            torch.cuda.reset_peak_memory_stats(dev)
        return out

    try:
        serve_connection(conn, receiver, {"dump": dump, "probe": engine.probe,
                                          "cuda_memory": cuda_memory, "pid": os.getpid})
    except WeightTransferError as exc:
        print(f"receiver: {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(_main())
