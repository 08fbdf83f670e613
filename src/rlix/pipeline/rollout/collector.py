"""The async trajectory collector: keeps the pipeline's shards busy and fills the buffer.

Groups (one prompt x `group_size` samples, session-sticky to one shard) are generated
concurrently through the router, one request per sample; each answer comes back typed
(`Generation`: token ids, logprobs, weight-version spans, finish reason). With an agent
environment (`episodes`), each sample is instead one multi-turn episode run by the
environment's agent server, stitched into the exact sampled tokens with context masked
(agents/rollout.py); a failed episode is retried, and counted with its reason when it stays failed.
Admission control: at most `concurrency` groups in flight per awake shard (a pipeline the
scheduler gives a second shard gets twice the work in flight, not the same work split in two,
which would leave both shards half full), and no new group starts while the young-enough groups
buffered plus those in flight already cover one batch for each step that can still train on it:
`max_age + 1` steps, one fewer once this version's batch is taken (`take`), none past the last
step (`steps`); more could only go stale before the trainer reaches them. While the shards are
refit to a new version, no group starts (`set_version(held=True)` .. `open_admission`). A group
that still finishes too old is dropped and counted ("stale"). Demand goes to the hooks as a
`RolloutDemand` (the next step's collected vs target, and what the window can still use:
the scheduler plans shards on the latter), throttled to 2% steps of the window and sent on
every version change.
A failed request is retried a few times (the router already re-dispatches preempted ones); then
its whole group is dropped with the reason. Every trajectory started is accounted for exactly
once in the buffer's counters, whatever happens to its group.

Response lengths: with `rollout.length_tail` set, each sample's request carries its own
`max_tokens`, drawn from that heavy-tailed distribution (`length_limit`: keyed by the
collector's seed and the sample's place, like its sampling seed, so the same config draws the
same limits whatever the timing, and the prompts drawn are the same as without it) and capped
at `max_new_tokens`. Agent episodes ignore it (their turns' limit is the environment's), and
`rollout.ignore_eos` (samples run to their limit: benchmarks of random-weight models).

Prompts: a task's prompt with chat messages (`Prompt.messages`) is rendered with the model's chat
template, generation prompt added (`tokenizer.apply_chat_template`), and those ids are what the
engine gets and the trainer trains on; a plain prompt's text is tokenized as it is. Rewards: once
every sample of a group has finished, the task scores them together (`Task.rewards`), each on
its text cut before the first of `rollout.stop`'s strings (as vLLM's text is; the engine ends a
sample there, and its token ids, through the one that completed the string, are what is trained).
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rlix.agents.episodes import Unstitchable
from rlix.agents.protocol import Example
from rlix.agents.rollout import AgentEpisodes
from rlix.config.models import LengthTail, RolloutConfig
from rlix.envs.tasks import Prompt, Task
from rlix.errors import CollectorError, EpisodeError, InvalidRequestError, PipelineStalledError
from rlix.inference.router.router import Generation, VersionSpan
from rlix.inference.server.openai_schema import GenerateSamplingParams
from rlix.pipeline.rollout.buffer import ReplayBuffer
from rlix.pipeline.hooks import ProgressThrottle, RLixHooks
from rlix.pipeline.rollout.rate import ShardRate
from rlix.pipeline.rollout.types import Group, RolloutDemand, Trajectory

#: (prompt token ids, sampling params, session id) -> the answer; the pipeline's router in-process
Generate = Callable[[list[int], GenerateSamplingParams, str | None], Awaitable[Generation]]


class GroupDropped(Exception):
    """Internal: this group cannot be used; `reason` is what the accounting records."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason[:160]


@dataclass
class _Pending:
    task: asyncio.Task
    accounted: bool = False  # its trajectories are already in the buffer's counters


def sample_seed(seed: int, group_index: int, sample: int) -> int:
    """A per-sample sampling seed that depends only on the collector's seed and the sample's
    place, not on timing: the same config draws the same prompts and the same seeds."""
    return random.Random(f"{seed}/{group_index}/{sample}").randrange(1 << 31)


