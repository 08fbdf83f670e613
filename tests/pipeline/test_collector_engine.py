"""The collector against a real engine-server process behind an in-process router (tiny model, CPU),
as a pipeline runs it: one HTTP hop, router -> shard."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))

from kit import KEY, shard_processes  # noqa: E402

from rlix.inference.server.openai_schema import GenerateSamplingParams as SP
from rlix.envs import PatternTask, Prompt  # noqa: E402
import pytest  # noqa: E402

from rlix.config.models import RolloutConfig  # noqa: E402
from rlix.errors import InvalidRequestError  # noqa: E402
from rlix.inference.router.router import Generation, Router  # noqa: E402
from rlix.pipeline.rollout.buffer import ReplayBuffer  # noqa: E402
from rlix.pipeline.rollout.collector import TrajectoryCollector  # noqa: E402
from rlix.pipeline.hooks import NoOpHooks  # noqa: E402


def test_collects_groups_through_the_router_from_a_real_engine(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    task = PatternTask(["a"], length=8)

    async def main(url: str) -> tuple[list, dict, dict]:
        router = Router(KEY)
        try:
            await router.set_shard(0, url, "active")

            async def generate(ids: list[int], params: dict, session: str | None) -> Generation:
                return await router.generate(ids, params, session)

            buf = ReplayBuffer()
            rollout = RolloutConfig(group_size=4, groups_per_step=2, max_new_tokens=8, temperature=1.0,
                                    concurrency=2)
            col = TrajectoryCollector(generate, tokenizer, task, buf, NoOpHooks(), rollout, max_age=0, seed=1)
            with pytest.raises(InvalidRequestError):  # the shard's 400 comes back typed: not retried
                await router.generate(list(range(1, 600)), SP(max_tokens=4), "too-long")
            col.start()
            await asyncio.wait_for(col.wait_for(2), 120)
            groups = buf.take(2, 0, 0)
            await col.stop()
            buf.check_conservation()
            return groups, buf.accounting(), col.stats()
        finally:
            await router.close()

    with shard_processes(tiny_model_dir, 1) as procs:
        groups, acc, stats = asyncio.run(main(procs[0].url))
    assert len(groups) == 2 and acc["trained"] == 8
    assert set(acc["dropped"]) <= {"shutdown", "unused at shutdown"}
    prompt_ids = tokenizer.encode("Repeat: a\n", add_special_tokens=False)
    for g in groups:
        assert len(g) == 4 and g.version == 0
        for t in g.trajectories:
            assert t.group_id == g.group_id and t.prompt_ids == prompt_ids
            assert 1 <= len(t.response_ids) <= 8
            assert len(t.behaviour_logprobs) == len(t.response_ids)
            assert all(lp <= 0.0 for lp in t.behaviour_logprobs)
            assert t.version == 0 and t.versions == [0]
            assert 0.0 <= t.reward <= 1.0
            text = tokenizer.decode(t.response_ids, skip_special_tokens=True)
            assert t.reward == task.reward(Prompt("Repeat: a\n", "a"), text)
    assert stats["tokens"] >= 8 and stats["retries"] == 0

