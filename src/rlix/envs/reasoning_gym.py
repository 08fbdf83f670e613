"""The `reasoning_gym` task: prompts from one of reasoning-gym's procedural generators (an
optional package: pip install reasoning-gym), scored by that generator's own scorer
(`score_answer(answer, entry)`), rendered like a dataset's prompts (chat template, system prompt).

Entries are generated from (data_seed, index) on demand, so `size` costs no memory. The scorer
gets the response stripped, or with `answer_tag` the text of its last <tag>...</tag> (the
convention reasoning-gym's own prompts ask for); a response without one scores 0.
"""

from __future__ import annotations

import random
import re
from typing import Any

from rlix.envs.dataset import chat_prompt
from rlix.envs.errors import TaskFieldError, one_line
from rlix.envs.rewards import clamp_reward
from rlix.envs.tasks import Prompt, Rows
from rlix.errors import TaskError


class ReasoningGymTask(Rows):
    """See the module doc."""

    name = "reasoning_gym"

    def __init__(self, dataset: str, *, size: int = 1000, seed: int = 0, options: dict[str, Any] | None = None,
                 system_prompt: str | None = None, chat_template: bool = True,
                 answer_tag: str | None = None) -> None:
        try:
            import reasoning_gym  # deferred: optional, and slow to import
        except ImportError:
            raise TaskFieldError("dataset", "task reasoning_gym needs the reasoning-gym package "
                                            "(pip install reasoning-gym)") from None
        try:
            self.data = reasoning_gym.create_dataset(dataset, seed=seed, size=size, **(options or {}))
        except Exception as exc:  # noqa: BLE001 - unknown name, or options its config refuses
            field = "options" if options and "not registered" not in str(exc) else "dataset"
            raise TaskFieldError(field, f"reasoning_gym {dataset!r}: {one_line(exc)}") from None
        self.dataset, self.size = dataset, size
        self.system_prompt, self.chat_template = system_prompt, chat_template
        self.tag = re.compile(rf"<{answer_tag}>(.*?)</{answer_tag}>", re.S) if answer_tag else None

    def __len__(self) -> int:
        return self.size

    def prompt(self, index: int) -> Prompt:
        entry = dict(self.data[index])
        return chat_prompt(str(entry["question"]), entry, system_prompt=self.system_prompt,
                           chat_template=self.chat_template, answer=entry.get("answer"))

    def sample_prompt(self, rng: random.Random) -> Prompt:
        return self.prompt(rng.randrange(self.size))

    def answer_of(self, response: str) -> str | None:
        if self.tag is None:
            return response.strip()
        found = self.tag.findall(response)
        return found[-1].strip() if found else None

    def score(self, prompt: Prompt, response: str) -> float:
        who = f"reasoning_gym {self.dataset!r} scorer"
        answer = self.answer_of(response)
        if answer is None:
            return 0.0
        try:
            value = self.data.score_answer(answer, dict(prompt.meta))
        except Exception as exc:  # noqa: BLE001 - the generator's code
            raise TaskError(f"{who} failed: {type(exc).__name__}: {exc}") from exc
        return clamp_reward(value, who)

    async def rewards(self, prompt: Prompt, responses: list[str]) -> list[float]:
        return [self.score(prompt, r) for r in responses]
