"""Task settings as they appear under a pipeline's `task:` (pure pydantic, no torch)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: bounds of the `dataset` / `reasoning_gym` settings (a config is user input like any request)
MAX_COLUMN = 256
MAX_SYSTEM_PROMPT = 65536
MAX_ROWS = 2**31 - 1
MAX_OPTIONS = 64

Column = Annotated[str, Field(min_length=1, max_length=MAX_COLUMN)]
Target = Annotated[str, Field(min_length=3, max_length=4096)]


def _is_target(spec: str | None) -> bool:
    return spec is None or all(spec.partition(":")[::2])


class TaskConfig(BaseModel):
    """`pattern`: repeat a character pattern (a tiny random model learns it in minutes);
    `arithmetic`: "a+b=" with a numeric answer; `jsonl`: your prompts and answers + a verifier;
    `dataset`: your JSONL or parquet rows (read with `datasets`), rendered with the model's chat
    template, scored by your `reward(response, row)`; `reasoning_gym`: one of reasoning-gym's
    procedural generators, scored by its own scorer (docs/ENVIRONMENTS.md, "Datasets")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["pattern", "arithmetic", "jsonl", "dataset", "reasoning_gym"] = "pattern"
    patterns: list[str] = Field(default_factory=lambda: ["a"], min_length=1,
                                description="pattern: the strings to repeat; one is drawn per prompt")
    length: int = Field(12, ge=1, description="pattern: characters of the response that are scored")
    max_operand: int = Field(9, ge=1, description="arithmetic: operands are drawn from 0..max_operand")
    path: str | None = Field(None, description="jsonl: file of {\"prompt\": ..., \"answer\": ...} lines; "
                                               "dataset: a .jsonl, .json or .parquet file of rows")
    verifier: str = Field("exact", description="jsonl: exact, contains, numeric, or module:function")
    prompt_column: Column = Field("prompt", description="dataset: the column holding each row's prompt (a string)")
    messages_column: Column | None = Field(
        None, description="dataset: the column holding each row's chat messages ([{role, content}, ...]), "
                          "used instead of prompt_column")
    system_prompt: str | None = Field(None, max_length=MAX_SYSTEM_PROMPT,
                                      description="dataset, reasoning_gym: a system message before each prompt "
                                                  "(with chat_template: false, a line of text before it)")
    chat_template: bool = Field(True, description="dataset, reasoning_gym: render prompts with the model's chat "
                                                  "template (add_generation_prompt), as the model is served; "
                                                  "false: the prompt's plain text")
    reward: Target | None = Field(None, description="dataset: module:function, `reward(response: str, row: dict) "
                                                    "-> float`, sync or async; clamped into [0, 1]")
    reward_batch: Target | None = Field(
        None, description="dataset: module:function, `reward_batch(responses: list[str], rows: list[dict]) -> "
                          "list[float]`, sync or async, called once per group (instead of reward)")
    dataset: Annotated[str, Field(min_length=1, max_length=MAX_COLUMN)] | None = Field(
        None, description="reasoning_gym: the generator's name, as reasoning_gym.create_dataset takes it "
                          "(basic_arithmetic, leg_counting, ...)")
    size: int = Field(1000, ge=1, le=MAX_ROWS, description="reasoning_gym: rows generated (drawn uniformly)")
    data_seed: int = Field(0, ge=0, le=MAX_ROWS, description="reasoning_gym: the generator's seed")
    options: dict[str, Any] = Field(default_factory=dict, max_length=MAX_OPTIONS,
                                    description="reasoning_gym: the generator's own settings (its config's fields)")
    answer_tag: Annotated[str, Field(min_length=1, max_length=MAX_COLUMN, pattern=r"^[A-Za-z0-9_-]+$")] | None = (
        Field(None, description="reasoning_gym: score only the text of the response's last <TAG>...</TAG> "
                                "(none: nothing scores 0); null: the whole response, stripped"))

    @model_validator(mode="after")
    def _check(self) -> "TaskConfig":
        if self.name in ("jsonl", "dataset") and not self.path:
            raise ValueError(f"task {self.name} needs a path")
        if any(not p for p in self.patterns):
            raise ValueError("patterns must be non-empty strings")
        builtin = ("exact", "contains", "numeric")
        if self.verifier not in builtin and not all(self.verifier.partition(":")[::2]):
            raise ValueError(f"verifier {self.verifier!r}: use one of {', '.join(builtin)} or 'module:function'")
        for field, spec in (("reward", self.reward), ("reward_batch", self.reward_batch)):
            if not _is_target(spec):
                raise ValueError(f"{field} {spec!r}: use 'module:function' or 'file.py:function'")
        if self.name == "dataset":
            if (self.reward is None) == (self.reward_batch is None):
                raise ValueError("task dataset needs one of reward or reward_batch (module:function)")
            if self.messages_column is not None and not self.chat_template:
                raise ValueError("messages_column needs chat_template: true (chat messages are rendered "
                                 "by the model's chat template)")
        elif self.reward is not None or self.reward_batch is not None:
            raise ValueError(f"reward and reward_batch are for task dataset (task {self.name} "
                             f"{'uses verifier' if self.name == 'jsonl' else 'scores by itself'})")
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError("task reasoning_gym needs a dataset (the generator's name, e.g. basic_arithmetic)")
        return self
