"""The `dataset` task: the user's rows from a local JSONL or parquet file (read with the
`datasets` library), each prompt rendered with the model's chat template (the collector renders
`Prompt.messages`), scored by the user's reward function, which sees the whole row
(rewards.py). Also `chat_prompt`, shared with the reasoning_gym task.

Every row's prompt (or messages) is checked when the task is made, so `rlix check` refuses a
bad file before anything starts, naming the file, the row and the setting.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlix.envs.errors import TaskFieldError, one_line
from rlix.envs.rewards import RowReward
from rlix.envs.tasks import Prompt, Rows

#: file name endings -> the `datasets` builder that reads them
FORMATS = {".jsonl": "json", ".json": "json", ".jsonl.gz": "json", ".json.gz": "json", ".parquet": "parquet"}


def chat_prompt(content: str, meta: dict[str, Any], *, system_prompt: str | None, chat_template: bool,
                answer: Any = None) -> Prompt:
    """One user turn (after the system prompt, if any) as chat messages, or as plain text
    (the system prompt on a line before it) with `chat_template` off."""
    if not chat_template:
        return Prompt(f"{system_prompt}\n{content}" if system_prompt else content, answer, meta)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return Prompt(content, answer, meta, messages + [{"role": "user", "content": content}])


def format_of(path: Path) -> str:
    name = path.name.lower()
    for suffix, kind in FORMATS.items():
        if name.endswith(suffix):
            return kind
    raise TaskFieldError("path", f"{path}: not a dataset file (use {', '.join(FORMATS)})")


@contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """No progress bars or info lines from `datasets` (rlix check answers in one line)."""
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets.utils.enable_progress_bars()


def load_rows(path: Path) -> Any:
    """The file as a `datasets.Dataset` (its one split); TaskFieldError("path") when it cannot be read.
    `datasets` caches the parsed file (HF_DATASETS_CACHE): a second load maps the cache."""
    kind = format_of(path)
    if not path.is_file():
        raise TaskFieldError("path", f"{path}: no such file (task dataset)")
    try:
        import datasets  # deferred: a second to import, and only this task needs it
    except ImportError:
        raise TaskFieldError("path", "task dataset needs the datasets package (pip install datasets)") from None
    try:
        with _quiet(datasets):
            rows = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - pyarrow's and datasets' errors, of many kinds
        raise TaskFieldError("path", f"{path}: cannot be read as {kind}: {one_line(exc)}") from None
    if len(rows) == 0:
        raise TaskFieldError("path", f"{path}: no rows")
    return rows


def _messages(value: Any) -> list[dict[str, Any]] | None:
    """Chat messages as the template takes them (keys `datasets` filled with None dropped:
    a template tests `message.tool_calls is defined`), or None when `value` is not messages."""
    if not isinstance(value, list) or not value:
        return None
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"] \
                or not isinstance(m.get("content"), str):
            return None
        out.append({k: v for k, v in m.items() if v is not None})
    return out


class DatasetTask(Rows):
    """Rows drawn uniformly from a JSONL or parquet file; see the module doc."""

    name = "dataset"

    def __init__(self, path: str | Path, *, reward: str | None = None, reward_batch: str | None = None,
                 prompt_column: str = "prompt", messages_column: str | None = None,
                 system_prompt: str | None = None, chat_template: bool = True) -> None:
        self.path = Path(path)
        self.system_prompt, self.chat_template = system_prompt, chat_template
        self.column = messages_column or prompt_column
        self.field = "messages_column" if messages_column else "prompt_column"
        self.score = RowReward.load(reward, reward_batch)
        self.rows = load_rows(self.path)
        if self.column not in self.rows.column_names:
            raise TaskFieldError(self.field, f"{self.path} has no column {self.column!r} "
                                             f"(its columns: {', '.join(self.rows.column_names[:20])})")
        for i, value in enumerate(self.rows[self.column]):
            self._check(i, value)

    def _check(self, i: int, value: Any) -> None:
        where = f"{self.path}: row {i + 1}: {self.column!r}"
        if self.field == "prompt_column" and (not isinstance(value, str) or not value):
            raise TaskFieldError(self.field, f"{where} must be a non-empty string, got "
                                             f"{'an empty string' if value == '' else type(value).__name__}")
        if self.field == "messages_column" and _messages(value) is None:
            raise TaskFieldError(self.field, f"{where} must be a non-empty list of "
                                             f"{{\"role\": str, \"content\": str}} messages")

    def __len__(self) -> int:
        return len(self.rows)

    def prompt(self, index: int) -> Prompt:
        """Row `index` as the model sees it; the row itself goes along as `meta`."""
        row = dict(self.rows[index])
        value = row[self.column]
        if self.field == "prompt_column":
            return chat_prompt(value, row, system_prompt=self.system_prompt, chat_template=self.chat_template)
        messages = _messages(value) or []
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Prompt(messages[-1]["content"], None, row, messages)

    def sample_prompt(self, rng: random.Random) -> Prompt:
        return self.prompt(rng.randrange(len(self.rows)))

    async def rewards(self, prompt: Prompt, responses: list[str]) -> list[float]:
        return await self.score(responses, prompt.meta)
