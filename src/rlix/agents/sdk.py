"""Writing an environment: a ResourcesServer (tools + verifier) and an AgentServer (one episode
per POST /run), each a few dozen lines; `create_app()` turns either into its HTTP server.

Tools are async methods marked `@tool`: their annotated parameters become the tool's JSON
schema (what the model is shown) and are validated on every call, so a model's malformed call
is a 422 naming the tool and the field, never an exception inside the tool.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError, create_model

from rlix.agents.protocol import (Example, RunRequest, RunResult, ToolList, ToolRequest, ToolResult, ToolSpec,
                                  VerifyRequest, VerifyResult)
from rlix.envs.agent_config import EnvConfig
from rlix.errors import AgentEnvError, one_line
from rlix.httpkit import HttpPool, UpstreamError

ToolMethod = Callable[..., Awaitable[str]]


@dataclass
class EpisodeContext:
    """What a tool call knows of its episode: the example (if the agent sent it) and a state
    dict that lives from the episode's first tool call until its verification."""

    episode_id: str
    example: Example | None = None
    state: dict[str, Any] = field(default_factory=dict)


class ResourcesError(AgentEnvError):
    """The resources server refused or failed a call. `status` is its HTTP status (None: no
    usable answer); `detail` its own one-line reason, what an agent may show the model."""

    def __init__(self, message: str, status: int | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.status, self.detail = status, detail or message


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    arguments: type[BaseModel]
    method: ToolMethod

    def spec(self) -> ToolSpec:
        schema = self.arguments.model_json_schema()
        # pydantic's "title"s repeat the names: prompt tokens for nothing
        props = {k: {f: v for f, v in p.items() if f != "title"} for k, p in schema.get("properties", {}).items()}
        params: dict[str, Any] = {"type": "object", "properties": props, "required": schema.get("required", [])}
        if "$defs" in schema:  # enums and nested models are referenced from the properties
            params["$defs"] = schema["$defs"]
        return ToolSpec(function={"name": self.name, "description": self.description, "parameters": params})


def tool(description: str | ToolMethod = "") -> Any:
    """Mark `async def name(self, episode: EpisodeContext, **args) -> str` as a tool:
    `@tool("what it does")`, `@tool(description=...)` or bare `@tool` (the docstring's first line)."""
    def mark(fn: ToolMethod) -> ToolMethod:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {getattr(fn, '__name__', fn)!r} must be an async method")
        text = description if isinstance(description, str) else ""
        fn.__rlix_tool__ = text or (inspect.getdoc(fn) or "").split("\n")[0]  # type: ignore[attr-defined]
        return fn
    if callable(description):
        return mark(description)
    return mark


def _arguments_model(name: str, fn: Callable[..., Any]) -> type[BaseModel]:
    """The pydantic model of a tool's arguments: its parameters after (self, episode); string
    annotations (`from __future__ import annotations`) resolve in the tool's own module."""
    params = list(inspect.signature(fn).parameters.values())
    if len(params) < 2:
        raise TypeError(f"tool {name!r} must take (self, episode: EpisodeContext, ...)")
    fields: dict[str, Any] = {}
    for p in params[2:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = p.annotation if p.annotation is not inspect.Parameter.empty else Any
        fields[p.name] = (annotation, ... if p.default is inspect.Parameter.empty else p.default)
    return create_model(f"{name}_arguments", __module__=fn.__module__, **fields)


def _one_line_validation(where: str, exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or "body"
    return f"{where}: {loc}: {first['msg']}"


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class ResourcesServer(ABC):
    """Tools and the verifier of one environment. Subclass it, mark tools with `@tool`, write
    `verify`. `tool_latency_s` is added to every tool call (to simulate slow tools)."""

    #: episodes whose state is kept; an agent that dies before verifying never frees its episode,
    #: so past this the oldest states are dropped rather than growing for the whole run
    max_episodes = 10_000

    def __init__(self, tool_latency_s: float = 0.0, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} takes no options {sorted(options)}")
        self.tool_latency_s = float(tool_latency_s)
        self._episodes: OrderedDict[str, EpisodeContext] = OrderedDict()
        self._tools: dict[str, _Tool] = {}
        for name, fn in inspect.getmembers(type(self), predicate=inspect.iscoroutinefunction):
            if hasattr(fn, "__rlix_tool__"):
                self._tools[name] = _Tool(name, fn.__rlix_tool__, _arguments_model(name, fn), getattr(self, name))

    def tools(self) -> ToolList:
        return ToolList(tools=[t.spec() for t in self._tools.values()])

    def episode(self, episode_id: str, example: Example | None = None) -> EpisodeContext:
        """The episode's context, created at its first use."""
        ctx = self._episodes.get(episode_id)
        if ctx is None:
            ctx = self._episodes[episode_id] = EpisodeContext(episode_id)
            while len(self._episodes) > self.max_episodes:
                self._episodes.popitem(last=False)
        if example is not None and ctx.example is None:
            ctx.example = example
        return ctx

    def open_episodes(self) -> int:
        return len(self._episodes)

    async def call(self, name: str, req: ToolRequest) -> ToolResult:
        """Validated call of tool `name` (KeyError: unknown tool; ValidationError: bad arguments)."""
        t = self._tools[name]
        args = t.arguments.model_validate(req.arguments)
        if self.tool_latency_s:
            await asyncio.sleep(self.tool_latency_s)
        return ToolResult(output=str(await t.method(self.episode(req.episode_id, req.example), **dict(args))))

    async def verify_episode(self, req: VerifyRequest) -> VerifyResult:
        """`verify` with the episode's context; the context is dropped afterwards."""
        ctx = self.episode(req.episode_id, req.example)
        try:
            return await self.verify(req, ctx)
        finally:
            self._episodes.pop(req.episode_id, None)

    @abstractmethod
    async def verify(self, req: VerifyRequest, episode: EpisodeContext) -> VerifyResult:
        """The episode's reward, from its example and its whole conversation (and the state its
        tools kept in `episode.state`)."""

    def create_app(self) -> FastAPI:
        app = FastAPI(title=f"rlix resources: {type(self).__name__}", docs_url=None, redoc_url=None)

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok", "episodes": self.open_episodes()}

        @app.get("/tools")
        async def tools() -> dict:
            return self.tools().model_dump()

        @app.post("/tools/{name}")
        async def call(name: str, request: Request) -> JSONResponse:
            if name not in self._tools:
                return _error(404, f"no tool {name!r} (tools: {', '.join(self._tools) or 'none'})", "NotFoundError")
            try:
                req = ToolRequest.model_validate_json(await request.body())
                return JSONResponse((await self.call(name, req)).model_dump())
            except ValidationError as exc:
                return _error(422, _one_line_validation(f"tool {name}", exc), "ValidationError")
            except Exception as exc:  # noqa: BLE001 - the environment's bug: one line, not a traceback page
                return _error(500, f"tool {name}: {one_line(exc)}", type(exc).__name__)

        @app.post("/verify")
        async def verify(request: Request) -> JSONResponse:
            try:
                req = VerifyRequest.model_validate_json(await request.body())
            except ValidationError as exc:
                return _error(422, _one_line_validation("verify", exc), "ValidationError")
            try:
                return JSONResponse((await self.verify_episode(req)).model_dump())
            except Exception as exc:  # noqa: BLE001 - as for tools
                return _error(500, f"verify: {one_line(exc)}", type(exc).__name__)

        return app


class ResourcesClient:
    """An agent's typed client of its resources server: anything but a well-formed 2xx is a
    ResourcesError (an AgentEnvError) naming the endpoint. Calls go over the lean keep-alive pool
    (rlix.httpkit; httpx's pool cost an agent server most of its CPU with 32 episodes in flight),
    each within `timeout_s`, and are never sent twice (a tool may not be safe to repeat)."""

    def __init__(self, url: str, pool: HttpPool, timeout_s: float = 60.0) -> None:
        self.url, self.pool, self.timeout_s = url.rstrip("/"), pool, timeout_s

    async def tools(self) -> ToolList:
        return self._typed("/tools", ToolList, await self._request("GET", "/tools"))

    async def call(self, name: str, episode_id: str, arguments: dict[str, Any], example: Example | None = None) -> str:
        path = f"/tools/{name}"
        data = await self._request("POST", path, ToolRequest(episode_id=episode_id, arguments=arguments,
                                                             example=example))
        return self._typed(path, ToolResult, data).output

    async def verify(self, episode_id: str, example: Example, messages: list[dict[str, Any]]) -> VerifyResult:
        data = await self._request("POST", "/verify", VerifyRequest(episode_id=episode_id, example=example,
                                                                    messages=messages))
        return self._typed("/verify", VerifyResult, data)

    async def _request(self, method: str, path: str, body: BaseModel | None = None) -> Any:
        status, content = await _exchange(self.pool, method, self.url, path,
                                          body.model_dump_json().encode() if body is not None else b"",
                                          {"content-type": "application/json"} if body is not None else {},
                                          self.timeout_s, f"resources {path}", ResourcesError)
        if not 200 <= status < 300:
            detail = _error_message(content)
            raise ResourcesError(f"resources {path} answered {status}: {detail}", status, detail)
        try:
            return json.loads(content)
        except ValueError:
            raise ResourcesError(f"resources {path} answered something that is not JSON", status) from None

    @staticmethod
    def _typed(path: str, model: type[BaseModel], data: Any) -> Any:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise ResourcesError(_one_line_validation(f"resources {path} answer", exc)) from None


async def _exchange(pool: HttpPool, method: str, base: str, path: str, body: bytes, headers: dict[str, str],
                    timeout_s: float, what: str, error: type[AgentEnvError]) -> tuple[int, bytes]:
    """One request sent once over `pool`, read whole within `timeout_s`; a transport failure
    or the timeout is `error` naming `what`."""
    try:
        return await asyncio.wait_for(pool.exchange(method, base, path, body, headers, retry_stale=False), timeout_s)
    except asyncio.TimeoutError:
        raise error(f"{what}: timed out after {timeout_s:g} s") from None
    except UpstreamError as exc:
        raise error(f"{what}: {one_line(exc)}") from None


def _error_message(content: bytes) -> str:
    """The server's own one-line reason ({"error": {"message"}}, FastAPI's {"detail"}) or the
    body's start."""
    try:
        body = json.loads(content)
        message = body["error"]["message"] if "error" in body else body["detail"]
        text = message if isinstance(message, str) else str(message)
    except (ValueError, KeyError, TypeError):
        text = content[:200].decode(errors="replace")
    return " ".join(text.split())[:300]


class AgentServer(ABC):
    """Runs one episode per POST /run. Subclass it and write `run`; `self.resources` is the
    resources server's client and `self.chat` calls the policy, both over a lean keep-alive pool;
    `self.http` is a shared httpx client for anything else. All are created on first use and
    closed when the app shuts down."""

    def __init__(self, resources_url: str, config: EnvConfig) -> None:
        self.config = config
        self.resources_url = resources_url.rstrip("/")
        self._http: httpx.AsyncClient | None = None
        self._pool: HttpPool | None = None
        self._resources: ResourcesClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.config.episode_timeout_s, connect=5.0),
                                           limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._http

    @property
    def pool(self) -> HttpPool:
        if self._pool is None:
            self._pool = HttpPool()
            self._resources = None
        return self._pool

    @property
    def resources(self) -> ResourcesClient:
        pool = self.pool
        if self._resources is None:
            self._resources = ResourcesClient(self.resources_url, pool, self.config.episode_timeout_s)
        return self._resources

    async def chat(self, req: RunRequest, body: dict[str, Any]) -> tuple[int, bytes]:
        """POST `body` to the policy's /v1/chat/completions under the episode's session
        (X-Session-ID); its status and raw answer. AgentEnvError if nothing usable came back."""
        policy = req.policy
        base = policy.base_url.rstrip("/")
        prefix = urlsplit(base).path
        return await _exchange(self.pool, "POST", base, f"{prefix}/v1/chat/completions", json.dumps(body).encode(),
                               {"content-type": "application/json", "X-Session-ID": req.session_id,
                                "Authorization": f"Bearer {policy.api_key}"},
                               self.config.episode_timeout_s, f"policy {base}/v1/chat/completions", AgentEnvError)

    @abstractmethod
    async def run(self, req: RunRequest) -> RunResult:
        """One episode, start to reward."""

    async def close(self) -> None:
        self._resources = None
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.aclose()

    def create_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
            yield
            await self.close()

        app = FastAPI(title=f"rlix agent: {type(self).__name__}", docs_url=None, redoc_url=None, lifespan=lifespan)

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.post("/run")
        async def run(request: Request) -> JSONResponse:
            try:
                req = RunRequest.model_validate_json(await request.body())
            except ValidationError as exc:
                return _error(422, _one_line_validation("run", exc), "ValidationError")
            try:
                return JSONResponse((await self.run(req)).model_dump())
            except Exception as exc:  # noqa: BLE001 - the episode failed: the pipeline counts it
                return _error(502, f"episode {req.episode_id}: {one_line(exc)}", type(exc).__name__)

        return app
