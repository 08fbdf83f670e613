"""Held-out evaluation: greedy pass@1 and sampled pass@k of a policy on prompts it does not train on.

A pipeline's `eval:` section (EvalConfig) names its own task, the held-out set. Every `every`
steps (and after the last) the loop awaits `PeriodicEval`: the prompts go to the pipeline's own
shards through the same generate function the collector uses, so they are answered by the
weights just published (the loop publishes nothing while it waits), and nothing of it touches
the collector's accounting (no group is started, trained on or dropped). While it runs the
collector reports pending work, so that a time-shared pipeline keeps a shard for it. `rlix eval`
runs the same `Evaluator` alone, on an embedded engine in its own process (rlix.eval_command).

Per prompt: one greedy response and `k` sampled at `temperature`, scored together by the task's
group scoring (`Task.rewards`); a response passes when its reward is at least `threshold`. A
prompt whose generation or scoring fails is left out of the scores and counted (`failed`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlix.config.models import EvalConfig, PipelineConfig
from rlix.envs import make_task
from rlix.envs.tasks import Prompt, Rows, Task
from rlix.errors import InvalidRequestError, TaskError
from rlix.inference.server.openai_schema import GenerateSamplingParams
from rlix.pipeline.rollout.collector import Generate, TrajectoryCollector

log = logging.getLogger("rlix.pipeline")

#: a failed generate request is tried again this many times (the router already re-dispatches
#: the requests of a preempted shard; this covers a shard lost between two calls)
EVAL_RETRIES = 2
#: the first few failures are kept with a result, for the log line and `rlix eval`'s error
KEPT_ERRORS = 5


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of `k` responses passes, estimated from `n` sampled responses
    of which `c` passed: the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al., 2021, the
    HumanEval paper), the share of k-subsets of the n that hold a passing one.

    Why this estimator rather than "any of k passed": it is the same number when n == k (what an
    evaluation draws: 1 if any passed, else 0; unbiased, since the k are independent draws), and
    it also gives the sampled pass@1 from the same n responses (k=1: c/n), which "any of k"
    cannot. Averaged over prompts it estimates the policy's pass@k at that temperature."""
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a passing response
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class PromptScore:
    """One prompt's rewards: its greedy response's and its sampled ones' (k of them)."""

    greedy: float
    sampled: tuple[float, ...] = ()


@dataclass(frozen=True)
class EvalResult:
    """One evaluation: scores over the prompts scored (`prompts`; `failed` were left out).
    `pass_at_1`: greedy responses that pass; `pass_at_k`: prompts with a passing sample among
    their k (None: k = 0); `sampled_pass_at_1`: sampled responses that pass; `reward_mean` the
    greedy responses' mean reward, `sampled_reward_mean` the sampled ones'."""

    step: int
    prompts: int
    failed: int
    k: int
    threshold: float
    pass_at_1: float | None
    pass_at_k: float | None
    sampled_pass_at_1: float | None
    reward_mean: float | None
    sampled_reward_mean: float | None
    seconds: float
    errors: tuple[str, ...] = field(default_factory=tuple)

    def as_row(self) -> dict[str, float]:
        """The scores as metrics.jsonl and the trackers take them, `eval/` keys; scores that are
        not known (no prompt scored, or k = 0) are left out, never NaN."""
        scores = {"eval/pass@1": self.pass_at_1, "eval/pass@k": self.pass_at_k,
                  "eval/reward_mean": self.reward_mean, "eval/sampled_pass@1": self.sampled_pass_at_1,
                  "eval/sampled_reward_mean": self.sampled_reward_mean}
        row = {key: value for key, value in scores.items() if value is not None}
        row.update({"eval/k": float(self.k), "eval/prompts": float(self.prompts),
                    "eval/failed": float(self.failed), "eval/seconds": round(self.seconds, 3)})
        return row

    def line(self) -> str:
        """One line for a person: the pass rates, the prompts, the time."""
        def pct(v: float | None) -> str:
            return "-" if v is None else f"{v:.3f}"
        text = f"pass@1 {pct(self.pass_at_1)}"
        if self.k:
            text += f"  pass@{self.k} {pct(self.pass_at_k)}"
        text += f"  reward {pct(self.reward_mean)}  ({self.prompts} prompts"
        if self.failed:
            text += f", {self.failed} failed: {self.errors[0] if self.errors else '?'}"
        return text + f", {self.seconds:.1f}s)"


