"""Tasks (prompts + graded, verifiable rewards) that pipelines train on."""

from rlix.envs.config import TaskConfig
from rlix.envs.jsonl import VERIFIERS, JsonlTask, load_verifier, numeric_credit
from rlix.envs.tasks import ArithmeticTask, PatternTask, Prompt, Task, make_task

__all__ = ["VERIFIERS", "ArithmeticTask", "JsonlTask", "PatternTask", "Prompt", "Task", "TaskConfig",
           "load_verifier", "make_task", "numeric_credit"]
