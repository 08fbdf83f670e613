"""Tasks (prompts + graded, verifiable rewards) that pipelines train on.

tasks.py (the Task protocol, pattern, arithmetic), jsonl.py (the user's data), verifiers.py,
config.py (TaskConfig, pydantic only), factory.py (make_task).
"""

from rlix.envs.config import TaskConfig
from rlix.envs.factory import make_task
from rlix.envs.jsonl import JsonlTask
from rlix.envs.tasks import ArithmeticTask, PatternTask, Prompt, Task
from rlix.envs.verifiers import VERIFIERS, load_verifier, numeric_credit

__all__ = ["VERIFIERS", "ArithmeticTask", "JsonlTask", "PatternTask", "Prompt", "Task", "TaskConfig",
           "load_verifier", "make_task", "numeric_credit"]
