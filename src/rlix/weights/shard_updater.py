"""One shard's end of a sync: the update it receives in buckets, applied to the engine beside it.

`ShardUpdater` sits next to an engine and turns transport messages into the engine's own
update protocol (start_weight_update / update_weights... / finish_weight_update), so whatever
the transport, the engine sees named tensors. It refuses a layout that does not fit the model
before any update starts, and on any failure aborts the engine's update so the old weights keep
serving. The engine server's control plane owns one; `InProcessEndpoint` is the sync driver's
`ShardEndpoint` (weights/api.py) for a shard in the driver's own process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlix.errors import (WeightChecksumError, WeightLayoutError, WeightTransferError,
                         WeightUpdateError)
from rlix.weights.api import WeightTarget
from rlix.weights.wire import BucketAssembler, Layout, ReceiveError, ReceiveSession
from rlix.weights.transport import Message, TransportReceiver, make_receiver

_TEARDOWN = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlix-transport-teardown")

_ERRORS: dict[str, type[WeightUpdateError]] = {
    "layout": WeightLayoutError, "checksum": WeightChecksumError, "transfer": WeightTransferError,
    "incomplete": WeightTransferError, "version": WeightUpdateError,
}


def as_update_error(exc: BaseException, context: str) -> WeightUpdateError:
    """One typed error for anything that went wrong receiving, with its context in front."""
    if isinstance(exc, ReceiveError):
        return _ERRORS.get(exc.kind, WeightUpdateError)(f"{context}: {exc}")
    if isinstance(exc, WeightUpdateError):
        try:
            return type(exc)(f"{context}: {exc}")
        except TypeError:  # a subclass with a richer constructor
            return WeightUpdateError(f"{context}: {exc}")
    return WeightTransferError(f"{context}: {type(exc).__name__}: {exc}")


class ShardUpdater:
    """Receives buckets for one engine; kept for the shard's lifetime (layout cached here)."""

    def __init__(self, engine: WeightTarget, device: str | torch.device = "cpu") -> None:
        self.engine = engine
        self.device = torch.device(device)
        self.layout: Layout | None = None
        self.verify = False
        self.transport: TransportReceiver | None = None
        self._assembler: BucketAssembler | None = None
        self._session: ReceiveSession | None = None
        self._bucket_target: Callable[[int], tuple[torch.Tensor, Mapping[str, torch.Tensor]] | None] | None = None
        self.last_error: str | None = None
        self.bucket_ms: dict[str, float] = {}  # the last update's bucket time, by part
        self._teardown: concurrent.futures.Future | None = None

    @property
    def updating(self) -> int | None:
        return None if self._session is None else self._session.version

    def progress(self) -> tuple[int, int]:
        """(buckets received, buckets expected) of the update in progress."""
        if self._session is None or self.layout is None:
            return 0, 0
        return len(self._session.received), self.layout.num_buckets

    def init_transfer(self, init_info: Mapping[str, Any]) -> dict[str, Any]:
        """Take the layout (sent once) and the transport kind; check the layout against the
        model now, so a mismatch is refused before any update starts."""
        if self._session is not None:
            raise WeightUpdateError("cannot change the transfer layout during an update")
        if self._teardown is not None:  # the transport may be replaced below
            concurrent.futures.wait([self._teardown])
            self._teardown = None
        try:
            layout = Layout.from_json(init_info["layout"])
            specs = self.engine.weight_specs()
            if specs is not None:
                layout.check_against(specs, require_all=not init_info.get("partial", False))
            kind = str(init_info.get("transport", "shm"))
            if self.transport is None or self.transport.kind != kind:
                if self.transport is not None:
                    self.transport.close()
                self.transport = make_receiver(kind, self.device)
        except Exception as exc:
            self.layout = self._assembler = None
            raise self._fail(exc, "weight transfer init refused") from None
        self.layout, self.verify = layout, bool(init_info.get("verify", False))
        self._assembler = BucketAssembler(layout, self.engine.weight_destination)
        self._bucket_target = self.engine.weight_bucket if self.engine.adopt_layout(layout) else None
        return {"layout_id": layout.layout_id, "tensors": len(layout.entries),
                "buckets": layout.num_buckets, "bytes": layout.total_bytes}

    async def start(self, version: int, layout_id: str, transfer: Mapping[str, Any]) -> None:
        context = f"update to version {version} refused, old weights keep serving"
        if self.layout is None or self._assembler is None or self.transport is None:
            raise self._fail(WeightLayoutError("no transfer layout: init_transfer first"), context)
        if layout_id != self.layout.layout_id:
            raise self._fail(WeightLayoutError(f"the update uses layout {layout_id}, this shard was "
                                               f"initialised with {self.layout.layout_id}"), context)
        if self._session is not None:
            raise self._fail(WeightUpdateError(f"an update to version {self._session.version} is "
                                               f"in progress"), context)
        await self.wait_teardown()
        kind = transfer.get("transport")
        if kind is not None and kind != self.transport.kind:
            # one layout, two senders (the host cache by shared memory, the trainer's device
            # copy by CUDA IPC): each start names its transport
            try:
                receiver = make_receiver(str(kind), self.device)
            except Exception as exc:
                raise self._fail(exc, context) from None
            self.transport.close()
            self.transport = receiver
        try:
            self.transport.open(dict(transfer))
            await self.engine.start_weight_update(int(version))
        except Exception as exc:
            self.transport.end()
            raise self._fail(exc, context) from None
        self._session = ReceiveSession(self._assembler, int(version), self.verify)
        self.bucket_ms = {"receive": 0.0, "unpack": 0.0, "stage": 0.0, "wait": 0.0}

    async def bucket(self, message: Message) -> None:
        session, transport = self._require()
        clock = time.perf_counter
        try:
            t0 = clock()
            target = self._bucket_target(message.get("bucket")) if self._bucket_target else None
            landed = target is not None and transport.receives_into
            if landed:
                tensor = transport.receive(message, out=target[0])  # straight into staging
            else:
                tensor = transport.receive(message)
            t1 = clock()
            if target is not None:  # the engine keeps its weights in bucket layout: one copy
                dest, named = target
                view = session.check(message, tensor)
                if view.data_ptr() != dest.data_ptr():
                    dest.copy_(view)
                t2 = clock()
                await self.engine.update_weights(named)
            else:
                named = session.accept(message, tensor, cache_views=transport.persistent)
                t2 = clock()
                if named:
                    await self.engine.update_weights(dict(named))
            t3 = clock()
            if tensor.is_cuda and not landed and not message.get("lasting"):
                # consumed: the transport may reuse its buffer. Bytes that landed in staging, or
                # a source that lasts until the sync ends (the trainer's device copy), need no
                # wait here (finish synchronises), so the next bucket follows at once.
                torch.cuda.current_stream(tensor.device).synchronize()
            for k, a, b in (("receive", t0, t1), ("unpack", t1, t2), ("stage", t2, t3), ("wait", t3, clock())):
                self.bucket_ms[k] += 1000 * (b - a)
            del named, tensor
            transport.release(message)
        except Exception as exc:
            raise await self._abort_on(exc, f"bucket {message.get('bucket')}") from None

    async def finish(self, version: int) -> int:
        session, transport = self._require()
        try:
            if int(version) != session.version:
                raise ReceiveError("version", f"finish names version {version} but the update "
                                              f"started as {session.version}")
            session.close()
            applied = int(await self.engine.finish_weight_update())
        except Exception as exc:
            raise await self._abort_on(exc, "finish") from None
        self._session = None
        # Tearing the transport down (an NCCL communicator abort takes ~0.5 s) happens after
        # the answer: the new weights already serve; the next start() waits for it.
        self._teardown = _TEARDOWN.submit(transport.end)
        self.last_error = None
        return applied

    async def abort(self, reason: str) -> None:
        self.last_error = reason
        if self._session is not None:
            self._session = None
            try:
                await self.engine.abort_weight_update(reason)
            finally:
                if self.transport is not None:
                    self.transport.end()

    async def wait_teardown(self) -> None:
        """Wait for the previous update's transport teardown (errors there are not this update's)."""
        pending, self._teardown = self._teardown, None
        if pending is not None:
            try:
                await asyncio.wrap_future(pending)
            except Exception:  # noqa: BLE001 - a failed teardown leaves nothing to reuse anyway
                pass

    def close(self) -> None:
        if self._teardown is not None:
            concurrent.futures.wait([self._teardown])
            self._teardown = None
        if self._assembler is not None:
            self._assembler.drop_cached_views()
        if self.transport is not None:
            self.transport.end()
            self.transport.close()
            self.transport = None

    def _require(self) -> tuple[ReceiveSession, TransportReceiver]:
        if self._session is None or self.transport is None:
            raise WeightUpdateError("no weight update in progress: start it first")
        return self._session, self.transport

    async def _abort_on(self, exc: BaseException, where: str) -> WeightUpdateError:
        version = self._session.version if self._session is not None else None
        err = self._fail(exc, f"update to version {version} failed at {where}; aborted, old weights "
                              f"keep serving")
        await self.abort(str(err))
        return err

    def _fail(self, exc: BaseException, context: str) -> WeightUpdateError:
        err = as_update_error(exc, context)
        self.last_error = str(err)
        return err


class InProcessEndpoint:
    """A shard living in the driver's process: direct calls into its ShardUpdater."""

    one_call = False  # step by step, and it cannot be woken from here

    def __init__(self, updater: ShardUpdater, name: str = "shard", transport_ranks: int = 1) -> None:
        self.updater = updater
        self.name = name
        self.transport_ranks = transport_ranks

    async def init_transfer(self, init_info: dict[str, Any]) -> dict[str, Any]:
        return self.updater.init_transfer(init_info)

    async def start(self, version: int, layout_id: str, transfer: dict[str, Any]) -> None:
        await self.updater.start(version, layout_id, transfer)

    async def push(self, message: Message) -> None:
        await self.updater.bucket(message)

    async def finish(self, version: int) -> int:
        return await self.updater.finish(version)

    async def abort(self, reason: str) -> None:
        await self.updater.abort(reason)