def summarize(step: int, scores: Sequence[PromptScore], *, failed: int, k: int, threshold: float,
              seconds: float, errors: Sequence[str] = ()) -> EvalResult:
    """The result of per-prompt rewards (pure: the arithmetic the tests check)."""
    def mean(values: list[float]) -> float | None:
        return statistics.fmean(values) if values else None

    greedy = [s.greedy for s in scores]
    sampled = [s for s in scores if s.sampled]
    return EvalResult(
        step=step, prompts=len(scores), failed=failed, k=k, threshold=threshold,
        pass_at_1=mean([float(r >= threshold) for r in greedy]),
        pass_at_k=mean([pass_at_k(len(s.sampled), sum(r >= threshold for r in s.sampled), len(s.sampled))
                        for s in sampled]) if k else None,
        sampled_pass_at_1=mean([pass_at_k(len(s.sampled), sum(r >= threshold for r in s.sampled), 1)
                                for s in sampled]) if k else None,
        reward_mean=mean(greedy),
        sampled_reward_mean=mean([r for s in sampled for r in s.sampled]) if k else None,
        seconds=seconds, errors=tuple(errors)[:KEPT_ERRORS])


def held_out_prompts(task: Task, samples: int, seed: int) -> list[Prompt]:
    """The evaluation's prompts, chosen once: the first `samples` of a task with numbered rows
    (each once), else `samples` drawn from the task with a seed of the evaluation's own."""
    if isinstance(task, Rows):
        return [task.prompt(i) for i in range(min(samples, len(task)))]
    rng = random.Random(f"{seed}/eval")
    return [task.sample_prompt(rng) for _ in range(samples)]


def prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """What the engine gets for `prompt`, as the collector renders a training prompt: chat
    messages through the model's chat template (generation prompt added), else the text as it is."""
    if prompt.messages is None:
        return list(tokenizer.encode(prompt.text, add_special_tokens=False))
    ids = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return [int(t) for t in ids]


