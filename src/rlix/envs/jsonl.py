"""Users' own data: prompts and answers from a JSONL file, scored by a named verifier
(verifiers.py); the verifier's value is clamped into [0, 1]."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from rlix.envs.tasks import EachResponse, Prompt, Rows
from rlix.envs.verifiers import load_verifier
from rlix.errors import ConfigError, TaskError


def read_prompts(path: Path) -> list[Prompt]:
    """Every `{"prompt": str, "answer": any}` line (blank lines skipped); a bad line raises
    ConfigError naming the file and the line."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file (task jsonl)")
    try:
        # lines end at "\n" only: str.splitlines also breaks at U+2028, U+0085 and the like,
        # which JSON strings may hold unescaped (ensure_ascii=False writers, multilingual text)
        lines = [line.rstrip("\r") for line in path.read_text(encoding="utf-8").split("\n")]
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


class JsonlTask(EachResponse, Rows):
    """Prompts drawn uniformly from a JSONL file, scored by `verifier`."""

    name = "jsonl"

    def __init__(self, path: str | Path, verifier: str = "exact") -> None:
        self.path = Path(path)
        self.verifier = verifier
        self.verify = load_verifier(verifier)
        self.items = read_prompts(self.path)

    def __len__(self) -> int:
        return len(self.items)

    def prompt(self, index: int) -> Prompt:
        return self.items[index]

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