def length_limit(tail: LengthTail | None, max_new_tokens: int, seed: int, group_index: int, sample: int) -> int:
    """A sample's generation limit: `max_new_tokens` without a tail; else a draw from `tail`
    (rounded, within [tail.min, max_new_tokens]) that depends only on the collector's seed and
    the sample's place (its own stream, apart from prompts and sampling seeds)."""
    if tail is None:
        return max_new_tokens
    rng = random.Random(f"{seed}/{group_index}/{sample}/length")
    if tail.dist == "lognormal":
        assert tail.sigma is not None
        x = rng.lognormvariate(math.log(tail.median), tail.sigma)
    else:  # pareto, scaled so that its median is tail.median
        assert tail.alpha is not None
        x = tail.median / 2 ** (1 / tail.alpha) * rng.paretovariate(tail.alpha)
    return max(tail.min, min(max_new_tokens, round(x)))


def parse_versions(spans: list[VersionSpan], n_tokens: int) -> list[int]:
    """The distinct weight versions of a generate answer's spans, in order. Unknown versions
    or spans that do not cover every token make the answer unusable: its age is unprovable."""
    if n_tokens == 0:
        return []
    versions: list[int] = []
    covered = 0
    for span in sorted(spans, key=lambda s: s.start):
        if span.version is None:
            raise GroupDropped("unknown weight version")
        if span.start > covered:
            break
        covered = max(covered, span.end)
        if span.version not in versions:
            versions.append(span.version)
    if covered < n_tokens:
        raise GroupDropped(f"weight versions cover {covered} of {n_tokens} tokens")
    return versions


