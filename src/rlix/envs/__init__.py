"""Tasks (prompts + verifiable rewards) that pipelines train on."""

from rlix.envs.config import TaskConfig
from rlix.envs.tasks import ArithmeticTask, JsonlTask, PatternTask, Prompt, Task, make_task

__all__ = ["ArithmeticTask", "JsonlTask", "PatternTask", "Prompt", "Task", "TaskConfig", "make_task"]
