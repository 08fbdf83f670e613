"""Built-in tasks and the JSONL task for users' own data.

A task draws prompts and scores responses in [0, 1]. Rewards are graded (partial credit), so
GRPO's within-group differences carry signal even while the policy is still bad.
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlix.envs.config import TaskConfig
from rlix.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: Any = None
    meta: dict = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    name: str

    def sample_prompt(self, rng: random.Random) -> Prompt: ...

    def reward(self, prompt: Prompt, response: str) -> float: ...


class PatternTask:
    """"Repeat: ab" -> the share of the first `length` characters that follow abab..."""

    name = "pattern"

    def __init__(self, patterns: list[str], length: int = 12) -> None:
        self.patterns, self.length = list(patterns), int(length)

    def sample_prompt(self, rng: random.Random) -> Prompt:
        pattern = rng.choice(self.patterns)
        return Prompt(f"Repeat: {pattern}\n", pattern)

    def reward(self, prompt: Prompt, response: str) -> float:
        target = (str(prompt.answer) * self.length)[: self.length]
        got = response[: self.length]
        return sum(1 for a, b in zip(got, target) if a == b) / self.length


def numeric_credit(answer: Any, response: str) -> float:
    """1 for the exact number first in the response; partial credit for a number of the right
    length, a little for any number; 0 for none."""
    text = response.strip()
    digits = ""
    for ch in text:
        if ch.isdigit() or (ch == "-" and not digits):
            digits += ch
        elif digits:
            break
    if not digits or digits == "-":
        return 0.0
    want = str(answer).strip()
    if digits == want:
        return 1.0
    return 0.5 if len(digits) == len(want) else 0.2


class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, max_operand: int = 9) -> None:
        self.max_operand = max_operand

    def sample_prompt(self, rng: random.Random) -> Prompt:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Prompt(f"{a}+{b}=", a + b)

    def reward(self, prompt: Prompt, response: str) -> float:
        return numeric_credit(prompt.answer, response)


Verifier = Callable[[str, Any, str], float]

VERIFIERS: dict[str, Verifier] = {
    "exact": lambda prompt, answer, response: float(response.strip() == str(answer).strip()),
    "contains": lambda prompt, answer, response: float(str(answer) in response),
    "numeric": lambda prompt, answer, response: numeric_credit(answer, response),
}


def load_verifier(spec: str) -> Verifier:
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"verifier {spec!r}: use one of {', '.join(VERIFIERS)} or 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"verifier {spec!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"verifier {spec!r} is not callable")
    return fn


class JsonlTask:
    """Prompts from a JSONL file (`{"prompt": str, "answer": any}` per line) and a verifier
    `fn(prompt, answer, response) -> float in [0, 1]`."""

    name = "jsonl"

    def __init__(self, path: str | Path, verifier: str = "exact") -> None:
        self.path = Path(path)
        self.verify = load_verifier(verifier)
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: no such file (task jsonl)")
        self.items: list[Prompt] = []
        for no, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{self.path}:{no}: not JSON: {exc.msg}") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "answer" not in row:
                raise ConfigError(f"{self.path}:{no}: each line needs a string \"prompt\" and an \"answer\"")
            self.items.append(Prompt(row["prompt"], row["answer"]))
        if not self.items:
            raise ConfigError(f"{self.path}: no prompts")

    def sample_prompt(self, rng: random.Random) -> Prompt:
        return rng.choice(self.items)

    def reward(self, prompt: Prompt, response: str) -> float:
        value = float(self.verify(prompt.text, prompt.answer, response))
        return min(max(value, 0.0), 1.0)


def make_task(cfg: TaskConfig | dict | str) -> Task:
    if isinstance(cfg, str):
        cfg = TaskConfig(name=cfg)  # type: ignore[arg-type]
    elif isinstance(cfg, dict):
        cfg = TaskConfig.model_validate(cfg)
    if cfg.name == "pattern":
        return PatternTask(cfg.patterns, cfg.length)
    if cfg.name == "arithmetic":
        return ArithmeticTask(cfg.max_operand)
    return JsonlTask(cfg.path or "", cfg.verifier)
