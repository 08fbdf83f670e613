"""The engine server: a FastAPI app around one EngineAPI, speaking vLLM's HTTP API.

Handlers only parse and delegate: data plane (here) to `OpenAIServing`, control plane (its
routes in control.py, mounted here) to `ControlPlane`. Auth follows vLLM where vLLM has it (/v1 and /inference need the bearer token)
and goes further on the control plane, which always needs it (vLLM leaves its dev endpoints
open). Errors carry vLLM's body `{"error": {"message", "type", "param", "code"}}`; an
unauthorised call gets 401 `{"error": "Unauthorized"}`, as from vLLM.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from pydantic import ValidationError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from rlix.errors import (EngineStateError, InvalidRequestError, ModelNotFoundError,
                         ResponseNotFoundError, WeightUpdateError)
from rlix.devices import cap_process_memory
from rlix.httpkit import (MAX_BODY_BYTES, MAX_CONTROL_BODY_BYTES, BodyPolicy, RequestGuard, replay_body,
                          bounded_http_protocol)
from rlix.inference.engine.api import EngineAPI
from rlix.inference.engine.engine import TorchEngine
from rlix.inference.server import openai_schema as S
from rlix.inference.server.control import ControlPlane, control_routes
from rlix.inference.server.control_schema import json_body
from rlix.inference.server.limits import MAX_TRANSFER_BODY_BYTES, weights_body_limit
from rlix.inference.server.paths import (CONTROL_PATHS, DATA_PLANE_PREFIXES, GENERATE, PROTECTED_PREFIXES,
                                        RESPONSES, TRANSFER_PATHS, WEIGHTS_PATH)
from rlix.inference.server.generation_log import GenerationLog
from rlix.inference.server.metrics import EngineMetrics
from rlix.inference.server.responses_service import EngineChat, ResponsesService
from rlix.inference.server.responses_store import ResponseStore, StoreLimits
from rlix.inference.server.serving import OpenAIServing
from rlix.models.presets import resolve_model
from rlix.threads import favour_control_latency

log = logging.getLogger("rlix.server")

#: request bodies up to this size are turned into a Job on the HTTP loop; larger ones (long
#: prompts: tokenizing 1 MiB of text takes ~1 s of CPU) in a worker thread, so that the loop
#: keeps answering /health and the control calls meanwhile
INLINE_PREPARE_BYTES = 64 * 2**10
#: the validation errors an answer lists (a body can hold thousands)
SHOWN_ERRORS = 8


def body_policies(max_body: int, weights_max: int) -> Any:
    """The engine server's `BodyPolicy` per path (see RequestGuard): the data plane `max_body`
    and watched; /update_weights, which carries weights, `weights_max` (a safetensors body is
    not JSON); the weight-transfer calls that carry a layout or every bucket's message
    MAX_TRANSFER_BODY_BYTES; every other path (the control plane) MAX_CONTROL_BODY_BYTES."""
    data = BodyPolicy(max_body, watch=True)
    weights = BodyPolicy(weights_max, binary=True)
    transfer = BodyPolicy(MAX_TRANSFER_BODY_BYTES)
    control = BodyPolicy(MAX_CONTROL_BODY_BYTES)

    def policy(path: str) -> BodyPolicy:
        if path.startswith(DATA_PLANE_PREFIXES):
            return data
        if path == WEIGHTS_PATH:
            return weights
        return transfer if path in TRANSFER_PATHS else control

    return policy


def _err(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(S.error_body(message, type_, status, param), status_code=status)


#: rlix errors -> (HTTP status, error type, whether the error names a parameter); most specific first
ERROR_ANSWERS: tuple[tuple[type[Exception], int, str, bool], ...] = (
    (ModelNotFoundError, 404, "NotFoundError", True),
    (ResponseNotFoundError, 404, "invalid_request_error", True),  # vLLM's type for it
    (InvalidRequestError, 400, "BadRequestError", True),
    (WeightUpdateError, 400, "BadRequestError", False),
    (EngineStateError, 503, "ServiceUnavailableError", False),
)


def validation_answer(errors: list[dict[str, Any]]) -> JSONResponse:
    """The 400 for a body that does not validate (FastAPI's RequestValidationError, worded as
    vLLM words it): the first SHOWN_ERRORS errors listed, `param` the first one's location."""
    lines = "\n  ".join(f"{{'type': {e.get('type')!r}, 'loc': {'.'.join(map(str, e.get('loc', ())))!r}, "
                        f"'msg': {e.get('msg')!r}}}" for e in errors[:SHOWN_ERRORS])
    if len(errors) > SHOWN_ERRORS:
        lines += f"\n  ... and {len(errors) - SHOWN_ERRORS} more"
    param = ".".join(map(str, errors[0].get("loc", ()))) if errors else None
    n = len(errors)
    return _err(400, f"{n} validation error{'s' if n != 1 else ''}:\n  {lines}", "Bad Request", param)


