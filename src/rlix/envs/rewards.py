"""The user's reward function of a `dataset` task: it sees the response and the whole row.

Two forms, each sync or async (a coroutine function, or any callable returning an awaitable):

    def reward(response: str, row: dict) -> float
    def reward_batch(responses: list[str], rows: list[dict]) -> list[float]

`reward` is called once per response (the async ones of a group run concurrently);
`reward_batch` once per group (every sample of one prompt, so `rows` holds the same row once per
response), for scorers that batch (a model judge, a sandbox). Each row is a fresh shallow copy:
a function that edits it changes nothing for the next call. Values are clamped into [0, 1];
one that raises, returns NaN or returns no number is a TaskError naming the function.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlix.envs.errors import TaskFieldError
from rlix.envs.verifiers import load_function
from rlix.errors import ConfigError, TaskError


def clamp_reward(value: Any, who: str) -> float:
    """`value` as a reward in [0, 1]; TaskError naming `who` for NaN or a non-number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy scalars, 0-d tensors, Decimal
        except (TypeError, ValueError):
            raise TaskError(f"{who} returned {type(value).__name__}, not a number") from None
    value = float(value)
    if math.isnan(value):
        raise TaskError(f"{who} returned NaN")
    return min(max(value, 0.0), 1.0)


async def _resolved(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@dataclass(frozen=True)
class RowReward:
    """A loaded reward function: `spec` as configured, `batch` for the reward_batch form."""

    spec: str
    fn: Callable[..., Any]
    batch: bool

    @classmethod
    def load(cls, reward: str | None, reward_batch: str | None) -> RowReward:
        """From the task's `reward` or `reward_batch` (exactly one is set; TaskConfig checks)."""
        field, spec = ("reward_batch", reward_batch) if reward_batch is not None else ("reward", reward)
        assert spec is not None
        try:
            fn = load_function(spec, field)
        except ConfigError as exc:
            raise TaskFieldError(field, str(exc)) from None
        return cls(spec, fn, batch=field == "reward_batch")

    @property
    def who(self) -> str:
        return f"{'reward_batch' if self.batch else 'reward'} {self.spec!r}"

    async def __call__(self, responses: list[str], row: dict[str, Any]) -> list[float]:
        """One reward per response, each in [0, 1]."""
        try:
            if self.batch:
                values = await _resolved(self.fn(list(responses), [dict(row) for _ in responses]))
            else:
                values = await asyncio.gather(*(_resolved(self.fn(r, dict(row))) for r in responses))
        except Exception as exc:  # noqa: BLE001 - the user's code: report it typed, with its name
            raise TaskError(f"{self.who} failed: {type(exc).__name__}: {exc}") from exc
        try:
            if isinstance(values, (str, bytes, dict)):
                raise TypeError
            values = list(values)  # a list, tuple or array
        except TypeError:
            raise TaskError(f"{self.who} returned {type(values).__name__}, not a list of numbers") from None
        if len(values) != len(responses):
            raise TaskError(f"{self.who} returned {len(values)} values for {len(responses)} responses")
        return [clamp_reward(v, self.who) for v in values]
