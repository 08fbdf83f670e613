"""The collector against a real engine-server process behind the router (tiny model, CPU)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))

from kit import KEY, shard_processes  # noqa: E402

from rlix.envs import PatternTask, Prompt  # noqa: E402
from rlix.inference.fleet.client import RemoteInferenceClient  # noqa: E402
from rlix.inference.router.router import Router  # noqa: E402
from rlix.inference.router.app import RouterServer  # noqa: E402
from rlix.pipeline.buffer import ReplayBuffer  # noqa: E402
from rlix.pipeline.collector import TrajectoryCollector  # noqa: E402
from rlix.pipeline.hooks import NoOpHooks  # noqa: E402


def test_collects_groups_through_the_router_from_a_real_engine(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    task = PatternTask(["a"], length=8)

    async def main(url: str) -> tuple[list, dict, dict]:
        router = Router(KEY)
        server = RouterServer(router)
        await server.start()
        client = RemoteInferenceClient(server.url, {0: url}, KEY, "tiny")
        try:
            await router.set_shard(0, url, "active")

            async def generate(ids: list[int], params: dict, session: str | None) -> dict:
                return await client.generate(ids, params, session_id=session)

            buf = ReplayBuffer()
            col = TrajectoryCollector(generate, tokenizer, task, buf, NoOpHooks(), group_size=4,
                                      groups_per_step=2, max_new_tokens=8, temperature=1.0, max_age=0,
                                      concurrency=2, seed=1)
            col.start()
            await asyncio.wait_for(col.wait_for(2), 120)
            groups = buf.take(2, 0, 0)
            await col.stop()
            buf.check_conservation()
            return groups, buf.accounting(), col.stats()
        finally:
            await server.stop()
            await client.aclose()

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