def error_answer(exc: Exception) -> JSONResponse | None:
    """The answer the app gives for this error, or None if it is not one of ours."""
    for cls, status, type_, with_param in ERROR_ANSWERS:
        if isinstance(exc, cls):
            return _err(status, str(exc), type_, getattr(exc, "param", None) if with_param else None)
    return None


class FastGenerate:
    """Serves non-streamed POST /inference/v1/generate (what rollouts send) without FastAPI's
    routing and per-request exit stacks: about half of a shard's HTTP-loop CPU under rollout
    load went to that machinery (py-spy), and the same loop answers the control calls a
    preemption waits for. Anything else (a body that does not validate, streaming, other
    paths) goes to the app unchanged, so its answers, errors included, stay the app's.

    Except a large body (over INLINE_PREPARE_BYTES): parsed once here and answered here
    whatever it is (its errors worded as the app words them, a stream streamed), since the
    app would parse it again: a 4 MiB body's JSON costs 60-80 ms of this loop per parse."""

    def __init__(self, app: Any, serving: OpenAIServing) -> None:
        self.app, self.serving = app, serving

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != GENERATE:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if len(body) > INLINE_PREPARE_BYTES:
            await self._large(body, scope, receive, send)
            return
        try:
            req = S.GenerateRequest.model_validate_json(body)
        except ValueError:  # pydantic's ValidationError included: the app words the 400
            req = None
        if req is None or req.stream:
            await self.app(scope, replay_body(body, receive), send)
            return
        await self._serve(req, scope, receive, send)

    async def _serve(self, req: S.GenerateRequest, scope: dict, receive: Any, send: Any) -> None:
        try:
            job = self.serving.prepare_generate(req)
            if job.stream:
                answer: Response = StreamingResponse(self.serving.generate_stream(job),
                                                     media_type="text/event-stream")
            else:
                answer = JSONResponse(await self.serving.generate(job))
        except Exception as exc:
            refusal = error_answer(exc)
            if refusal is None:
                raise
            answer = refusal
        await answer(scope, receive, send)

    async def _large(self, body: bytes, scope: dict, receive: Any, send: Any) -> None:
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:  # as FastAPI words it
            await validation_answer([{"type": "json_invalid", "loc": ("body", exc.pos),
                                      "msg": "JSON decode error"}])(scope, receive, send)
            return
        except (UnicodeDecodeError, RecursionError):
            await _err(400, "Invalid JSON format", "Bad Request")(scope, receive, send)
            return
        try:
            req = S.GenerateRequest.model_validate(data)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
            await validation_answer(errors)(scope, receive, send)
            return
        await self._serve(req, scope, receive, send)


def _large(request: Request) -> bool:
    """A body worth preparing off the HTTP loop (INLINE_PREPARE_BYTES; chunked: unknown, so yes)."""
    length = request.headers.get("content-length")
    return length is None or not length.isdigit() or int(length) > INLINE_PREPARE_BYTES


