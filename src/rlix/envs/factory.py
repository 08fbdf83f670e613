"""`make_task`: a task from its settings, the one place that maps a task's name to its class."""

from __future__ import annotations

from pydantic import ValidationError

from rlix.envs.config import TaskConfig
from rlix.envs.jsonl import JsonlTask
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
    return JsonlTask(cfg.path or "", cfg.verifier)
