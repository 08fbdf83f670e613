"""Writing an environment: a ResourcesServer (tools + verifier) and an AgentServer (one episode
per POST /run), each a few dozen lines; `create_app()` turns either into its HTTP server.

Tools are async methods marked `@tool`: their annotated parameters become the tool's JSON
schema (what the model is shown) and are validated on every call, so a model's malformed call
is a 422 naming the tool and the field, never an exception inside the tool.
"""

from __future__ import annotations

import asyncio
import inspect
from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError, create_model

from rlix.agents.protocol import (Example, RunRequest, RunResult, ToolList, ToolRequest, ToolResult, ToolSpec,
                                  VerifyRequest, VerifyResult)
from rlix.envs.agent_config import EnvConfig
from rlix.errors import AgentEnvError


@dataclass
class EpisodeContext:
    """What a tool call knows of its episode: the example (if the agent sent it) and a state
    dict that lives from the episode's first tool call until its verification."""

    episode_id: str
    example: Example | None = None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Tool:
    name: str
    description: str
    arguments: type[BaseModel]
    method: Callable[..., Awaitable[str]]

    def spec(self) -> ToolSpec:
        schema = self.arguments.model_json_schema()
        # pydantic's "title"s repeat the names: prompt tokens for nothing
        props = {k: {f: v for f, v in p.items() if f != "title"} for k, p in schema.get("properties", {}).items()}
        params = {"type": "object", "properties": props, "required": schema.get("required", [])}
        return ToolSpec(function={"name": self.name, "description": self.description, "parameters": params})


def tool(description: str = "") -> Callable[[Callable[..., Awaitable[str]]], Callable[..., Awaitable[str]]]:
    """Mark `async def name(self, episode: EpisodeContext, **args) -> str` as a tool."""
    def mark(fn: Callable[..., Awaitable[str]]) -> Callable[..., Awaitable[str]]:
        fn.__rlix_tool__ = description or (inspect.getdoc(fn) or "").split("\n")[0]  # type: ignore[attr-defined]
        return fn
    return mark


def _arguments_model(name: str, fn: Callable[..., Any]) -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for pname, p in list(inspect.signature(fn).parameters.items())[2:]:  # self, episode
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = p.annotation if p.annotation is not inspect.Parameter.empty else Any
        fields[pname] = (annotation, ... if p.default is inspect.Parameter.empty else p.default)
    return create_model(f"{name}_arguments", **fields)