class TrajectoryCollector:
    """See module doc. `rollout` is the pipeline's `rollout:` section; `max_age` its
    `max_staleness`; `steps` the version at which the pipeline stops (None: never)."""

    def __init__(self, generate: Generate, tokenizer: Any, task: Task, buffer: ReplayBuffer,
                 hooks: RLixHooks, rollout: RolloutConfig, *, max_age: int, seed: int = 0,
                 max_retries: int = 3, retry_delay_s: float = 0.5, granularity: float = 0.02,
                 max_failed_groups: int = 32, episodes: AgentEpisodes | None = None,
                 active_shards: Callable[[], int] | None = None, steps: int | None = None,
                 shard_load: Callable[[], dict[int, int]] | None = None, pipeline: str = "") -> None:
        if max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {max_age}")
        self.generate, self.tokenizer, self.task = generate, tokenizer, task
        self.buffer, self.hooks = buffer, hooks
        self.episodes = episodes  # agent episodes instead of one generate per trajectory
        # shard-seconds per trajectory, reported for the planner's move costs (None: not known)
        self.rate = ShardRate(active_shards) if active_shards is not None else None
        self.active_shards = active_shards  # None: one shard's worth in flight, whatever serves
        # requests outstanding per active shard (the router's), sent with each report: the
        # scheduler does not take a busy shard for an equal pipeline (None: not reported)
        self.shard_load = shard_load
        self.group_size, self.groups_per_step = rollout.group_size, rollout.groups_per_step
        self.max_new_tokens, self.temperature = rollout.max_new_tokens, rollout.temperature
        self.length_tail = rollout.length_tail  # None: every sample may run to max_new_tokens
        self.length_limits: deque[int] = deque(maxlen=4096)  # the latest limits drawn (stats)
        self.ignore_eos = rollout.ignore_eos  # samples run to their limit (random-weight benchmarks)
        self.stop_strings = list(rollout.stop)  # stop strings: the engine ends a sample at one, the reward sees before it
        self.max_age, self.concurrency = max_age, rollout.concurrency
        self.steps = steps
        self.max_retries, self.retry_delay_s = max_retries, retry_delay_s
        self.seed = seed
        self.rng = random.Random(seed)  # prompts, drawn in admission order
        self.version = 0
        self.throttle = ProgressThrottle(granularity)
        self._pending: dict[str, _Pending] = {}
        self._changed = asyncio.Event()  # buffer, version or in-flight set changed
        self._report_due = asyncio.Event()
        self._batch_wanted = False  # the trainer waits in wait_for
        self._other_work = 0  # requests besides training at the router (other_work), e.g. an evaluation
        self._taken = False  # the batch of the step at this version was taken (`take`)
        self._held = False  # no admission until `open_admission` (a refit is under way)
        self._runner: asyncio.Task | None = None
        self._reporter: asyncio.Task | None = None
        self._stopped = False
        self._count = 0
        # stats
        self.tokens = 0
        self.groups_done = 0
        self.requests = 0
        self.retries = 0
        self.generate_s = 0.0
        self.peak_admitted = 0  # max of (valid groups buffered + groups in flight) at admission
        self.reports = 0
        self.errors: deque[str] = deque(maxlen=50)  # the latest drop reasons and report failures
        # groups that failed in a row (reward or generation); at max_failed_groups the pipeline
        # stops with the last reason instead of generating forever for nothing
        self.max_failed_groups = max_failed_groups
        self.failed_in_a_row = 0
        self.fatal: PipelineStalledError | None = None
        self.pipeline = pipeline  # how the stall error names the pipeline

    # ------------------------------------------------------------------ control
    @property
    def target(self) -> int:
        return self.groups_per_step * self.group_size

    @property
    def limit(self) -> int:
        """Groups that may be buffered (valid) or in flight at once: one batch for each step that
        can still train on a group started now. At version v those are the steps whose batch is
        taken at v .. v + max_age, less the one taken at v once it is (`take`), and none past
        the last step (`steps`)."""
        batches = self.max_age + 1
        if self.steps is not None:
            batches = min(batches, self.steps - self.version)
        return self.groups_per_step * max(0, batches - int(self._taken))

    def take(self, n_groups: int) -> list[Group]:
        """The next step's batch (the oldest valid groups, counted as trained). Until the version
        moves, the window is one batch shorter: a group started while the trainer trains can
        serve only the steps after this one (counted for the batch just taken, it would be one
        batch too many and go stale a step later)."""
        groups = self.buffer.take(n_groups, self.version, self.max_age)
        self._taken = True
        self._report_due.set()
        return groups

    def set_version(self, version: int, *, held: bool = False) -> None:
        """The trainer moved on: stale groups go, and the scheduler hears the new demand now
        (with no shard awake, no finished group would tell it). `held`: no new group starts until
        `open_admission` (the shards are being refit: a group started on the old weights is a
        version older than the window counts it, and goes stale a step early)."""
        self.version = int(version)
        self._taken = False
        self._held = held
        self.buffer.drop_stale(self.version, self.max_age)
        self.throttle.reset()
        self._changed.set()
        self._report_due.set()

    def open_admission(self) -> None:
        """The shards serve the current version: new groups may start (see `set_version`)."""
        self._held = False
        self._changed.set()

    def start(self) -> None:
        if self._stopped:
            raise CollectorError("a stopped collector cannot start again")
        if self._runner is None:
            loop = asyncio.get_running_loop()
            self._runner = loop.create_task(self._run(), name="collector")
            self._reporter = loop.create_task(self._report_loop(), name="collector-progress")
            self._report_due.set()

    async def stop(self) -> None:
        """Cancel everything; groups in flight count as dropped ("shutdown"), what is buffered
        as "unused at shutdown". Idempotent."""
        self._stopped = True
        for task in (self._runner, self._reporter):
            if task is not None:
                task.cancel()
        pending = list(self._pending.values())
        for p in pending:
            p.task.cancel()
        await asyncio.gather(*(t for t in (self._runner, self._reporter) if t is not None),
                             *(p.task for p in pending), return_exceptions=True)
        for gid, p in list(self._pending.items()):  # those whose done-callback has not run yet
            self._settle(gid, p, "shutdown")
        self._changed.set()
        self.buffer.close()

    def in_flight(self) -> int:
        """Trajectories started but not yet accounted for (for check_conservation)."""
        return sum(self.group_size for p in self._pending.values() if not p.accounted)

    def groups_in_flight(self) -> int:
        return len(self._pending)

    def pending_work(self) -> bool:
        """Generation work waits on this pipeline now: groups in flight at its router, the
        trainer waiting for its batch, or requests of its own besides training (`other_work`).
        Sent beside the demand figure as evidence: the scheduler keeps such a pipeline one
        shard whatever that figure says."""
        return bool(self._pending) or self._batch_wanted or self._other_work > 0

    @contextmanager
    def other_work(self) -> Iterator[None]:
        """The pipeline sends requests of its own through the router meanwhile (a held-out
        evaluation): pending work while they run, reported at once, so that a time-shared
        pipeline whose window is full keeps a shard to answer them."""
        self._other_work += 1
        self.throttle.reset()
        self._report_due.set()
        try:
            yield
        finally:
            self._other_work -= 1
            self.throttle.reset()
            self._report_due.set()

    async def wait_for(self, n_groups: int, timeout: float | None = None) -> None:
        """Until the buffer holds `n_groups` groups young enough for the current version.
        Raises CollectorError if the collector stops or dies meanwhile (with its cause)."""
        async def wait() -> None:
            while self.buffer.valid_groups(self.version, self.max_age) < n_groups:
                self._raise_if_dead()
                self._changed.clear()
                await self._changed.wait()
        self._batch_wanted = True
        try:
            await asyncio.wait_for(wait(), timeout)
        finally:
            self._batch_wanted = False

    def _raise_if_dead(self) -> None:
        if self.fatal is not None:
            raise self.fatal
        if self._stopped:
            raise CollectorError("the collector was stopped")
        if self._runner is not None and self._runner.done():
            exc = None if self._runner.cancelled() else self._runner.exception()
            raise CollectorError(f"the collector died: {exc!r}") from exc

    def stats(self) -> dict:
        return {"tokens": self.tokens, "groups": self.groups_done, "requests": self.requests,
                "retries": self.retries, "generate_s": round(self.generate_s, 3),
                "in_flight_groups": len(self._pending), "peak_admitted": self.peak_admitted,
                "reports": self.reports, "errors": list(self.errors)[-5:],
                "failed_in_a_row": self.failed_in_a_row,
                **({"episode_turns": self.episodes.turns, "tool_calls": self.episodes.tool_calls,
                    "episodes_running": self.episodes.running} if self.episodes else {}),
                **({"length_limits": _quantiles(self.length_limits)} if self.length_limits else {})}

    # ------------------------------------------------------------------ admission
    @property
    def in_flight_limit(self) -> int:
        """Groups that may be in flight now: `concurrency` per awake shard, at least one shard's worth."""
        shards = self.active_shards() if self.active_shards is not None else 1
        return self.concurrency * max(1, shards)

    def shards_changed(self) -> None:
        """Shards were woken or put to sleep: admission looks again (a woken one may take more)."""
        self._changed.set()

    def _admit(self) -> bool:
        if self._held or len(self._pending) >= self.in_flight_limit:
            return False
        ready = self.buffer.valid_groups(self.version, self.max_age)
        return ready + len(self._pending) < self.limit

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self._admit():
                self._count += 1
                gid = f"g{self.seed}-{self._count}"
                prompt = self.task.sample_prompt(self.rng)
                self.buffer.note_started(self.group_size)
                task = loop.create_task(self._group(gid, self._count, prompt), name=gid)
                self._pending[gid] = _Pending(task)
                task.add_done_callback(lambda t, gid=gid: self._done(gid, t))
                self.peak_admitted = max(self.peak_admitted, len(self._pending) +
                                         self.buffer.valid_groups(self.version, self.max_age))
            self._changed.clear()
            await self._changed.wait()

    def _settle(self, gid: str, p: _Pending, reason: str | None) -> None:
        """Account for a group that will not reach the buffer (once)."""
        if not p.accounted and reason is not None:
            self.buffer.note_dropped(self.group_size, reason)
        p.accounted = True
        self._pending.pop(gid, None)

    def _done(self, gid: str, task: asyncio.Task) -> None:
        p = self._pending.get(gid)
        if p is None:
            return
        if task.cancelled():
            reason: str | None = "shutdown"
        elif isinstance(failure := task.exception(), GroupDropped):
            reason = failure.reason
        elif task.exception() is not None:
            exc = task.exception()
            reason = f"collector error: {type(exc).__name__}: {exc}"[:160]
        else:
            reason = None
        if reason is not None and reason != "shutdown":
            self.errors.append(f"{gid}: {reason}")
        self._count_failure(reason)
        self._settle(gid, p, reason)
        self._changed.set()
        self._report_due.set()

    def _count_failure(self, reason: str | None) -> None:
        if reason is None:
            self.failed_in_a_row = 0
            return
        if reason == "shutdown" or self.fatal is not None:
            return
        self.failed_in_a_row += 1
        if self.max_failed_groups and self.failed_in_a_row >= self.max_failed_groups:
            who = f"pipeline {self.pipeline}: " if self.pipeline else ""
            self.fatal = PipelineStalledError(f"{who}{self.failed_in_a_row} groups in a row failed "
                                              f"(max_failed_groups); the last: {reason}")

    # ------------------------------------------------------------------ one group
    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """What the engine gets for `prompt`: its chat messages rendered with the model's chat
        template (generation prompt added), or its plain text tokenized as it is."""
        if prompt.messages is None:
            return list(self.tokenizer.encode(prompt.text, add_special_tokens=False))
        try:
            ids = self.tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
        except Exception as exc:  # noqa: BLE001 - no template, or one that refuses these messages
            raise GroupDropped(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        return [int(t) for t in ids]

    def response_text(self, token_ids: list[int]) -> str:
        """A sample's text as the reward sees it: decoded, cut before the first stop string."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if self.stop_strings:
            cut = min((i for i in (text.find(s) for s in self.stop_strings) if i >= 0), default=len(text))
            text = text[:cut]
        return text

    async def _group(self, gid: str, index: int, prompt: Prompt) -> None:
        ids = [] if self.episodes else self.prompt_ids(prompt)
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:  # one failure cancels its siblings
                samples = [tg.create_task(self._trajectory(gid, index, i, ids, prompt,
                                                           sample_seed(self.seed, index, i)))
                           for i in range(self.group_size)]
        except BaseExceptionGroup as eg:
            dropped = [e for e in eg.exceptions if isinstance(e, GroupDropped)]
            raise (dropped[0] if dropped else eg.exceptions[0]) from None
        finally:
            self.generate_s += time.perf_counter() - t0
        trajectories = [s.result() for s in samples]
        if self.episodes is None:  # an episode's reward is its environment's
            await self._score(prompt, trajectories)
        group = Group(gid, prompt.text, trajectories)
        self.groups_done += 1
        if self.rate is not None:
            self.rate.tick(True, len(group.trajectories))
        p = self._pending[gid]
        if not self.buffer.fresh(group.version, self.version, self.max_age):
            self.buffer.note_dropped(len(group), "stale")
        else:
            self.buffer.put(group)
        p.accounted = True  # from here on, cancellation must not count it again

    async def _score(self, prompt: Prompt, trajectories: list[Trajectory]) -> None:
        """The task's rewards for a group's samples (all at once: a reward function may batch)."""
        texts = [self.response_text(t.response_ids) for t in trajectories]
        try:
            rewards = await self.task.rewards(prompt, texts)
            if len(rewards) != len(texts):
                raise CollectorError(f"the task gave {len(rewards)} rewards for {len(texts)} responses")
            for t, r in zip(trajectories, rewards):
                t.reward = float(r)
        except Exception as exc:  # noqa: BLE001 - the task's (user's) code
            raise GroupDropped(f"reward failed: {type(exc).__name__}: {exc}") from exc

    async def _trajectory(self, gid: str, index: int, i: int, ids: list[int], prompt: Prompt,
                          seed: int) -> Trajectory:
        """One sample, unscored (its group is scored whole, `_score`)."""
        if self.episodes is not None:
            return await self._episode(gid, i, prompt, seed)
        limit = length_limit(self.length_tail, self.max_new_tokens, self.seed, index, i)
        tokens, logprobs, versions, finish, started = await self._sample(gid, ids, seed, limit)
        versions = versions or [self.version]  # no tokens: nothing of it can be stale
        return Trajectory(f"{gid}-{i}", gid, ids, tokens, logprobs, 0.0, min(versions), versions, finish,
                          started, time.time())

    async def _sample(self, gid: str, ids: list[int], seed: int, max_tokens: int | None = None
                      ) -> tuple[list[int], list[float], list[int], str, float]:
        max_tokens = self.max_new_tokens if max_tokens is None else max_tokens
        if self.length_tail is not None:
            self.length_limits.append(max_tokens)
        params = GenerateSamplingParams(temperature=self.temperature, max_tokens=max_tokens, logprobs=1,
                                        seed=seed, ignore_eos=self.ignore_eos,
                                        **({"stop": list(self.stop_strings)} if self.stop_strings else {}))
        started = time.time()
        for attempt in range(self.max_retries + 1):
            self.requests += 1
            try:
                out = await self.generate(ids, params, gid)
                break
            except InvalidRequestError as exc:  # the request itself is wrong: retrying won't help
                raise GroupDropped(f"generate failed: {type(exc).__name__}: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - network, no active shard, engine: retried
                if attempt == self.max_retries:
                    raise GroupDropped(f"generate failed: {type(exc).__name__}: {exc}") from exc
                self.retries += 1
                await asyncio.sleep(self.retry_delay_s * (attempt + 1))
        tokens, logprobs = out.token_ids, out.logprobs
        if len(logprobs) != len(tokens):
            raise GroupDropped(f"engine returned {len(logprobs)} logprobs for {len(tokens)} tokens")
        versions = parse_versions(out.weight_versions, len(tokens))
        self.tokens += len(tokens)
        return tokens, logprobs, versions, out.finish_reason, started

    async def _episode(self, gid: str, i: int, prompt: Prompt, seed: int) -> Trajectory:
        """One agent episode (retried when its environment failed); its sample is the engine's
        exact tokens, context masked (agents/episodes.py), its reward the environment's."""
        assert self.episodes is not None
        example = Example(prompt=prompt.text, answer=prompt.answer, meta=dict(prompt.meta))
        started = time.time()
        retries = self.episodes.cfg.episode_retries
        for attempt in range(retries + 1):
            self.requests += 1
            try:
                ep = await self.episodes.run(f"{gid}-{i}-a{attempt}", example, seed + attempt)
                break
            except Unstitchable as exc:
                raise GroupDropped(str(exc)) from exc
            except EpisodeError as exc:
                self.errors.append(str(exc)[:200])
                if attempt == retries:
                    raise GroupDropped(f"episode failed: {exc.reason}") from exc
                self.retries += 1
                await asyncio.sleep(self.retry_delay_s * (attempt + 1))
        versions: list[int] = []
        for turn in ep.trace.turns:
            for v in parse_versions(turn.versions, len(turn.token_ids)):
                if v not in versions:
                    versions.append(v)
        versions = versions or [self.version]
        sample = ep.sample
        self.tokens += sample.sampled_tokens
        return Trajectory(f"{gid}-{i}", gid, sample.prompt_ids, sample.response_ids, sample.logprobs,
                          float(ep.result.reward), min(versions), versions, ep.trace.turns[-1].finish_reason,
                          started, time.time(), loss_mask=sample.loss_mask)

    # ------------------------------------------------------------------ progress
    def demand(self) -> RolloutDemand:
        """The next step's collected vs target, and what the window can still use."""
        valid = self.buffer.valid_count(self.version, self.max_age)
        window = self.limit * self.group_size
        return RolloutDemand(min(valid, self.target), self.target, max(window - valid, 0))

    def turns_outstanding(self, collected: int, target: int) -> int | None:
        """Agent episodes: policy calls still to come, at most (None without episodes)."""
        if self.episodes is None:
            return None
        return self.episodes.turns_outstanding(max(target - collected, 0))

    def _throttled(self, demand: RolloutDemand) -> bool:
        """Whether this demand is worth sending: the window's share collected crossed a band."""
        window = self.limit * self.group_size
        return self.throttle.should_report(window - demand.outstanding, window)

    def demand_for_release(self) -> RolloutDemand:
        """The demand now, for the loop to send with its GPU release; recorded as reported, so
        the reporter loop does not send the same report again."""
        demand = self.demand()
        self._throttled(demand)
        self.reports += 1
        return demand

    async def _report_loop(self) -> None:
        """One reporter, latest state only: a slow control plane never blocks generation, and
        a failing one never touches the accounting."""
        while True:
            await self._report_due.wait()
            self._report_due.clear()
            demand = self.demand()
            if not self._throttled(demand):
                continue
            try:
                turns = self.turns_outstanding(demand.collected, demand.target)
                extra: dict[str, Any] = {} if turns is None else {"turns_outstanding": turns}
                if self.rate is not None:
                    self.rate.tick(self.pending_work())
                    spt = self.rate.seconds_per_trajectory()
                    if spt is not None:
                        extra["seconds_per_trajectory"] = spt
                if self.shard_load is not None:
                    extra["shard_load"] = self.shard_load()
                await self.hooks.report_progress(demand, self.version,
                                                 pending_work=self.pending_work(), **extra)
                self.reports += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - kept in stats; the next change retries
                self.errors.append(f"report_progress: {type(exc).__name__}: {exc}")
                self.throttle.reset()


def _quantiles(values: Any) -> dict[str, float]:
    """The limits drawn lately: how many, and their median, p90, p99 and largest."""
    qs = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"n": len(values), "p50": round(qs[49], 1), "p90": round(qs[89], 1), "p99": round(qs[98], 1),
            "max": max(values)}
