"""The task protocol and the built-in tasks.

A task draws prompts and scores a group's responses in [0, 1] (`rewards`, a coroutine: a
user's reward function may be async, or score the whole group at once). Rewards are graded (partial credit), so
GRPO's within-group differences carry signal even while the policy is still bad: an
all-or-nothing reward gives a random tiny model groups of all zeros, hence no gradient.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlix.envs.verifiers import numeric_credit


@dataclass(frozen=True)
class Prompt:
    """What the model sees and what the reward checks against (`answer`, opaque to everything
    but the task); `meta` is carried along (a dataset row, whole).

    Without `messages` the model sees `text` as plain text (tokenized as it is). With
    `messages` (chat messages, `[{"role": ..., "content": ...}, ...]`) the collector renders
    them with the model's chat template, generation prompt added, so that an instruct model is
    trained on prompts as it is served; `text` is then what logs and samples show."""

    text: str
    answer: Any = None
    meta: dict = field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None


@runtime_checkable
class Task(Protocol):
    name: str

    def sample_prompt(self, rng: random.Random) -> Prompt: ...

    async def rewards(self, prompt: Prompt, responses: list[str]) -> list[float]:
        """One reward in [0, 1] per response of a group (all answers to `prompt`), in order."""
        ...


class Rows:
    """Base of tasks whose prompts form a fixed, numbered set (a file's rows, a generator's
    entries by index): a held-out evaluation takes the first N of them in order, each once,
    where drawing with `sample_prompt` would repeat some and skip others."""

    def __len__(self) -> int:
        raise NotImplementedError

    def prompt(self, index: int) -> Prompt:
        raise NotImplementedError


class EachResponse:
    """Base of tasks that score each response alone and at once (`reward`): `rewards` is
    `reward` over the group."""

    def reward(self, prompt: Prompt, response: str) -> float:
        raise NotImplementedError

    async def rewards(self, prompt: Prompt, responses: list[str]) -> list[float]:
        return [float(self.reward(prompt, r)) for r in responses]


class PatternTask(EachResponse):
    """"Repeat: ab" -> the share of the first `length` characters of the response that follow
    abab... A single fixed character (the default, ["a"]) is what a tiny random model learns
    within a few dozen GRPO steps; several patterns, chosen by the prompt, take longer. Prefer a
    character that no multi-character token contains ("z", "7" with the tiny preset): with "a",
    policies can settle on a token like "ab" that earns a steady half reward."""

    name = "pattern"

    def __init__(self, patterns: list[str] | None = None, length: int = 12) -> None:
        self.patterns = list(patterns or ["a"])
        if any(not p for p in self.patterns) or length < 1:
            raise ValueError("patterns must be non-empty strings and length >= 1")
        self.length = int(length)

    def sample_prompt(self, rng: random.Random) -> Prompt:
        pattern = rng.choice(self.patterns)
        return Prompt(f"Repeat: {pattern}\n", pattern)

    def reward(self, prompt: Prompt, response: str) -> float:
        target = (str(prompt.answer) * self.length)[: self.length]
        return sum(1 for a, b in zip(response[: self.length], target) if a == b) / self.length


class ArithmeticTask(EachResponse):
    """"a+b=" with a verifiable sum; partial credit for a number of the right length."""

    name = "arithmetic"

    def __init__(self, max_operand: int = 9) -> None:
        self.max_operand = int(max_operand)

    def sample_prompt(self, rng: random.Random) -> Prompt:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Prompt(f"{a}+{b}=", a + b)

    def reward(self, prompt: Prompt, response: str) -> float:
        return numeric_credit(prompt.answer, response)
