"""rlix.client: the hooks through which another framework's training loop runs as an rlix
pipeline (see pipeline_client.py and docs/CLIENT.md)."""

from rlix.client.pipeline_client import PipelineClient, connect
from rlix.client.types import PipelineInfo, StepDone, TrainingGrant
from rlix.errors import ClientError, ClientOrderError, PipelineEndedError

__all__ = ["ClientError", "ClientOrderError", "PipelineClient", "PipelineEndedError", "PipelineInfo", "StepDone",
           "TrainingGrant", "connect"]
