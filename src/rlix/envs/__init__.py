"""Tasks (prompts + graded, verifiable rewards) that pipelines train on.

tasks.py (the Task protocol, pattern, arithmetic), jsonl.py (the user's data), dataset.py (rows
read with `datasets`, chat-templated, a reward function that sees the row: rewards.py),
reasoning_gym.py (procedural generators), verifiers.py, config.py (TaskConfig, pydantic only),
factory.py (make_task).
"""

from rlix.envs.config import TaskConfig
from rlix.envs.dataset import DatasetTask
from rlix.envs.errors import TaskFieldError
from rlix.envs.factory import make_task
from rlix.envs.jsonl import JsonlTask
from rlix.envs.reasoning_gym import ReasoningGymTask
from rlix.envs.rewards import RowReward, clamp_reward
from rlix.envs.tasks import ArithmeticTask, EachResponse, PatternTask, Prompt, Task
from rlix.envs.verifiers import VERIFIERS, load_verifier, numeric_credit

__all__ = ["VERIFIERS", "ArithmeticTask", "DatasetTask", "EachResponse", "JsonlTask", "PatternTask", "Prompt",
           "ReasoningGymTask", "RowReward", "Task", "TaskConfig", "TaskFieldError", "clamp_reward",
           "load_verifier", "make_task", "numeric_credit"]
