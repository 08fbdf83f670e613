"""Task settings as they appear under a pipeline's `task:` (pure pydantic, no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TaskConfig(BaseModel):
    """`pattern`: repeat a character pattern (a tiny random model learns it in minutes);
    `arithmetic`: "a+b=" with a numeric answer; `jsonl`: your prompts and answers + a verifier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["pattern", "arithmetic", "jsonl"] = "pattern"
    patterns: list[str] = Field(default_factory=lambda: ["a"], min_length=1,
                                description="pattern: the strings to repeat; one is drawn per prompt")
    length: int = Field(12, ge=1, description="pattern: characters of the response that are scored")
    max_operand: int = Field(9, ge=1, description="arithmetic: operands are drawn from 0..max_operand")
    path: str | None = Field(None, description="jsonl: file of {\"prompt\": ..., \"answer\": ...} lines")
    verifier: str = Field("exact", description="jsonl: exact, contains, numeric, or module:function")

    @model_validator(mode="after")
    def _check(self) -> "TaskConfig":
        if self.name == "jsonl" and not self.path:
            raise ValueError("task jsonl needs a path")
        if any(not p for p in self.patterns):
            raise ValueError("patterns must be non-empty strings")
        builtin = ("exact", "contains", "numeric")
        if self.verifier not in builtin and not all(self.verifier.partition(":")[::2]):
            raise ValueError(f"verifier {self.verifier!r}: use one of {', '.join(builtin)} or 'module:function'")
        return self
