"""The engine server's control plane as a plain class: pause, sleep, abort, weight updates.

Answers have vLLM's shapes (dev-mode endpoints of vLLM 0.32). Weights arrive two ways:
- packed buckets (what rlix's selective sync uses): `/init_weight_transfer_engine` carries the
  bucket layout once (`{"init_info": {"layout": ..., "transport": "shm"}}`), `/start_weight_update`
  names the version, layout id and transport details, each `/update_weights` carries one small
  transport message (`{"update_info": {"bucket": i, "version": v, "shm": ..., "offset": ...}}`;
  the bytes travel by shared memory, CUDA IPC or NCCL, never through HTTP), then
  `/finish_weight_update`. The receiving logic is rlix.weights.shard_updater.ShardUpdater.
  rlix extension `/sync_weights`: when every message is a reference the shard can read whenever
  it likes (the trainer's cache in shared memory), start, all messages and finish come in one
  call, optionally waking the engine first: one round trip instead of 2 + buckets (+ a wake).
- safetensors over HTTP (simple clients, small models): POST /update_weights with the raw file
  as the body (Content-Type: application/octet-stream), or `{"update_info": {"safetensors_b64"}}`.
Versions are integers (the trainer's step); `/start_weight_update` may name the version
(`{"weight_version": 3}`), otherwise it is the serving version + 1. Any failure aborts the whole
update, so the old weights keep serving; the caller starts again.
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load

from rlix.errors import InvalidRequestError, WeightUpdateError
from rlix.inference.engine.api import EngineAPI
from rlix.inference.engine.core import SLEEP_TAGS
from rlix.inference.server import control_schema as C
from rlix.inference.server.control_schema import (AbortRequestsBody, AbortWeightUpdateBody,
                                                  FinishWeightUpdateBody, InitTransferInfo,
                                                  StartWeightUpdateBody, SyncWeightsBody,
                                                  UpdateWeightsBody, json_body, parse_body)
from rlix.weights.shard_updater import ShardUpdater

PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = SLEEP_TAGS


def decode_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    try:
        return load(data)
    except Exception as exc:
        raise WeightUpdateError(f"the body is not a safetensors file: {exc}") from None


class ControlPlane:
    """Thin policy over EngineAPI's control methods."""

    def __init__(self, engine: EngineAPI) -> None:
        self.engine = engine
        self.transfer_info: dict[str, Any] = {}
        self._updating: int | None = None
        self._bucketed = False  # the update in progress comes as packed buckets
        self._updater: ShardUpdater | None = None  # made on the first bucket transfer
        self._resume_on_wake = False
        self.idle_timeout_s = 60.0  # a bucket update idle this long is aborted (sender gone)
        self.last_sync_ms: dict[str, float] = {}  # the last /sync_weights, by phase
        self._last_activity = 0.0
        self._watchdog: asyncio.Task | None = None

    async def pause(self, mode: str) -> dict:
        if mode not in PAUSE_MODES:
            raise InvalidRequestError(f"mode must be one of abort, wait, keep; got {mode!r}", param="mode")
        await self.engine.pause(mode)  # type: ignore[arg-type]
        return {"status": "paused"}

    async def resume(self) -> dict:
        await self.engine.resume()
        return {"status": "resumed"}

    def is_paused(self) -> dict:
        return {"is_paused": self.engine.is_paused()}

    async def sleep(self, level: int, mode: str = "abort") -> dict:
        """In-flight requests are aborted (mode=abort) or finished first (mode=wait; the engine
        then stays paused until it is fully awake again). A sleeping engine refuses new work
        (503) either way."""
        if level not in (1, 2):
            raise InvalidRequestError(f"level must be 1 (weights to CPU) or 2 (weights dropped), got {level}",
                                      param="level")
        if mode not in ("abort", "wait"):
            raise InvalidRequestError("sleep mode must be abort or wait: keep would need the KV cache "
                                      "that sleeping frees", param="mode")
        if mode == "wait" and not self.engine.is_sleeping() and not self.engine.is_paused():
            await self.engine.pause(mode)  # type: ignore[arg-type]
            self._resume_on_wake = True
        # Always to the engine, asleep or not: one whose KV cache sleeps may hold weights woken
        # for a sync (beside a trainer), which this sleep drops. abort: the engine's sleep aborts
        # what is in flight itself, in the same step (one trip to its thread, on a preemption path)
        await self.engine.sleep(level)
        # the release confirmation: what this process still holds on its device, measured
        report = self.engine.sleep_report() if hasattr(self.engine, "sleep_report") else {}
        return {"status": "sleeping", "level": level, "memory": {**self.memory(), **report}}

    def memory(self) -> dict:
        return self.engine.device_memory().as_dict()

    async def wake_up(self, tags: list[str] | None) -> dict:
        """`tags` (the query's): some of weights and kv_cache, checked before anything wakes."""
        tags = tags or None
        if tags is not None and (len(tags) > len(WAKE_TAGS) or any(t not in WAKE_TAGS for t in tags)):
            raise InvalidRequestError(f"tags must be some of {list(WAKE_TAGS)} (each once)", param="tags")
        await self.engine.wake_up(tags)
        awake = not self.engine.is_sleeping()
        if awake and self._resume_on_wake:
            self._resume_on_wake = False
            await self.engine.resume()
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    def is_sleeping(self) -> dict:
        return {"is_sleeping": self.engine.is_sleeping()}

    async def abort_requests(self, body: AbortRequestsBody) -> dict:
        ids = body.request_ids or None
        if ids is None:
            return {"status": "aborted", "aborted": await self.engine.abort(None)}
        # callers may use the request_id they gave /inference/v1/generate; like vLLM, the count
        # is of the ids asked for
        await self.engine.abort([i for rid in ids for i in (rid, f"generate-tokens-{rid}")])
        return {"status": "aborted", "aborted": len(ids)}

    def updater(self) -> ShardUpdater:
        if self._updater is None:
            self._updater = ShardUpdater(self.engine, device=self.engine.device)
        return self._updater

    def init_weight_transfer_engine(self, info: InitTransferInfo) -> dict:
        """With a `layout`, set up bucket receiving now: a layout that does not match the model
        is refused here, before any update starts."""
        if self._updating is not None:
            raise WeightUpdateError("cannot re-initialise the weight transfer during an update")
        init_info = info.model_dump(exclude_none=True)
        if info.layout is not None:
            details = self.updater().init_transfer(init_info)
            if info.idle_timeout_s is not None:
                self.idle_timeout_s = info.idle_timeout_s
            self.transfer_info = init_info
            return {"message": "Weight transfer initialized", **details}
        self.transfer_info = init_info
        return {"message": "Weight transfer initialized"}

    async def start_weight_update(self, body: StartWeightUpdateBody) -> dict:
        version = self.engine.weight_version + 1 if body.weight_version is None else body.weight_version
        if self._updating is not None:
            raise WeightUpdateError(f"an update to version {self._updating} is already in progress")
        if body.layout_id is not None:
            await self.updater().start(version, body.layout_id, body.transfer)
            self._bucketed = True
            self._touch()
        else:
            await self.engine.start_weight_update(version)
            self._bucketed = False
        self._updating = version
        return {"message": "Weight update started"}

    async def update_weights(self, tensors: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]
                             ) -> dict:
        """`tensors` may be a loader, so that a body that does not parse aborts the update too."""
        if self._updating is None:
            raise WeightUpdateError("no weight update in progress: call /start_weight_update first")
        if self._bucketed:
            await self._abort_update("safetensors body during a bucket update")
            raise WeightUpdateError("this update was started for packed buckets; a safetensors body "
                                    "cannot join it; update aborted, old weights keep serving")
        try:
            await self.engine.update_weights(tensors() if callable(tensors) else tensors)
        except Exception as exc:
            await self._abort_update(f"update_weights failed: {exc}")
            raise WeightUpdateError(f"update refused, old weights keep serving: {exc}") from None
        return {"message": "Weights updated"}

    async def update_bucket(self, message: dict[str, Any]) -> dict:
        """One bucket's transport message; the receiver aborts the update itself on failure."""
        if self._updating is None or not self._bucketed:
            raise WeightUpdateError("no bucket update in progress: start one with a layout_id first")
        self._touch()
        try:
            await self.updater().bucket(message)
        except Exception:
            self._updating, self._bucketed = None, False
            raise
        self._touch()
        return {"message": "Weights updated", "bucket": message.get("bucket")}

    async def finish_weight_update(self, body: FinishWeightUpdateBody) -> dict:
        if self._updating is None:
            raise WeightUpdateError("no weight update in progress: call /start_weight_update first")
        named = body.weight_version
        if named is not None and named != self._updating:
            started = self._updating
            await self._abort_update("version mismatch")
            raise WeightUpdateError(f"finish names version {named} but the update started as "
                                    f"{started}; update aborted, old weights keep serving")
        try:
            if self._bucketed:
                await self.updater().finish(self._updating)
            else:
                await self.engine.finish_weight_update()
        except Exception as exc:
            await self._abort_update(f"finish failed: {exc}")
            raise WeightUpdateError(f"finish refused, old weights keep serving: {exc}") from None
        self._updating, self._bucketed = None, False
        return {"message": "Weight update finished"}  # vLLM's answer, key for key

    async def sync_weights(self, body: SyncWeightsBody) -> dict:
        """rlix extension: [wake up,] start, every bucket message, finish, in one call. The whole
        body is checked before anything changes; a failure after the start aborts the update
        (the old weights keep serving). Answers the version the engine serves afterwards."""
        messages = [bucket_message(u) for u in body.updates]
        if any(m is None for m in messages):
            raise InvalidRequestError("updates must be a non-empty list of bucket messages "
                                      "(each like an /update_weights update_info)", param="updates")
        t = [time.perf_counter()]
        if body.wake_up:
            await self.wake_up(None if body.wake_up is True else list(body.wake_up))
        t.append(time.perf_counter())
        await self.start_weight_update(StartWeightUpdateBody(
            weight_version=body.weight_version, layout_id=body.layout_id, transfer=body.transfer))
        t.append(time.perf_counter())
        for message in messages:
            await self.update_bucket(message)  # type: ignore[arg-type]
        t.append(time.perf_counter())
        await self.finish_weight_update(FinishWeightUpdateBody(weight_version=body.weight_version))
        t.append(time.perf_counter())
        # where the last one-call sync's time went (transfer_status shows it)
        self.last_sync_ms = {k: round(1000 * (b - a), 3)
                             for k, a, b in zip(("wake", "start", "buckets", "finish"), t, t[1:])}
        return {"message": "Weight update finished", "weight_version": self.engine.weight_version,
                "is_sleeping": self.engine.is_sleeping(), "phases_ms": self.sync_phases_ms()}

    def sync_phases_ms(self) -> dict[str, float]:
        """The last one-call sync's phases, with the receiver's split of its buckets."""
        buckets = self._updater.bucket_ms if self._updater is not None else {}
        return {**self.last_sync_ms, **{f"bucket_{k}": v for k, v in buckets.items()}}

    async def abort_weight_update(self, body: AbortWeightUpdateBody) -> dict:
        """rlix extension: drop the update in progress (if any); the old weights keep serving."""
        reason = body.reason
        aborted = self._updating is not None
        if aborted:
            await self._abort_update(str(reason or "aborted by the caller"))
        return {"message": "Weight update aborted" if aborted else "No weight update in progress"}

    def transfer_status(self) -> dict:
        """rlix extension: the update in progress and why the last one failed, if it did."""
        updater = self._updater
        got, total = updater.progress() if updater is not None else (0, 0)
        return {"weight_version": self.engine.weight_version, "updating": self._updating,
                "buckets_received": got, "buckets_total": total,
                "last_error": updater.last_error if updater is not None else None,
                "last_sync_ms": dict(self.last_sync_ms),
                "last_buckets_ms": dict(updater.bucket_ms) if updater is not None else {}}

    def _touch(self) -> None:
        """Note sender activity; a watchdog aborts a bucket update whose sender went quiet, so a
        driver that died mid-transfer leaves the old weights serving and the shard syncable."""
        self._last_activity = time.monotonic()
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self._updating is not None and self._bucketed:
            idle = time.monotonic() - self._last_activity
            if idle >= self.idle_timeout_s:
                got, total = self.updater().progress()
                await self._abort_update(
                    f"no message from the sender for {idle:.1f}s (after {got} of {total} buckets of "
                    f"version {self._updating}); update aborted, old weights keep serving")
                return
            await asyncio.sleep(min(self.idle_timeout_s - idle, 1.0) + 0.01)

    async def _abort_update(self, reason: str) -> None:
        bucketed, self._updating, self._bucketed = self._bucketed, None, False
        if bucketed:
            await self.updater().abort(reason)
        else:
            await self.engine.abort_weight_update(reason)

    def weight_info(self) -> dict:
        return {"weight_version": str(self.engine.weight_version)}

    async def weight_checksums(self) -> dict:
        """Checksums of every served tensor, computed on the engine's device (rlix extension)."""
        checksums = await self.engine.weight_checksums()
        return {"weight_version": self.engine.weight_version, "checksums": checksums}

    @staticmethod
    def tensors_from_json(body: UpdateWeightsBody) -> dict[str, torch.Tensor]:
        data = body.update_info.safetensors_b64
        if data is None:
            raise InvalidRequestError("JSON /update_weights needs {\"update_info\": {\"safetensors_b64\": "
                                      "...}}; or send the safetensors file as application/octet-stream",
                                      param="update_info")
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError:
            raise InvalidRequestError("update_info.safetensors_b64 is not base64", param="update_info") from None
        return decode_safetensors(raw)