async def _prepare(request: Request, prepare: Any, *args: Any) -> Any:
    """`prepare(*args)` (validation, chat template, tokenizing) on the loop for a small body, in
    a worker thread for a large one."""
    if _large(request):
        return await asyncio.to_thread(prepare, *args)
    return prepare(*args)


class BearerAuth:
    """Refuses control and API paths without the bearer token; plain ASGI on purpose: Starlette's
    `@app.middleware("http")` runs each request in a task group with memory streams, which was a
    third of a shard's HTTP-loop CPU under rollout load (profiled), and that loop also answers
    the control calls a preemption waits for.

    `expected` None (a server started without a key, as vLLM without --api-key): the data plane
    (the OpenAI API, tokenize, generate) is open to whoever reaches the bind address, and the
    control plane (pause, sleep, weights) is refused to everyone: it can stop or replace the
    model, so it is never open."""

    def __init__(self, app: Any, expected: bytes | None) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            control = path in CONTROL_PATHS
            if control or path.startswith(PROTECTED_PREFIXES):
                got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
                if self.expected is None:
                    allowed = not control
                else:
                    allowed = hmac.compare_digest(got, self.expected)
                if not allowed:
                    await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def create_app(engine: EngineAPI, tokenizer: Any, model_name: str, api_key: str | None,
               model_root: str = "", close_engine: bool = False,
               max_body: int = MAX_BODY_BYTES, generation_log: GenerationLog | None = None,
               responses_store: StoreLimits = StoreLimits()) -> FastAPI:
    """The app for one engine. `close_engine` closes it when the app shuts down; a data-plane
    request body over `max_body` bytes gets 413 (the control plane's bounds: `body_policies`);
    `generation_log` records every token-level generate; `responses_store` bounds the stored
    responses (/v1/responses). `api_key` None: the data plane open, the control plane refused
    (BearerAuth)."""
    metrics = EngineMetrics(engine, model_name)  # GET /metrics, vLLM's names
    serving = OpenAIServing(engine, tokenizer, model_name, model_root, generation_log, metrics)
    control = ControlPlane(engine)
    responses_service = ResponsesService(ResponseStore(responses_store))
    expected = f"Bearer {api_key}".encode() if api_key is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        close = getattr(engine, "close", None)
        if close_engine and close is not None:
            close()

    app = FastAPI(title="rlix engine server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving, app.state.control = serving, control

    app.add_middleware(FastGenerate, serving=serving)
    # every path: a body bounded by its path's limit (413 unread) and JSON nesting (400), before
    # any handler; on the data plane a caller that leaves aborts its request
    app.add_middleware(RequestGuard, policy=body_policies(max_body, weights_body_limit(engine)))
    app.add_middleware(BearerAuth, expected=expected)  # added last: runs first

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_answer(list(exc.errors()))

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        answer = error_answer(exc)
        assert answer is not None  # registered only for ERROR_ANSWERS' classes
        return answer

    for cls, *_ in ERROR_ANSWERS:
        app.add_exception_handler(cls, on_error)

    # ------------------------------------------------------------ data plane
    @app.get("/health")
    async def health() -> Response:
        failure = engine.failure()
        if failure is not None:  # broken for good (a tensor-parallel rank gone): replace this server
            return Response(failure, status_code=503, media_type="text/plain")
        return Response(status_code=200)

    @app.get("/version")  # open like /health (not under PROTECTED_PREFIXES), as in vLLM
    async def version() -> JSONResponse:
        return JSONResponse(S.version_response())

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(serving.models())

    @app.post("/tokenize")
    async def tokenize(req: S.TokenizeRequest, request: Request) -> JSONResponse:
        return JSONResponse(await _prepare(request, serving.tokenize, req))

    @app.post("/detokenize")
    async def detokenize(req: S.DetokenizeRequest, request: Request) -> JSONResponse:
        return JSONResponse(await _prepare(request, serving.detokenize, req))

    @app.post("/v1/completions")
    async def completions(req: S.CompletionRequest, request: Request) -> Response:
        jobs = await _prepare(request, serving.prepare_completion, req)
        if jobs[0].stream:
            return StreamingResponse(serving.completion_stream(jobs), media_type="text/event-stream")
        return JSONResponse(await serving.completion(jobs))

    @app.post("/v1/chat/completions")
    async def chat(req: S.ChatCompletionRequest, request: Request) -> Response:
        job = await _prepare(request, serving.prepare_chat, req)
        if job.stream:
            return StreamingResponse(serving.chat_stream(job), media_type="text/event-stream")
        return JSONResponse(await serving.chat(job))

    @app.post(RESPONSES)  # the Responses API, answered by a chat completion (responses_service.py)
    async def responses(request: Request) -> Response:
        body = await json_body(request, required=True)
        if not isinstance(body, dict):
            raise InvalidRequestError("Request body must be a JSON object")
        # a continued conversation (up to a context's worth of stored turns) is rendered off
        # the loop whatever the size of this body
        offload = _large(request) or body.get("previous_response_id") is not None
        answer = await responses_service.create(body, EngineChat(serving, offload=offload))
        if isinstance(answer, dict):
            return JSONResponse(answer)
        return StreamingResponse(answer, media_type="text/event-stream")

    @app.get(RESPONSES + "/{response_id}")  # a stored response (vLLM's route)
    async def retrieve_response(response_id: str, stream: bool = False) -> JSONResponse:
        if stream:
            raise InvalidRequestError("stream=true replays a background response's events; this server "
                                      "runs none (background: true is refused)", param="stream")
        return JSONResponse(responses_service.retrieve(response_id))

    @app.post(GENERATE)  # non-streamed valid bodies are served by FastGenerate
    async def generate(req: S.GenerateRequest) -> Response:
        job = serving.prepare_generate(req)
        if job.stream:
            return StreamingResponse(serving.generate_stream(job), media_type="text/event-stream")
        return JSONResponse(await serving.generate(job))

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(control_routes(control))

    return app


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None,
          device: str = "cpu", max_num_seqs: int = 64, max_model_len: int | None = None,
          served_model_name: str | None = None, dtype: str | None = None,
          max_body: int = MAX_BODY_BYTES, record_generations: str | None = None,
          memory_share: float = 1.0, threads: int | None = None, capture_graphs: bool = False,
          responses_store: StoreLimits = StoreLimits(), tensor_parallel_size: int = 1) -> None:
    """Load the embedded engine and serve it until interrupted (what `rlix serve` runs).
    `memory_share`: the fraction of the GPU's memory this server may allocate (a slice).
    `threads`: torch CPU threads of the engine (default: torch's). On CPU only the engine's
    thread computes with them; this thread loads with one: libgomp keeps a thread team per
    thread that starts parallel regions, and with more of them than cores every region of the
    engine's forward paid for waking its team.
    `capture_graphs`: on CUDA, every CUDA graph is captured before the server listens (a
    graph otherwise is captured by the first step that needs its shape, on that step's path).
    `api_key` None: the OpenAI data plane open, the control plane refused (BearerAuth).
    `tensor_parallel_size` > 1: the model split over that many devices (runner/tp/group.py)."""
    favour_control_latency()  # the HTTP loop answers control calls beside the engine thread
    cap_process_memory(device, memory_share)
    path = resolve_model(model)
    compute_threads = threads or torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    engine = TorchEngine.from_pretrained(path, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                                         max_model_len=max_model_len, compute_threads=compute_threads,
                                         tensor_parallel_size=tensor_parallel_size)
    if capture_graphs and device == "cuda":
        asyncio.run(engine.capture_graphs())
    app = create_app(engine, engine.tokenizer, served_model_name or model, api_key,
                     model_root=str(path), close_engine=True, max_body=max_body,
                     generation_log=GenerationLog(record_generations) if record_generations else None,
                     responses_store=responses_store)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                http=bounded_http_protocol())  # request heads bounded too
