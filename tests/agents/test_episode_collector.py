"""The collector running agent episodes (no servers: an in-process agent drives the real policy
gateway): samples are the stitched exact tokens with context masked; a failing environment is
retried, then its group is dropped with a reason naming the environment and the episode, and
the other groups still reach the buffer; an episode that cannot be stitched is dropped, counted."""

from __future__ import annotations

import asyncio
import random

from rlix.inference.server.openai_schema import GenerateSamplingParams
from rlix.agents.gateway import PolicyGateway
from rlix.agents.protocol import PolicyEndpoint, RunRequest, RunResult
from rlix.agents.rollout import AgentEpisodes
from rlix.config.models import RolloutConfig
from rlix.envs import PatternTask
from rlix.envs.agent_config import EnvConfig
from rlix.errors import EpisodeError
from rlix.inference.router.router import Generation, VersionSpan
from rlix.models.tokenizer import build_tokenizer
from rlix.pipeline.rollout.buffer import ReplayBuffer
from rlix.pipeline.rollout.collector import TrajectoryCollector

TOK = build_tokenizer()
END = TOK.convert_tokens_to_ids("<|im_end|>")


class Hooks:
    def __init__(self) -> None:
        self.turns: list[int | None] = []

    async def report_progress(self, demand, step, shard_load=None, turns_outstanding=None, **_):  # type: ignore[no-untyped-def]
        self.turns.append(turns_outstanding)


class Engine:
    """Samples random ids from the vocabulary (never what re-tokenising would give), records them."""

    def __init__(self) -> None:
        self.record: list[tuple[list[int], list[int], list[float]]] = []

    async def __call__(self, ids: list[int], params: GenerateSamplingParams, session: str | None) -> Generation:
        rng = random.Random(params.seed)
        out = [rng.randrange(3, TOK.vocab_size) for _ in range(rng.randrange(2, params.max_tokens or 16))] + [END]
        lps = [-rng.random() for _ in out]
        self.record.append((list(ids), out, lps))
        await asyncio.sleep(0.001)
        return Generation(out, lps, [VersionSpan(0, 0, len(out))], "stop", len(ids))


class InProcessAgent:
    """What an agent server does, minus HTTP: 3 turns, feedback appended as user turns. Episodes
    whose id is in `fail` raise as an unreachable environment would (each attempt); in `edit`
    rewrite the history (unstitchable)."""

    def __init__(self, gateway: PolicyGateway, fail: set[str], edit: set[str], fail_once: set[str]) -> None:
        self.gateway, self.fail, self.edit, self.fail_once = gateway, fail, edit, fail_once
        self.attempts: list[str] = []

    async def run(self, req: RunRequest) -> RunResult:
        self.attempts.append(req.episode_id)
        base = req.episode_id.rsplit("-a", 1)[0]
        if base in self.fail or (base in self.fail_once and req.episode_id.endswith("-a0")):
            raise EpisodeError("repeat", req.episode_id, "agent /run answered 502: resources server gone")
        msgs = [{"role": "user", "content": req.example.prompt}]
        for turn in range(3):
            answer = await self.gateway.chat({"messages": msgs}, req.session_id)
            reply = answer["choices"][0]["message"]
            if base in self.edit and turn == 1:
                reply = {**reply, "content": "edited"}
            msgs = msgs + [reply, {"role": "user", "content": f"score 0.{turn}"}]
        return RunResult(episode_id=req.episode_id, reward=float(len(base) % 3) / 2, turns=3, messages=msgs)

    async def close(self) -> None:
        return None


def test_episodes_become_exact_masked_samples_and_failures_stay_in_their_group():
    async def main() -> None:
        engine = Engine()
        gateway = PolicyGateway(engine, TOK, "p", temperature=1.0, max_tokens=6)
        cfg = EnvConfig(episode_retries=1)
        # group ids are g{seed}-{n}; sample i of group n is episode g5-n-i
        agent = InProcessAgent(gateway, fail={"g5-2-1"}, edit={"g5-3-0"}, fail_once={"g5-1-2"})
        episodes = AgentEpisodes(cfg, gateway, agent, PolicyEndpoint(base_url="http://unused", model="p"))  # type: ignore[arg-type]
        buf, hooks = ReplayBuffer(), Hooks()
        col = TrajectoryCollector(None, TOK, PatternTask(["z"], 4), buf, hooks,  # type: ignore[arg-type]
                                  RolloutConfig(group_size=3, groups_per_step=3, max_new_tokens=6, concurrency=8),
                                  max_age=1, seed=5, retry_delay_s=0.001, episodes=episodes)
        col.start()
        await col.wait_for(3, timeout=30)
        groups = buf.take(3, 0, 1)
        await col.stop()
        acc = buf.accounting()
        reasons = " | ".join(acc["dropped"])
        assert "episode failed: agent /run answered 502" in reasons  # g5-2: failed twice
        assert "not token-exact: turn 3: message 3 differs" in reasons  # g5-3: history edited
        assert any("environment repeat, episode g5-2-1-a1" in e for e in col.errors)
        # g5-1's episode failed once, was run again and its group was not dropped
        assert agent.attempts.count("g5-1-2-a0") == agent.attempts.count("g5-1-2-a1") == 1
        assert not any(e.startswith("g5-1:") for e in col.errors)
        assert [e.split(":")[0] for e in col.errors if e.startswith("g5-")] == ["g5-2", "g5-3"] or \
            sorted(e.split(":")[0] for e in col.errors if e.startswith("g5-")) == ["g5-2", "g5-3"]
        by_prompt: dict[tuple, list] = {}  # turn 1's prompt is the same for every episode
        for ids, out, lps in engine.record:
            by_prompt.setdefault(tuple(ids), []).append((out, lps))
        for g in groups:
            for t in g.trajectories:
                spans, start = [], None
                for j, m in enumerate(t.loss_mask + [0]):
                    if m and start is None:
                        start = j
                    elif not m and start is not None:
                        spans.append((start, j))
                        start = None
                assert len(spans) == 3  # three sampled turns, context between them
                for s, e in spans:  # each is exactly what the engine sampled for that prompt
                    sampled = by_prompt[tuple(t.prompt_ids + t.response_ids[:s])]
                    assert (t.response_ids[s:e], t.behaviour_logprobs[s:e]) in sampled
                assert all(lp == 0.0 for lp, m in zip(t.behaviour_logprobs, t.loss_mask) if not m)
        assert col.stats()["episode_turns"] >= 9 * 3
        assert any(t is not None and t > 0 for t in hooks.turns)  # demand in turns reached the hooks
        assert gateway.open_episodes() == 0  # failed and finished episodes alike are closed

    asyncio.run(main())
