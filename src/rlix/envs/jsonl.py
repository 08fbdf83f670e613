"""Users' own data: prompts and answers from a JSONL file, scored by a named verifier.

A verifier is `fn(prompt, answer, response) -> float`; its value is clamped into [0, 1]. The
built-in ones give partial credit where they can (`numeric`), because GRPO learns only from
reward differences within a group.
"""

from __future__ import annotations

import importlib
import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlix.envs.tasks import Prompt
from rlix.errors import ConfigError, TaskError

Verifier = Callable[[str, Any, str], float]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _digits(s: str) -> int:
    return sum(ch.isdigit() for ch in s)


def numeric_credit(answer: Any, response: str) -> float:
    """1 when the first number in the response equals the answer; 0.5 for a wrong number with
    as many digits; 0.2 for any other number; 0 when there is none."""
    m = _NUMBER.search(response)
    if m is None:
        return 0.0
    got, want = m.group(0), str(answer).strip()
    try:
        if float(got) == float(want):
            return 1.0
    except ValueError:  # a non-numeric answer: compare the text
        if got == want:
            return 1.0
    return 0.5 if _digits(got) == _digits(want) else 0.2


VERIFIERS: dict[str, Verifier] = {
    "exact": lambda prompt, answer, response: float(response.strip() == str(answer).strip()),
    "contains": lambda prompt, answer, response: float(str(answer) in response),
    "numeric": lambda prompt, answer, response: numeric_credit(answer, response),
}


def load_verifier(spec: str) -> Verifier:
    """A built-in verifier by name, or the user's `module:function`."""
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


def read_prompts(path: Path) -> list[Prompt]:
    """Every `{"prompt": str, "answer": any}` line (blank lines skipped); a bad line raises
    ConfigError naming the file and the line."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (task jsonl)")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    items: list[Prompt] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{no}: not JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "answer" not in row:
            raise ConfigError(f"{path}:{no}: each line needs a string \"prompt\" and an \"answer\"")
        if not row["prompt"]:
            raise ConfigError(f"{path}:{no}: empty \"prompt\"")
        meta = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
        items.append(Prompt(row["prompt"], row["answer"], meta))
    if not items:
        raise ConfigError(f"{path}: no prompts")
    return items


class JsonlTask:
    """Prompts drawn uniformly from a JSONL file, scored by `verifier`."""

    name = "jsonl"

    def __init__(self, path: str | Path, verifier: str = "exact") -> None:
        self.path = Path(path)
        self.verifier = verifier
        self.verify = load_verifier(verifier)
        self.items = read_prompts(self.path)

    def sample_prompt(self, rng: random.Random) -> Prompt:
        return rng.choice(self.items)

    def reward(self, prompt: Prompt, response: str) -> float:
        try:
            value = float(self.verify(prompt.text, prompt.answer, response))
        except Exception as exc:  # noqa: BLE001 - the user's code: report it typed, with its name
            raise TaskError(f"verifier {self.verifier!r} failed: {type(exc).__name__}: {exc}") from exc
        if math.isnan(value):
            raise TaskError(f"verifier {self.verifier!r} returned NaN")
        return min(max(value, 0.0), 1.0)
