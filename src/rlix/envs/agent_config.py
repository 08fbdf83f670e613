"""A pipeline's `env:` section: the HTTP agent environment its rollouts run in (pydantic only)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _target(value: str, what: str) -> str:
    module, _, name = value.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {value!r}: use 'module:Class'")
    return value


class EnvConfig(BaseModel):
    """Two processes per environment, supervised by the pipeline: a resources server (tools and
    the verifier that gives the reward) and an agent server (runs one multi-turn episode per
    `POST /run`, calling the pipeline's policy endpoint and the resources server's tools).
    Neither holds a GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("repeat", min_length=1, description="how errors and logs name this environment")
    resources: str = Field("rlix.agents.envs.repeat:RepeatResources",
                           description="module:Class of a ResourcesServer subclass")
    agent: str = Field("rlix.agents.tool_agent:ToolAgent", description="module:Class of an AgentServer subclass")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="keyword arguments of the resources server's class")
    system_prompt: str | None = Field(None, description="a system message before each example's prompt")
    show_tools: bool = Field(True, description="list the resources server's tools to the model (false: the "
                                               "agent still calls feedback_tool itself; saves the prompt "
                                               "tokens of the tool list, ~270 with the tiny preset)")
    max_turns: int = Field(3, ge=1, description="policy calls per episode at most")
    feedback_tool: str | None = Field(
        "check", description="a tool the agent calls with each reply that calls no tool itself "
                             "(its answer goes back as the next user turn); null: such a reply ends the episode")
    tool_latency_s: float = Field(0.0, ge=0.0, description="added to every tool call (simulates slow tools)")
    episode_timeout_s: float = Field(300.0, gt=0.0, description="one POST /run, end to end")
    startup_timeout_s: float = Field(60.0, gt=0.0)
    max_restarts: int = Field(5, ge=0, description="restarts of a dead server before the pipeline fails")
    episode_retries: int = Field(2, ge=0, description="a failed episode is run again this many times")

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: str) -> str:
        return _target(v, "resources")

    @field_validator("agent")
    @classmethod
    def _agent(cls, v: str) -> str:
        return _target(v, "agent")