def bucket_message(info: Any) -> dict[str, Any] | None:
    """The transport message in an `update_info`, or None if it is not one. Messages that are not
    plain JSON (CUDA IPC handles) come pickled: control endpoints need the bearer token, and the
    servers bind 127.0.0.1."""
    if not isinstance(info, dict):
        return None
    if "message_b64" in info:
        try:
            message = pickle.loads(base64.b64decode(info["message_b64"], validate=True))
        except Exception as exc:
            raise InvalidRequestError(f"update_info.message_b64 does not decode: {exc}",
                                      param="update_info") from None
        return message if isinstance(message, dict) else None
    return dict(info) if "bucket" in info else None


def control_routes(control: ControlPlane) -> APIRouter:
    """The control plane's HTTP face: each route parses its body into its model (control_schema)
    and hands it to `control`; the server's app mounts it beside the data plane."""
    router = APIRouter()

    async def query_only(request: Request) -> None:
        """A body on a query-parameter endpoint: empty or {}, else 400 before anything happens."""
        parse_body(C.QueryOnlyBody, await json_body(request))

    @router.post("/pause")
    async def pause(request: Request, mode: str = Query("abort"), clear_cache: bool = Query(True)) -> JSONResponse:
        await query_only(request)
        return JSONResponse(await control.pause(mode))

    @router.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        await query_only(request)
        return JSONResponse(await control.resume())

    @router.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse(control.is_paused())

    @router.post("/sleep")
    async def sleep(request: Request, level: int = Query(1), mode: str = Query("abort")) -> JSONResponse:
        await query_only(request)
        return JSONResponse(await control.sleep(level, mode))

    @router.post("/wake_up")
    async def wake_up(request: Request) -> JSONResponse:
        await query_only(request)
        return JSONResponse(await control.wake_up(request.query_params.getlist("tags")))

    @router.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse(control.is_sleeping())

    @router.post("/abort_requests")
    async def abort_requests(request: Request) -> JSONResponse:
        body = parse_body(C.AbortRequestsBody, await json_body(request, required=True))
        return JSONResponse(await control.abort_requests(body))

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(request: Request) -> JSONResponse:
        body = parse_body(C.InitTransferBody, await json_body(request, required=True))
        return JSONResponse(control.init_weight_transfer_engine(body.init_info))

    @router.post("/start_weight_update")
    async def start_weight_update(request: Request) -> JSONResponse:
        body = parse_body(C.StartWeightUpdateBody, await json_body(request))
        return JSONResponse(await control.start_weight_update(body))

    @router.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        raw = await request.body()
        if request.headers.get("content-type", "").startswith("application/octet-stream"):
            return JSONResponse(await control.update_weights(lambda: decode_safetensors(raw)))
        try:
            body = parse_body(C.UpdateWeightsBody, json.loads(raw or b"null"))
        except (ValueError, RecursionError, InvalidRequestError) as exc:  # the update in progress is aborted too
            error = exc
            return JSONResponse(await control.update_weights(lambda: _raise(error)))
        message = bucket_message(body.update_info.model_dump(exclude_none=True))
        if message is not None:
            return JSONResponse(await control.update_bucket(message))
        return JSONResponse(await control.update_weights(lambda: control.tensors_from_json(body)))

    @router.post("/finish_weight_update")
    async def finish_weight_update(request: Request) -> JSONResponse:
        body = parse_body(C.FinishWeightUpdateBody, await json_body(request))
        return JSONResponse(await control.finish_weight_update(body))

    @router.post("/sync_weights")
    async def sync_weights(request: Request) -> JSONResponse:
        body = parse_body(C.SyncWeightsBody, await json_body(request, required=True))
        return JSONResponse(await control.sync_weights(body))

    @router.post("/abort_weight_update")
    async def abort_weight_update(request: Request) -> JSONResponse:
        body = parse_body(C.AbortWeightUpdateBody, await json_body(request))
        return JSONResponse(await control.abort_weight_update(body))

    @router.get("/weight_transfer_status")
    async def weight_transfer_status() -> JSONResponse:
        return JSONResponse(control.transfer_status())

    @router.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse(control.weight_info())

    @router.get("/weight_checksums")
    async def weight_checksums() -> JSONResponse:
        return JSONResponse(await control.weight_checksums())

    return router


def _raise(exc: Exception) -> Any:
    raise exc
