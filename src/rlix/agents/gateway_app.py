"""The policy gateway's HTTP face: POST /v1/chat/completions, POST /v1/responses, GET /v1/models,
GET /health, served on the pipeline's data-plane loop (next to its router)."""

from __future__ import annotations

import asyncio
import hmac
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlix.agents.gateway import PolicyGateway
from rlix.errors import InferenceError, InvalidRequestError, NoActiveShardError
from rlix.httpkit import free_port
from rlix.inference.server.openai_schema import error_body


def create_gateway_app(gateway: PolicyGateway, api_key: str) -> FastAPI:
    app = FastAPI(title="rlix policy gateway", docs_url=None, redoc_url=None)
    expected = f"Bearer {api_key}".encode()

    def authorised(request: Request) -> bool:
        return hmac.compare_digest(request.headers.get("authorization", "").encode(), expected)

    async def call(request: Request, handler) -> JSONResponse:  # type: ignore[no-untyped-def]
        if not authorised(request):
            return JSONResponse(error_body("Unauthorized", "AuthenticationError", 401), status_code=401)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return JSONResponse(error_body(f"the body is not JSON: {exc}", "BadRequestError", 400), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the body must be a JSON object", "BadRequestError", 400), status_code=400)
        try:
            return JSONResponse(await handler(body, request.headers.get("x-session-id")))
        except InvalidRequestError as exc:
            return JSONResponse(error_body(str(exc), "BadRequestError", 400), status_code=400)
        except NoActiveShardError as exc:
            return JSONResponse(error_body(str(exc), "ServiceUnavailableError", 503), status_code=503)
        except InferenceError as exc:
            return JSONResponse(error_body(str(exc), "InternalServerError", 502), status_code=502)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        return await call(request, gateway.chat)

    @app.post("/v1/responses")
    async def responses(request: Request) -> JSONResponse:
        return await call(request, gateway.responses)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": gateway.model_name, "object": "model",
                                                         "owned_by": "rlix"}]})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "open_episodes": gateway.open_episodes()})

    return app


#: at shutdown, agents' calls still in flight get this long before their connections are closed
STOP_GRACE_S = 2.0


class GatewayServer:
    """uvicorn inside the running loop (the pipeline's data-plane thread)."""

    def __init__(self, gateway: PolicyGateway, api_key: str, host: str = "127.0.0.1") -> None:
        self.host, self.port = host, free_port(host)
        config = uvicorn.Config(create_gateway_app(gateway, api_key), host=host, port=self.port,
                                log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=STOP_GRACE_S)
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await self._task
