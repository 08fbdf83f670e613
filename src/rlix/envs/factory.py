"""`make_task`: a task from its settings, the one place that maps a task's name to its class."""

from __future__ import annotations

from pydantic import ValidationError

from rlix.envs.config import TaskConfig
from rlix.envs.dataset import DatasetTask
from rlix.envs.jsonl import JsonlTask
from rlix.envs.reasoning_gym import ReasoningGymTask
from rlix.envs.tasks import ArithmeticTask, PatternTask, Task
from rlix.errors import ConfigError


def make_task(cfg: TaskConfig | dict | str) -> Task:
    """A task from its settings: a name ("pattern"), a dict (as in YAML) or a TaskConfig."""
    if not isinstance(cfg, TaskConfig):
        try:
            cfg = TaskConfig.model_validate({"name": cfg} if isinstance(cfg, str) else cfg)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "task"
            raise ConfigError(f"task: {where}: {first['msg']}") from None
    if cfg.name == "pattern":
        return PatternTask(cfg.patterns, cfg.length)
    if cfg.name == "arithmetic":
        return ArithmeticTask(cfg.max_operand)
    if cfg.name == "dataset":
        return DatasetTask(cfg.path or "", reward=cfg.reward, reward_batch=cfg.reward_batch,
                           prompt_column=cfg.prompt_column, messages_column=cfg.messages_column,
                           system_prompt=cfg.system_prompt, chat_template=cfg.chat_template)
    if cfg.name == "reasoning_gym":
        return ReasoningGymTask(cfg.dataset or "", size=cfg.size, seed=cfg.data_seed, options=cfg.options,
                                system_prompt=cfg.system_prompt, chat_template=cfg.chat_template,
                                answer_tag=cfg.answer_tag)
    return JsonlTask(cfg.path or "", cfg.verifier)
