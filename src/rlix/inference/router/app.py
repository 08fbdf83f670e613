"""The router's HTTP face: an ASGI app in front of a pipeline's engine servers.

It runs in-process (`RouterServer`, on a DataPlaneThread's loop or a test's) or as its own process
(`python -m rlix.inference.router`). Data plane (open, like the shards' /health; bind it to
127.0.0.1): /v1/completions, /v1/chat/completions, /inference/v1/generate (sticky by
`X-Session-ID`, least outstanding otherwise, re-dispatched on preemption; see relay.py),
/v1/models, /tokenize, /detokenize passed to any active shard, and the router's own /health,
/version (rlix's, vLLM's shape) and /metrics (metrics.py). Admin (bearer token): GET/POST
/router/shards, DELETE /router/shards/{rank}; `RouterAdminClient` is the fleet's handle on them.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import sys
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from rlix import env
from rlix.errors import InvalidRequestError, NoActiveShardError, ResponseNotFoundError, UpstreamAnswerError
from rlix.httpkit import (MAX_BODY_BYTES, MAX_CONTROL_BODY_BYTES, BodyPolicy, RequestGuard, bearer,
                          bounded_http_protocol, free_port)
from rlix.inference.router.metrics import RouterMetrics
from rlix.inference.router.router import Router
from rlix.inference.router.shard_table import ShardState
from rlix.inference.server import openai_schema as S
from rlix.inference.server.control_schema import RouterShardBody, parse_body
from rlix.inference.server.limits import check_bounds
from rlix.inference.server.paths import CHAT, COMPLETIONS, GENERATE, RESPONSES
from rlix.inference.server.responses_service import ResponsesService
from rlix.inference.server.responses_store import ResponseStore, StoreLimits


#: the admin API's paths (small JSON bodies: MAX_CONTROL_BODY_BYTES)
ADMIN_PREFIX = "/router/"


def _prompt_logprobs(path: str, body: dict) -> str | None:
    """The field asking for prompt logprobs, when a request asks for them (else None)."""
    if path == GENERATE:
        sp = body.get("sampling_params")
        asked = isinstance(sp, dict) and sp.get("prompt_logprobs") is not None
        return "sampling_params.prompt_logprobs" if asked else None
    return "prompt_logprobs" if body.get("prompt_logprobs") is not None else None


def _several_prompts(prompt: Any) -> bool:
    """A completions `prompt` that lists more than one prompt (strings or token-id lists)."""
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def body_policy(max_body: int) -> Any:
    """The router's `BodyPolicy` per path: the data plane `max_body`, watched (a caller that
    goes away cancels its request); the admin API MAX_CONTROL_BODY_BYTES."""
    data, admin = BodyPolicy(max_body, watch=True), BodyPolicy(MAX_CONTROL_BODY_BYTES)
    return lambda path: admin if path.startswith(ADMIN_PREFIX) else data


class RelayChat:
    """The router's chat completions (relayed to its shards: sticky by `session`, re-dispatched
    on preemption) as the ChatBackend of /v1/responses (responses_service.py)."""

    def __init__(self, router: Router, session: str | None) -> None:
        self.router, self.session = router, session

    async def complete(self, chat: dict[str, Any]) -> dict[str, Any]:
        status, data = await self.router.relay.unary(CHAT, chat, self.session)
        answer = json.loads(data) if isinstance(data, bytes) else data
        if status != 200:
            raise UpstreamAnswerError(status, answer)
        return answer

    async def stream(self, chat: dict[str, Any]) -> Any:
        opened = await self.router.relay.open_stream(CHAT, chat, self.session)
        if isinstance(opened, tuple):
            raise UpstreamAnswerError(*opened)
        return opened

    async def prompt_tokens(self, chat: dict[str, Any]) -> tuple[int, int]:
        """A shard's /tokenize of the chat's messages (vLLM's and rlix's both count them)."""
        body: dict[str, Any] = {"messages": chat["messages"],
                                "add_generation_prompt": chat.get("add_generation_prompt", True)}
        if chat.get("tools") and chat.get("tool_choice") != "none":
            body["tools"] = chat["tools"]
        if chat.get("model"):
            body["model"] = chat["model"]
        passed = await self.router.passthrough("POST", "/tokenize", json.dumps(body).encode())
        data = json.loads(passed.body) if passed.body else {}
        if passed.status != 200:
            raise UpstreamAnswerError(passed.status, data)
        return int(data["count"]), int(data["max_model_len"])


def create_router_app(router: Router, max_body: int = MAX_BODY_BYTES,
                      responses_store: StoreLimits = StoreLimits()) -> FastAPI:
    """Data-plane request bodies larger than `max_body` get 413 unread, JSON nested too deep 400
    (RequestGuard, on every path), fields out of bounds 400 naming them (limits.check_bounds),
    all before anything is relayed; a caller that goes away cancels its request (and the
    shard's, whose connection closes). /v1/responses stores its responses here, in the
    router (bounded by `responses_store`): a conversation continues on any shard."""
    app = FastAPI(title="rlix router", docs_url=None, redoc_url=None)
    app.state.router = router
    responses_service = ResponsesService(ResponseStore(responses_store))
    metrics = RouterMetrics(router.relay, router.table)  # GET /metrics, typed families
    app.add_middleware(RequestGuard, policy=body_policy(max_body))
    expected = f"Bearer {router.api_key}".encode()

    def authorised(request: Request) -> bool:
        return hmac.compare_digest(request.headers.get("authorization", "").encode(), expected)

    @app.exception_handler(NoActiveShardError)
    async def on_no_shard(_: Request, exc: NoActiveShardError) -> JSONResponse:
        return JSONResponse(S.error_body(str(exc), "ServiceUnavailableError", 503), status_code=503)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(S.error_body(str(exc), "BadRequestError", 400, exc.param), status_code=400)

    @app.exception_handler(ResponseNotFoundError)
    async def on_not_found(_: Request, exc: ResponseNotFoundError) -> JSONResponse:
        return JSONResponse(S.error_body(str(exc), "invalid_request_error", 404, exc.param), status_code=404)

    @app.exception_handler(UpstreamAnswerError)
    async def on_upstream(_: Request, exc: UpstreamAnswerError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)  # a shard's refusal, as it came

    async def json_object(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"Invalid JSON format: {exc}") from None
        except (UnicodeDecodeError, RecursionError):  # (RequestGuard bounds the depth)
            raise InvalidRequestError("Invalid JSON format") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("Request body must be a JSON object")
        return body

    async def relay(request: Request, path: str) -> Response:
        body = await json_object(request)
        check_bounds(path, body)  # before any per-sample state or a shard is asked
        if path == COMPLETIONS and _several_prompts(body.get("prompt")):
            raise InvalidRequestError(
                "a list of several prompts is answered by an engine server (`rlix serve`), not "
                "through the router, which re-dispatches one prompt's samples token by token: "
                "send one request per prompt", param="prompt")
        asked = _prompt_logprobs(path, body)
        if asked is not None:
            raise InvalidRequestError(
                "prompt_logprobs are answered by an engine server (`rlix serve`), not through the router, "
                "which relays each request as a stream (it continues a preempted request token by token) "
                "and a stream carries no prompt logprobs, as in vLLM", param=asked)
        session = request.headers.get("x-session-id")
        if body.get("stream"):
            opened = await router.relay.open_stream(path, body, session)
            if isinstance(opened, tuple):
                return JSONResponse(opened[1], status_code=opened[0])
            return StreamingResponse(opened, media_type="text/event-stream")
        status, data = await router.relay.unary(path, body, session)
        if isinstance(data, bytes):
            return Response(data, status_code=status, media_type="application/json")
        return JSONResponse(data, status_code=status)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await relay(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat(request: Request) -> Response:
        return await relay(request, CHAT)

    @app.post(RESPONSES)
    async def responses(request: Request) -> Response:
        """Translated to a chat completion, relayed like one (sticky by X-Session-ID or the
        body's vLLM `session_id`, re-dispatched), answered as a Responses object or its events."""
        body = await json_object(request)
        session = request.headers.get("x-session-id")
        if session is None and isinstance(body.get("session_id"), str):
            session = body["session_id"]
        answer = await responses_service.create(body, RelayChat(router, session))
        if isinstance(answer, dict):
            return JSONResponse(answer)
        return StreamingResponse(answer, media_type="text/event-stream")

    @app.get(RESPONSES + "/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False) -> JSONResponse:
        if stream:
            raise InvalidRequestError("stream=true replays a background response's events; this server "
                                      "runs none (background: true is refused)", param="stream")
        return JSONResponse(responses_service.retrieve(response_id))

    @app.post(GENERATE)
    async def generate(request: Request) -> Response:
        return await relay(request, GENERATE)

    async def passthrough(method: str, path: str, body: bytes | None) -> Response:
        passed = await router.passthrough(method, path, body)
        return Response(passed.body, status_code=passed.status, media_type=passed.content_type)

    @app.get("/v1/models")
    async def models() -> Response:
        return await passthrough("GET", "/v1/models", None)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await passthrough("POST", "/tokenize", await request.body())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await passthrough("POST", "/detokenize", await request.body())

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse(S.version_response())

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/shards")
    async def list_shards(request: Request) -> JSONResponse:
        if not authorised(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return JSONResponse({"shards": await router.shards(),
                             "active": router.table.active_ranks(),
                             "down": [s["rank"] for s in router.down_shards()]})

    @app.post("/router/shards")
    async def set_shard(request: Request) -> JSONResponse:
        if not authorised(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        try:
            raw = json.loads(await request.body() or b"{}")
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"Invalid JSON format: {exc}") from None
        except (UnicodeDecodeError, RecursionError):
            raise InvalidRequestError("Invalid JSON format") from None
        body = parse_body(RouterShardBody, raw)
        return JSONResponse(await router.set_shard(body.rank, body.url, body.state))

    @app.delete("/router/shards/{rank}")
    async def remove_shard(rank: int, request: Request) -> JSONResponse:
        if not authorised(request):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        await router.remove_shard(rank)
        return JSONResponse({"removed": rank})

    return app


class RouterAdminClient:
    """The fleet's handle on a router in another process: same methods as `Router`."""

    def __init__(self, url: str, api_key: str) -> None:
        self.url = url.rstrip("/")
        self.headers = bearer(api_key)
        self._http: httpx.AsyncClient | None = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=10.0)
        return self._http

    async def set_shard(self, rank: int, url: str | None = None, state: str | None = None) -> dict:
        body: dict[str, Any] = {"rank": rank}
        if url:
            body["url"] = url
        if state:
            body["state"] = ShardState(state).value
        r = await self._client().post(f"{self.url}/router/shards", json=body, headers=self.headers)
        r.raise_for_status()
        return r.json()

    async def remove_shard(self, rank: int) -> None:
        r = await self._client().delete(f"{self.url}/router/shards/{rank}", headers=self.headers)
        r.raise_for_status()

    async def shards(self) -> list[dict]:
        r = await self._client().get(f"{self.url}/router/shards", headers=self.headers)
        r.raise_for_status()
        return r.json()["shards"]

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


class RouterServer:
    """Serve a Router with uvicorn inside the running event loop (tests, the fleet actor)."""

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0,
                 responses_store: StoreLimits = StoreLimits()) -> None:
        self.router = router
        self.host, self.port = host, port or free_port(host)
        config = uvicorn.Config(create_router_app(router, responses_store=responses_store), host=self.host, port=self.port,
                                log_level="warning", access_log=False, lifespan="off",
                                http=bounded_http_protocol())
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.server.serve())
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.router.table.close()  # held requests end now instead of holding the shutdown
        self.server.should_exit = True
        if self._task is not None:
            await self._task
        await self.router.close()


def parse_shards(specs: list[str]) -> dict[int, str]:
    """`--shard` values, `URL` or `RANK=URL`, as {rank: url}; URLs without a rank take the next
    free ranks in order. A malformed one is an InvalidRequestError naming it."""
    out: dict[int, str] = {}
    plain: list[str] = []
    for spec in specs:
        rank, sep, url = spec.partition("=")
        if sep and rank.strip().isdigit():
            out[int(rank)] = url
        else:
            plain.append(spec)
    for url in plain:
        out[next(r for r in range(len(out) + len(plain) + 1) if r not in out)] = url
    for rank, url in out.items():
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequestError(f"--shard {url!r}: give the shard's base URL, e.g. http://127.0.0.1:8000")
        try:
            parts.port
        except ValueError:
            raise InvalidRequestError(f"--shard {url!r}: bad port") from None
    return out


def serve_router(shards: list[str], *, api_key: str, shard_api_key: str | None = None,
                 host: str = "127.0.0.1", port: int = 8100, hold_timeout_s: float = 60.0,
                 max_body: int = MAX_BODY_BYTES, responses_store: StoreLimits = StoreLimits()) -> None:
    """Run a router for shards someone started (`rlix router`), every one ACTIVE, until
    interrupted."""
    router = Router(api_key, shard_api_key, hold_timeout_s)
    for rank, url in parse_shards(shards).items():
        router.table.set(rank, url, ShardState.ACTIVE)
    uvicorn.run(create_router_app(router, max_body, responses_store), host=host, port=port, log_level="warning",
                access_log=False, http=bounded_http_protocol())


def main(argv: list[str] | None = None) -> None:
    """Run a router as its own process (`rlix router` is the same, with one-line errors)."""
    p = argparse.ArgumentParser(prog="python -m rlix.inference.router")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--api-key", default=None,
                   help="admin token (default RLIX_API_KEY; prefer the variable: a command line is "
                        "visible to every user of the machine)")
    p.add_argument("--shard-api-key", default=None,
                   help="token the shards expect (default: RLIX_SHARD_API_KEY, else the admin token)")
    p.add_argument("--hold-timeout", type=float, default=60.0, help="s to hold requests with no active shard")
    p.add_argument("--shard", action="append", default=[], metavar="[RANK=]URL", help="an active shard")
    args = p.parse_args(argv)
    for flag, value, var in (("--api-key", args.api_key, env.API_KEY_VAR),
                             ("--shard-api-key", args.shard_api_key, env.SHARD_API_KEY_VAR)):
        if value:
            print(f"{p.prog}: warning: {flag} is visible to every user of this machine "
                  f"(ps, /proc/PID/cmdline); set {var} instead", file=sys.stderr)
    api_key = args.api_key or env.api_key()
    if not api_key:
        p.error("set RLIX_API_KEY (or give --api-key)")
    serve_router(args.shard, api_key=api_key, shard_api_key=args.shard_api_key or env.shard_api_key(),
                 host=args.host, port=args.port, hold_timeout_s=args.hold_timeout)
