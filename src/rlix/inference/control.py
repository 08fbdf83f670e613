"""The engine server's control plane as a plain class: pause, sleep, abort, weight updates.

Answers have vLLM's shapes (dev-mode endpoints of vLLM 0.32). Weight updates in this issue go
over HTTP as safetensors: POST /update_weights with the raw safetensors file as the body
(Content-Type: application/octet-stream), or JSON `{"update_info": {"safetensors_b64": "..."}}`.
Versions are integers (the trainer's step); `/start_weight_update` may name the version
(`{"weight_version": 3}`), otherwise it is the serving version + 1. Any failure aborts the whole
update, so the old weights keep serving; the caller starts again.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlix.errors import InvalidRequestError, WeightUpdateError
from rlix.inference.api import EngineAPI

PAUSE_MODES = ("abort", "wait", "keep")


def parse_version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"weight_version must be an integer (a trainer step), got {value!r}",
                                  param="weight_version") from None


def decode_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

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
        self._resume_on_wake = False

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
        """In-flight requests are aborted (mode=abort) or finished first (mode=wait); the engine
        stays paused until it is fully awake again."""
        if level not in (1, 2):
            raise InvalidRequestError(f"level must be 1 (weights to CPU) or 2 (weights dropped), got {level}",
                                      param="level")
        if mode not in ("abort", "wait"):
            raise InvalidRequestError("sleep mode must be abort or wait: keep would need the KV cache "
                                      "that sleeping frees", param="mode")
        if not self.engine.is_sleeping():
            if not self.engine.is_paused():
                await self.engine.pause(mode)  # type: ignore[arg-type]
                self._resume_on_wake = True
            await self.engine.sleep(level)
        return {"status": "sleeping", "level": level}

    async def wake_up(self, tags: list[str] | None) -> dict:
        tags = tags or None
        await self.engine.wake_up(tags)
        awake = not self.engine.is_sleeping()
        if awake and self._resume_on_wake:
            self._resume_on_wake = False
            await self.engine.resume()
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    def is_sleeping(self) -> dict:
        return {"is_sleeping": self.engine.is_sleeping()}

    async def abort_requests(self, body: Any) -> dict:
        if not isinstance(body, dict):
            raise InvalidRequestError("Request body must be a JSON object")
        ids = body.get("request_ids") or None
        if ids is None:
            return {"status": "aborted", "aborted": await self.engine.abort(None)}
        # callers may use the request_id they gave /inference/v1/generate; like vLLM, the count
        # is of the ids asked for
        await self.engine.abort([i for rid in ids for i in (rid, f"generate-tokens-{rid}")])
        return {"status": "aborted", "aborted": len(ids)}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> dict:
        self.transfer_info = dict(init_info)
        return {"message": "Weight transfer initialized"}

    async def start_weight_update(self, body: Any) -> dict:
        version = body.get("weight_version") if isinstance(body, dict) else None
        version = self.engine.weight_version + 1 if version is None else parse_version(version)
        await self.engine.start_weight_update(version)
        self._updating = version
        return {"message": "Weight update started"}

    async def update_weights(self, tensors: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]]
                             ) -> dict:
        """`tensors` may be a loader, so that a body that does not parse aborts the update too."""
        if self._updating is None:
            raise WeightUpdateError("no weight update in progress: call /start_weight_update first")
        try:
            await self.engine.update_weights(tensors() if callable(tensors) else tensors)
        except Exception as exc:
            await self._abort_update(f"update_weights failed: {exc}")
            raise WeightUpdateError(f"update refused, old weights keep serving: {exc}") from None
        return {"message": "Weights updated"}

    async def finish_weight_update(self, body: Any) -> dict:
        if self._updating is None:
            raise WeightUpdateError("no weight update in progress: call /start_weight_update first")
        named = body.get("weight_version") if isinstance(body, dict) else None
        if named is not None and parse_version(named) != self._updating:
            started = self._updating
            await self._abort_update("version mismatch")
            raise WeightUpdateError(f"finish names version {named} but the update started as "
                                    f"{started}; update aborted, old weights keep serving")
        try:
            await self.engine.finish_weight_update()
        except Exception as exc:
            await self._abort_update(f"finish failed: {exc}")
            raise WeightUpdateError(f"finish refused, old weights keep serving: {exc}") from None
        self._updating = None
        return {"message": "Weight update finished"}

    async def _abort_update(self, reason: str) -> None:
        self._updating = None
        await self.engine.abort_weight_update(reason)

    def weight_info(self) -> dict:
        return {"weight_version": str(self.engine.weight_version)}

    @staticmethod
    def tensors_from_json(body: Any) -> dict[str, torch.Tensor]:
        info = body.get("update_info") if isinstance(body, dict) else None
        data = info.get("safetensors_b64") if isinstance(info, dict) else None
        if not isinstance(data, str):
            raise InvalidRequestError("JSON /update_weights needs {\"update_info\": {\"safetensors_b64\": "
                                      "...}}; or send the safetensors file as application/octet-stream",
                                      param="update_info")
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError:
            raise InvalidRequestError("update_info.safetensors_b64 is not base64", param="update_info") from None
        return decode_safetensors(raw)
