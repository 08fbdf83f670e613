"""Load YAML into typed config; every failure becomes one ConfigError line naming file and field.

The file is read by rlix.safe_yaml (bounded: no alias bombs, no duplicate keys); every
message is one line of at most rlix.errors.MAX_MESSAGE characters, inputs shortened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from rlix.errors import ConfigError, format_validation_error
from rlix.config.models import RlixConfig
from rlix.config.preflight import anchor
from rlix.safe_yaml import load_yaml  # noqa: F401 - also read from here

M = TypeVar("M", bound=BaseModel)


def load_model(model: type[M], path: str | Path, error: type[ConfigError] = ConfigError) -> M:
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(format_validation_error(str(path), exc)) from None


def load_config(path: str | Path) -> RlixConfig:
    """The run config, its relative task, verifier and model paths read from its folder."""
    return anchor(load_model(RlixConfig, path), Path(path).expanduser().resolve().parent)
