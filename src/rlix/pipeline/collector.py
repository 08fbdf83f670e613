"""The async trajectory collector: keeps the pipeline's shards busy and fills the buffer.

Groups (one prompt x `group_size` samples, session-sticky to one shard) are generated
concurrently through the router. Admission control: no new group starts while the young-enough
groups buffered plus those in flight already cover `groups_per_step x (max_age + 1)`: more
could only go stale before the trainer reaches them. A group that still finishes too old is
dropped and counted ("stale"). Demand goes to the hooks (collected vs target for the next
step), throttled to 2% steps. A failed request is retried a few times (the router already
re-dispatches preempted ones); then its whole group is dropped with the reason.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rlix.pipeline.buffer import ReplayBuffer
from rlix.pipeline.hooks import ProgressThrottle
from rlix.pipeline.types import Group, Trajectory

Generate = Callable[[list[int], dict, str | None], Awaitable[dict]]


class GroupFailed(Exception):
    pass


class TrajectoryCollector:
    def __init__(self, generate: Generate, tokenizer: Any, task: Any, buffer: ReplayBuffer,
                 hooks: Any, *, group_size: int, groups_per_step: int, max_new_tokens: int,
                 temperature: float, max_age: int, concurrency: int, seed: int = 0,
                 max_retries: int = 3, retry_delay_s: float = 0.5) -> None:
        self.generate, self.tokenizer, self.task = generate, tokenizer, task
        self.buffer, self.hooks = buffer, hooks
        self.group_size, self.groups_per_step = group_size, groups_per_step
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.max_age, self.concurrency = max_age, concurrency
        self.max_retries, self.retry_delay_s = max_retries, retry_delay_s
        self.rng = random.Random(seed)
        self.seed = seed
        self.version = 0
        self.throttle = ProgressThrottle()
        self._inflight: dict[str, asyncio.Task] = {}
        self._changed = asyncio.Event()
        self._runner: asyncio.Task | None = None
        self._reports: list[asyncio.Task] = []
        self._count = 0
        self.tokens = 0
        self.groups_done = 0
        self.generate_s = 0.0
        self.errors: list[str] = []

    # ------------------------------------------------------------------ control
    def set_version(self, version: int) -> None:
        """The trainer moved on: stale groups go, and the scheduler hears the new demand now
        (with no shard awake, no finished group would tell it)."""
        self.version = int(version)
        self.buffer.drop_stale(self.version, self.max_age)
        self._changed.set()
        if self._runner is not None:
            self._reports.append(asyncio.get_running_loop().create_task(self._report()))
            self._reports = [t for t in self._reports if not t.done()]

    def start(self) -> None:
        if self._runner is None:
            self._runner = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        tasks = list(self._inflight.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.buffer.close()

    def in_flight(self) -> int:
        return len(self._inflight) * self.group_size

    async def wait_for(self, n_groups: int) -> None:
        """Until the buffer holds `n_groups` groups young enough for the current version."""
        while self.buffer.valid_groups(self.version, self.max_age) < n_groups:
            if self._runner is not None and self._runner.done():
                self._runner.result()  # the loop died: raise its error here
                raise RuntimeError("the collector stopped")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    def stats(self) -> dict:
        return {"tokens": self.tokens, "groups": self.groups_done, "generate_s": round(self.generate_s, 3),
                "errors": self.errors[-5:]}

    # ------------------------------------------------------------------ loop
    def _admit(self) -> bool:
        if len(self._inflight) >= self.concurrency:
            return False
        ready = self.buffer.valid_groups(self.version, self.max_age)
        return ready + len(self._inflight) < self.groups_per_step * (self.max_age + 1)

    async def _run(self) -> None:
        await self._report()
        while True:
            while self._admit():
                self._count += 1
                gid = f"g{self.seed}-{self._count}"
                self.buffer.note_started(self.group_size)
                task = asyncio.get_running_loop().create_task(self._group(gid))
                self._inflight[gid] = task
                task.add_done_callback(lambda t, gid=gid: self._done(gid, t))
            self._changed.clear()
            await self._changed.wait()

    def _done(self, gid: str, task: asyncio.Task) -> None:
        self._inflight.pop(gid, None)
        if task.cancelled():
            self.buffer.note_dropped(self.group_size, "shutdown")
        elif task.exception() is not None:
            self.buffer.note_dropped(self.group_size, f"generate failed: {task.exception()}"[:120])
            self.errors.append(str(task.exception()))
        self._changed.set()

    async def _group(self, gid: str) -> None:
        prompt = self.task.sample_prompt(self.rng)
        ids = list(self.tokenizer.encode(prompt.text, add_special_tokens=False))
        base = self.rng.randrange(1 << 30)
        t0 = time.perf_counter()
        trajectories = await asyncio.gather(*(self._sample(gid, i, prompt, ids, base + i)
                                              for i in range(self.group_size)))
        self.generate_s += time.perf_counter() - t0
        group = Group(gid, prompt.text, list(trajectories))
        self.groups_done += 1
        if group.version < self.version - self.max_age:
            self.buffer.note_dropped(len(group), "stale")
        else:
            self.buffer.put(group)
        await self._report()

    async def _sample(self, gid: str, i: int, prompt: Any, ids: list[int], seed: int) -> Trajectory:
        params = {"temperature": self.temperature, "max_tokens": self.max_new_tokens, "logprobs": 1,
                  "seed": seed}
        started = time.time()
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            try:
                out = await self.generate(ids, params, gid)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried, then the group is dropped
                last = exc
                await asyncio.sleep(self.retry_delay_s * (attempt + 1))
        else:
            raise GroupFailed(f"{type(last).__name__}: {last}")
        choice = out["choices"][0]
        tokens = list(choice["token_ids"])
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        if len(logprobs) != len(tokens):
            raise GroupFailed(f"engine returned {len(logprobs)} logprobs for {len(tokens)} tokens")
        versions: list[int] = []
        for span in choice.get("weight_versions") or []:
            v = int(span["version"])
            if v not in versions:
                versions.append(v)
        versions = versions or [self.version]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        self.tokens += len(tokens)
        return Trajectory(f"{gid}-{i}", gid, ids, tokens, logprobs, float(self.task.reward(prompt, text)),
                          min(versions), versions, str(choice.get("finish_reason")), started, time.time())

    async def _report(self) -> None:
        target = self.groups_per_step * self.group_size
        collected = min(self.buffer.valid_count(self.version, self.max_age), target)
        if self.throttle.should_report(collected, target):
            await self.hooks.report_progress(collected, target, self.version)
