"""The engine's own record of what it sampled: one JSON line per finished token-level generate.

Off by default (`rlix serve --record-generations DIR`). It is the ground truth a training batch
can be checked against: the prompt and sampled token ids and their logprobs, as the engine had
them, written by the process that sampled them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class GenerationLog:
    """Appends to DIR/generations-<pid>.jsonl; each line is written whole, then flushed."""

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"generations-{os.getpid()}.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - open for the server's life

    def write(self, request_id: str, prompt_ids: list[int], token_ids: list[int], logprobs: list[float],
              finish_reason: str) -> None:
        self._file.write(json.dumps({"request_id": request_id, "prompt_token_ids": prompt_ids,
                                     "token_ids": token_ids, "logprobs": logprobs,
                                     "finish_reason": finish_reason}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_generations(directory: str | Path) -> list[dict]:
    """Every record under `directory` (all servers that wrote there)."""
    out: list[dict] = []
    for f in sorted(Path(directory).glob("generations-*.jsonl")):
        out.extend(json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip())
    return out
