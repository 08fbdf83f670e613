"""A pipeline's agent environment, assembled: the policy gateway on the pipeline's data-plane
thread (beside its router), the environment's supervisor actor (agent + resources servers), and
the episode runner the collector calls.

The gateway has a token of its own, which every episode's request hands the agent server: the
environment's servers are the user's code, and the run's token (the shards': sleep, weights)
never reaches them."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import ray

from rlix.envs.agent_config import EnvConfig
from rlix.agents.gateway import PolicyGateway
from rlix.agents.gateway_app import GatewayServer
from rlix.agents.protocol import PolicyEndpoint
from rlix.agents.rollout import AgentClient, AgentEpisodes
from rlix.agents.supervisor import EnvironmentSupervisor
from rlix.errors import AgentEnvError, one_line
from rlix.inference.server.openai_schema import GenerateSamplingParams


class PipelineEnvironment:
    def __init__(self, cfg: EnvConfig, pipeline: str, api_key: str, log_dir: Path) -> None:
        """`api_key`, the run's token, is not used: the policy gateway gets its own."""
        self.cfg, self.pipeline, self.log_dir = cfg, pipeline, log_dir
        self.api_key = secrets.token_urlsafe(24)  # the gateway's: all an agent may do is ask the policy
        self.gateway: PolicyGateway | None = None
        self.server: GatewayServer | None = None
        self.supervisor: Any = None
        self.episodes: AgentEpisodes | None = None
        self.urls: dict[str, str] = {}
        self.pids: dict[str, int] = {}
        self.restarts: list[str] = []

    async def start(self, data_plane: Any, router: Any, tokenizer: Any, *, temperature: float,
                    max_tokens: int, generate_timeout_s: float) -> AgentEpisodes:
        """Gateway first (the agent is told where it is), then the environment's servers."""
        async def generate(ids: list[int], params: GenerateSamplingParams, session: str | None) -> Any:
            return await router.generate(ids, params, session, timeout_s=generate_timeout_s)

        self.gateway = PolicyGateway(generate, tokenizer, self.pipeline, temperature=temperature,
                                     max_tokens=max_tokens)

        async def serve() -> str:
            self.server = GatewayServer(self.gateway, self.api_key)  # type: ignore[arg-type]
            await self.server.start()
            return self.server.url

        policy_url = await data_plane.run(serve())
        self.supervisor = EnvironmentSupervisor.remote(self.cfg, str(self.log_dir))
        self.urls = await self.supervisor.start.remote()
        self.pids = await self.supervisor.pids.remote()
        agent = AgentClient(self.cfg.name, self.urls["agent"], self.cfg.episode_timeout_s)
        self.episodes = AgentEpisodes(self.cfg, self.gateway, agent,
                                      PolicyEndpoint(base_url=policy_url, model=self.pipeline, api_key=self.api_key))
        return self.episodes

    async def check(self) -> AgentEnvError | None:
        """The supervisor's fatal error (a server past its restart limit), if any; refreshes
        what `processes()` and `stats()` report."""
        if self.supervisor is None:
            return None
        try:
            message = await self.supervisor.error.remote()
            self.pids = await self.supervisor.pids.remote()
            self.restarts = await self.supervisor.restarts.remote()
        except ray.exceptions.RayActorError as exc:
            return AgentEnvError(f"environment {self.cfg.name}: its supervisor died: {one_line(exc)}")
        return AgentEnvError(message) if message else None

    def processes(self) -> dict:
        return {"env": dict(self.pids), "env_urls": dict(self.urls),
                "policy_gateway": self.server.url if self.server else None}

    def stats(self) -> dict:
        return {"name": self.cfg.name, "restarts": list(self.restarts),
                "open_episodes": self.gateway.open_episodes() if self.gateway else 0,
                "gateway_requests": self.gateway.requests if self.gateway else 0}

    async def stop(self, data_plane: Any) -> None:
        """The gateway first: episodes still running in the agent server then fail at once
        instead of holding its shutdown; then the servers, by PID."""
        if self.server is not None and data_plane is not None and data_plane.alive():
            server, self.server = self.server, None
            await data_plane.run(server.stop())
        if self.episodes is not None:
            await self.episodes.agent.close()
        if self.supervisor is not None:
            try:
                await self.supervisor.stop.remote()
            finally:
                ray.kill(self.supervisor)
                self.supervisor = None
