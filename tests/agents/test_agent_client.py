"""The pipeline's client of an agent server: every malformed answer (not JSON, a field missing
or of the wrong type, another episode's id, too slow) is an EpisodeError naming the environment
and the episode, never an exception of another kind."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from rlix.agents.protocol import Example, PolicyEndpoint, RunRequest
from rlix.agents.rollout import AgentClient
from rlix.errors import EpisodeError

from served_app import ServedApp


def test_malformed_agent_answers_are_episode_errors_naming_env_and_episode():
    """Not JSON, a field missing, a field of the wrong type, another episode's id, too slow."""
    answers = iter(["{not json", json.dumps({"episode_id": "x1", "turns": 1}),
                    json.dumps({"episode_id": "x1", "reward": "high", "turns": 1}),
                    json.dumps({"episode_id": "other", "reward": 1.0, "turns": 1}), None])
    app = FastAPI()

    @app.post("/run")
    async def run(request: Request) -> Response:
        body = next(answers)
        if body is None:
            await asyncio.sleep(3)
            body = "{}"
        return Response(body, media_type="application/json")

    served = ServedApp(app).start()
    try:
        client = AgentClient("calc", served.url, timeout_s=1.0)
        req = RunRequest(episode_id="x1", session_id="s", example=Example(prompt="p"),
                         policy=PolicyEndpoint(base_url="http://unused", model="m"))

        async def go() -> list[str]:
            reasons = []
            for _ in range(5):
                with pytest.raises(EpisodeError) as err:
                    await client.run(req)
                assert err.value.env == "calc" and err.value.episode == "x1"
                reasons.append(err.value.reason)
            await client.close()
            return reasons
        reasons = asyncio.run(go())
    finally:
        served.stop()
    assert "agent /run answer is malformed" in reasons[0]
    assert "reward: Field required" in reasons[1]
    assert "reward" in reasons[2] and "number" in reasons[2]
    assert "episode 'other'" in reasons[3]
    assert "timed out after 1 s" in reasons[4]