def _one_line_validation(where: str, exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or "body"
    return f"{where}: {loc}: {first['msg']}"


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class ResourcesServer(ABC):
    """Tools and the verifier of one environment. Subclass it, mark tools with `@tool`, write
    `verify`. `tool_latency_s` is added to every tool call (to simulate slow tools)."""

    def __init__(self, tool_latency_s: float = 0.0, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} takes no options {sorted(options)}")
        self.tool_latency_s = float(tool_latency_s)
        self._episodes: dict[str, EpisodeContext] = {}
        self._tools: dict[str, _Tool] = {}
        for name, fn in inspect.getmembers(type(self), predicate=inspect.iscoroutinefunction):
            if hasattr(fn, "__rlix_tool__"):
                self._tools[name] = _Tool(name, fn.__rlix_tool__, _arguments_model(name, fn), getattr(self, name))

    def tools(self) -> ToolList:
        return ToolList(tools=[t.spec() for t in self._tools.values()])

    def episode(self, episode_id: str, example: Example | None = None) -> EpisodeContext:
        ctx = self._episodes.setdefault(episode_id, EpisodeContext(episode_id))
        if example is not None and ctx.example is None:
            ctx.example = example
        return ctx

    async def call(self, name: str, req: ToolRequest) -> ToolResult:
        """Validated call of tool `name` (KeyError: unknown tool; ValidationError: bad arguments)."""
        t = self._tools[name]
        args = t.arguments.model_validate(req.arguments)
        if self.tool_latency_s:
            await asyncio.sleep(self.tool_latency_s)
        return ToolResult(output=str(await t.method(self.episode(req.episode_id, req.example), **args.model_dump())))

    async def verify_episode(self, req: VerifyRequest) -> VerifyResult:
        ctx = self.episode(req.episode_id, req.example)
        try:
            return await self.verify(req, ctx)
        finally:
            self._episodes.pop(req.episode_id, None)

    @abstractmethod
    async def verify(self, req: VerifyRequest, episode: EpisodeContext) -> VerifyResult:
        """The episode's reward, from its example and its whole conversation."""

    def create_app(self) -> FastAPI:
        app = FastAPI(title=f"rlix resources: {type(self).__name__}", docs_url=None, redoc_url=None)

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok", "episodes": len(self._episodes)}

        @app.get("/tools")
        async def tools() -> dict:
            return self.tools().model_dump()

        @app.post("/tools/{name}")
        async def call(name: str, request: Request) -> JSONResponse:
            if name not in self._tools:
                return _error(404, f"no tool {name!r} (tools: {', '.join(self._tools)})", "NotFoundError")
            try:
                req = ToolRequest.model_validate_json(await request.body())
                return JSONResponse((await self.call(name, req)).model_dump())
            except ValidationError as exc:
                return _error(422, _one_line_validation(f"tool {name}", exc), "ValidationError")

        @app.post("/verify")
        async def verify(request: Request) -> JSONResponse:
            try:
                req = VerifyRequest.model_validate_json(await request.body())
            except ValidationError as exc:
                return _error(422, _one_line_validation("verify", exc), "ValidationError")
            return JSONResponse((await self.verify_episode(req)).model_dump())

        return app


class ResourcesClient:
    """An agent's typed client of its resources server: anything but a well-formed 200 is an
    AgentEnvError naming the endpoint."""

    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url, self.http = url.rstrip("/"), http

    async def _post(self, path: str, body: BaseModel) -> Any:
        try:
            resp = await self.http.post(self.url + path, content=body.model_dump_json(),
                                        headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            raise AgentEnvError(f"resources {path}: {type(exc).__name__}: {exc}") from None
        return self._json(path, resp)

    @staticmethod
    def _json(path: str, resp: httpx.Response) -> Any:
        if resp.status_code != 200:
            raise AgentEnvError(f"resources {path} answered {resp.status_code}: {resp.text[:200]}")
        try:
            return resp.json()
        except ValueError:
            raise AgentEnvError(f"resources {path} answered something that is not JSON") from None

    async def tools(self) -> ToolList:
        try:
            resp = await self.http.get(self.url + "/tools")
        except httpx.HTTPError as exc:
            raise AgentEnvError(f"resources /tools: {type(exc).__name__}: {exc}") from None
        return self._typed("/tools", ToolList, self._json("/tools", resp))

    async def call(self, name: str, episode_id: str, arguments: dict[str, Any], example: Example | None = None) -> str:
        data = await self._post(f"/tools/{name}", ToolRequest(episode_id=episode_id, arguments=arguments,
                                                              example=example))
        return self._typed(f"/tools/{name}", ToolResult, data).output

    async def verify(self, episode_id: str, example: Example, messages: list[dict[str, Any]]) -> VerifyResult:
        data = await self._post("/verify", VerifyRequest(episode_id=episode_id, example=example, messages=messages))
        return self._typed("/verify", VerifyResult, data)

    @staticmethod
    def _typed(path: str, model: type[BaseModel], data: Any) -> Any:
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise AgentEnvError(_one_line_validation(f"resources {path} answer", exc)) from None


class AgentServer(ABC):
    """Runs one episode per POST /run. Subclass it and write `run`; `self.resources` is the
    resources server's client, `self.http` a shared HTTP client (for the policy too)."""

    def __init__(self, resources_url: str, config: EnvConfig) -> None:
        self.config = config
        self.resources_url = resources_url
        self._http: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.config.episode_timeout_s, connect=5.0),
                                           limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._http

    @property
    def resources(self) -> ResourcesClient:
        return ResourcesClient(self.resources_url, self.http)

    @abstractmethod
    async def run(self, req: RunRequest) -> RunResult:
        """One episode, start to reward."""

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

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
                line = (str(exc).strip().splitlines() or [""])[-1]
                return _error(502, f"episode {req.episode_id}: {type(exc).__name__}: {line}"[:500],
                              type(exc).__name__)

        return app
