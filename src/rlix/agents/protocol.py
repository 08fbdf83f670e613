"""The environment protocol: what the pipeline, agent servers and resources servers send each other.

pipeline -> agent     POST /run          RunRequest -> RunResult
agent -> policy       POST /v1/chat/completions (or /v1/responses), header X-Session-ID
agent -> resources    GET /tools -> ToolList; POST /tools/{name} ToolRequest -> ToolResult;
                      POST /verify VerifyRequest -> VerifyResult
every server          GET /health -> 200

Messages are OpenAI chat messages (dicts: role, content, tool_calls, tool_call_id).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Example(BaseModel):
    """One task instance: what the agent starts from and what the verifier checks against."""

    prompt: str
    answer: Any = None
    meta: dict[str, Any] = Field(default_factory=dict)


class PolicyEndpoint(BaseModel):
    """Where the agent reaches the policy being trained (OpenAI-compatible)."""

    base_url: str  # ends before /v1
    model: str
    api_key: str = ""


class RunRequest(BaseModel):
    episode_id: str
    session_id: str  # sent as X-Session-ID on every policy call of the episode
    example: Example
    policy: PolicyEndpoint


class RunResult(BaseModel):
    model_config = ConfigDict(extra="allow")

    episode_id: str
    reward: float
    turns: int = Field(ge=0)  # policy calls made
    tool_calls: int = Field(0, ge=0)
    messages: list[dict[str, Any]] = Field(default_factory=list)


class ToolSpec(BaseModel):
    """An OpenAI function tool: {"type": "function", "function": {name, description, parameters}}."""

    type: str = "function"
    function: dict[str, Any]


class ToolList(BaseModel):
    tools: list[ToolSpec]


class ToolRequest(BaseModel):
    episode_id: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    example: Example | None = None


class ToolResult(BaseModel):
    output: str


class VerifyRequest(BaseModel):
    episode_id: str
    example: Example
    messages: list[dict[str, Any]]


class VerifyResult(BaseModel):
    reward: float
    info: dict[str, Any] = Field(default_factory=dict)
