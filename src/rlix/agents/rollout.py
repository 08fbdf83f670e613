"""One trajectory = one agent episode: what the collector calls instead of a single generate.

The pipeline opens a recorded session on its policy gateway, asks the environment's agent server
to run the episode (`POST /run`), then takes the gateway's record and stitches it into the exact
sample the policy generated (episodes.py). The reward is the environment's verifier's.
Everything that can go wrong with an environment is an `EpisodeError` naming the environment
and the episode; the collector retries those and counts what stays failed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pydantic import ValidationError

from rlix.envs.agent_config import EnvConfig
from rlix.agents.episodes import EpisodeSample, stitch
from rlix.agents.gateway import EpisodeTrace, PolicyGateway
from rlix.agents.protocol import Example, PolicyEndpoint, RunRequest, RunResult
from rlix.errors import EpisodeError
from rlix.httpkit import HttpPool, UpstreamError


@dataclass(frozen=True)
class Episode:
    """A finished, stitched episode."""

    sample: EpisodeSample
    trace: EpisodeTrace
    result: RunResult


class AgentClient:
    """The pipeline's typed client of one agent server. Malformed answers (not JSON, missing or
    mistyped fields, an episode id that is not the one asked), HTTP errors, timeouts and
    connection failures all become EpisodeError."""

    def __init__(self, env: str, url: str, timeout_s: float) -> None:
        self.env, self.url, self.timeout_s = env, url.rstrip("/"), timeout_s
        #: the lean pool (rlix.httpkit): httpx's pool scanned every connection per request, a
        #: quarter of a pipeline's own CPU with 32 episodes in flight
        self._http: HttpPool | None = None

    def _client(self) -> HttpPool:
        if self._http is None:
            self._http = HttpPool()
        return self._http

    def retarget(self, url: str) -> None:
        self.url = url.rstrip("/")

    async def run(self, req: RunRequest) -> RunResult:
        def fail(reason: str) -> EpisodeError:
            return EpisodeError(self.env, req.episode_id, reason[:300])

        # never sent twice: a second /run of the session would record a second episode in it
        post = self._client().exchange("POST", self.url, "/run", req.model_dump_json().encode(),
                                       {"content-type": "application/json"}, retry_stale=False)
        try:
            status, content = await asyncio.wait_for(post, self.timeout_s)
        except asyncio.TimeoutError:
            raise fail(f"agent /run timed out after {self.timeout_s:g} s") from None
        except UpstreamError as exc:
            raise fail(f"agent /run failed: {exc}") from None
        if status != 200:
            raise fail(f"agent /run answered {status}: {content[:200].decode(errors='replace')}")
        try:
            result = RunResult.model_validate_json(content)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "body"
            raise fail(f"agent /run answer is malformed: {where}: {first['msg']}") from None
        if result.episode_id != req.episode_id:
            raise fail(f"agent /run answered for episode {result.episode_id!r}")
        if result.reward != result.reward or result.reward in (float("inf"), float("-inf")):
            raise fail("agent /run answered a reward that is not a finite number")
        return result

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None


class AgentEpisodes:
    """Runs episodes of one environment for one pipeline (see module doc)."""

    def __init__(self, cfg: EnvConfig, gateway: PolicyGateway, agent: AgentClient, policy: PolicyEndpoint) -> None:
        self.cfg, self.gateway, self.agent, self.policy = cfg, gateway, agent, policy
        self.turns = 0  # policy calls of finished episodes
        self.tool_calls = 0
        self.running = 0  # episodes in flight

    def turns_outstanding(self, remaining: int) -> int:
        """Policy calls still to come, at most: what the open episodes may still make, plus
        max_turns for each of the `remaining` trajectories not started yet."""
        left = self.gateway.turns_left(self.cfg.max_turns)
        return left + max(remaining - self.running, 0) * self.cfg.max_turns

    async def run(self, episode_id: str, example: Example, seed: int) -> Episode:
        """One attempt; EpisodeError when the environment failed, Unstitchable when the tokens
        cannot be trained on exactly."""
        session = episode_id
        self.gateway.open(session, seed)
        self.running += 1
        try:
            result = await self.agent.run(RunRequest(episode_id=episode_id, session_id=session,
                                                     example=example, policy=self.policy))
        except (EpisodeError, asyncio.CancelledError):
            self.gateway.discard(session)
            raise
        finally:
            self.running -= 1
        trace = self.gateway.take(session)
        self.turns += len(trace.turns)
        self.tool_calls += result.tool_calls
        return Episode(stitch(trace), trace, result)