def response_text(tokenizer: Any, token_ids: list[int], stop: Sequence[str]) -> str:
    """A response's text as the reward sees it in training: decoded, cut before the first stop string."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(cuts)] if cuts else text


class Evaluator:
    """Evaluates a task's held-out prompts through `generate` (see the module doc). The prompts
    are chosen once, so every evaluation scores the same ones; the sampled responses' seeds
    depend only on the prompt and the sample, so two evaluations differ by the weights alone."""

    def __init__(self, cfg: EvalConfig, task: Task, generate: Generate, tokenizer: Any, *,
                 max_new_tokens: int, stop: Sequence[str] = (), seed: int = 0, concurrency: int = 8,
                 retry_delay_s: float = 0.5) -> None:
        self.cfg, self.task, self.generate, self.tokenizer = cfg, task, generate, tokenizer
        self.max_new_tokens, self.stop, self.seed = max_new_tokens, list(stop), seed
        self.concurrency, self.retry_delay_s = max(1, concurrency), retry_delay_s
        self.prompts = held_out_prompts(task, cfg.samples, seed)

    def _params(self, index: int, sample: int | None) -> GenerateSamplingParams:
        """Greedy (`sample` None) or the sample's own seeded draw at the eval temperature."""
        stop = {"stop": list(self.stop)} if self.stop else {}
        if sample is None:
            return GenerateSamplingParams(temperature=0.0, max_tokens=self.max_new_tokens, **stop)
        seed = random.Random(f"{self.seed}/eval/{index}/{sample}").randrange(1 << 31)
        return GenerateSamplingParams(temperature=self.cfg.temperature, max_tokens=self.max_new_tokens,
                                      seed=seed, **stop)

    async def _generate(self, ids: list[int], params: GenerateSamplingParams, session: str) -> list[int]:
        for attempt in range(EVAL_RETRIES + 1):
            try:
                return list((await self.generate(ids, params, session)).token_ids)
            except InvalidRequestError:  # the request itself is wrong: retrying won't help
                raise
            except Exception:  # noqa: BLE001 - a lost shard, a timeout: tried again
                if attempt == EVAL_RETRIES:
                    raise
                await asyncio.sleep(self.retry_delay_s * (attempt + 1))
        raise AssertionError("unreachable")

    async def _one(self, step: int, index: int, prompt: Prompt) -> PromptScore:
        ids = prompt_ids(self.tokenizer, prompt)
        session = f"eval-{step}-{index}"  # one shard for the prompt's responses: its prefix cached once
        draws = [None, *range(self.cfg.k)]
        outputs = await asyncio.gather(*(self._generate(ids, self._params(index, s), session) for s in draws))
        texts = [response_text(self.tokenizer, out, self.stop) for out in outputs]
        rewards = await self.task.rewards(prompt, texts)
        if len(rewards) != len(texts):
            raise TaskError(f"the task gave {len(rewards)} rewards for {len(texts)} responses")
        return PromptScore(float(rewards[0]), tuple(float(r) for r in rewards[1:]))

    async def evaluate(self, step: int) -> EvalResult:
        """Every held-out prompt, `concurrency` at once; failures are counted, not raised."""
        t0 = time.perf_counter()
        gate = asyncio.Semaphore(self.concurrency)

        async def bounded(index: int, prompt: Prompt) -> PromptScore:
            async with gate:
                return await self._one(step, index, prompt)

        answers = await asyncio.gather(*(bounded(i, p) for i, p in enumerate(self.prompts)),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer  # a cancellation (the run stops): not a failed prompt
        scores = [a for a in answers if isinstance(a, PromptScore)]
        errors = [" ".join(f"{type(a).__name__}: {a}".split())[:200] for a in answers if isinstance(a, Exception)]
        return summarize(step, scores, failed=len(errors), k=self.cfg.k, threshold=self.cfg.threshold,
                         seconds=time.perf_counter() - t0, errors=errors)


class PeriodicEval:
    """The loop's evaluation (GrpoLoop's `evaluate`): at every `eval.every`-th step and the last,
    the held-out scores of the weights just published; None at the other steps."""

    def __init__(self, cfg: PipelineConfig, evaluator: Evaluator, collector: TrajectoryCollector) -> None:
        self.every, self.last, self.name = cfg.eval.every, cfg.steps, cfg.name
        self.evaluator, self.collector = evaluator, collector
        self.results: list[EvalResult] = []

    @classmethod
    def of(cls, cfg: PipelineConfig, collector: TrajectoryCollector) -> PeriodicEval | None:
        """The pipeline's periodic evaluation, through its collector's generate function and
        tokenizer; None without one (`eval.every` 0)."""
        if not cfg.eval.every or cfg.eval.task is None:
            return None
        evaluator = Evaluator(cfg.eval, make_task(cfg.eval.task), collector.generate, collector.tokenizer,
                              max_new_tokens=cfg.rollout.max_new_tokens, stop=cfg.rollout.stop, seed=cfg.seed,
                              concurrency=cfg.rollout.concurrency)
        return cls(cfg, evaluator, collector)

    def due(self, step: int) -> bool:
        return step > 0 and (step % self.every == 0 or step == self.last)

    async def __call__(self, step: int) -> EvalResult | None:
        if not self.due(step):
            return None
        with self.collector.other_work():
            result = await self.evaluator.evaluate(step)
        self.results.append(result)
        log.info("%s eval at step %d: %s", self.name, step, result.line())
        return result
