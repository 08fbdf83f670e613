"""Load YAML into typed config; every failure becomes one ConfigError line naming file and field.

The file is read by rlix.safe_yaml (bounded: no alias bombs, no duplicate keys); every
message is one line of at most rlix.errors.MAX_MESSAGE characters, inputs shortened.
`--set` overrides (config/overrides.py) are applied to the file's data before validation.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from rlix.errors import ConfigError, format_validation_error
from rlix.config.models import RlixConfig
from rlix.config.overrides import apply_overrides
from rlix.config.preflight import anchor
from rlix.safe_yaml import load_yaml  # noqa: F401 - also read from here

M = TypeVar("M", bound=BaseModel)

#: what a config given as data (not a file) is called in error lines
DATA_SOURCE = "<config>"


def _validate(model: type[M], data: object, source: str, error: type[ConfigError],
              overrides: Sequence[str] = ()) -> M:
    if not isinstance(data, dict):
        raise error(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    if overrides:
        data = apply_overrides(data, overrides, model)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(format_validation_error(source, exc)) from None


def load_model(model: type[M], path: str | Path, error: type[ConfigError] = ConfigError) -> M:
    return _validate(model, load_yaml(path), str(path), error)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RlixConfig:
    """The run config, `overrides` (`path.to.field=value`) applied, its relative task, verifier
    and model paths read from its folder."""
    cfg = _validate(RlixConfig, load_yaml(path), str(path), ConfigError, overrides)
    return anchor(cfg, Path(path).expanduser().resolve().parent)


def resolve_config(config: str | Path | Mapping | RlixConfig,
                   overrides: Sequence[str] = ()) -> tuple[RlixConfig, str]:
    """A run config given as a file, as its data (relative paths read from the working
    directory) or already typed; with `overrides` applied. Returns it and the name errors give it."""
    if isinstance(config, RlixConfig):
        if not overrides:
            return config, DATA_SOURCE
        config = config.model_dump(mode="json", exclude_unset=True)
    if isinstance(config, Mapping):
        data = copy.deepcopy(dict(config))
        cfg = _validate(RlixConfig, data, DATA_SOURCE, ConfigError, overrides)
        return anchor(cfg, Path.cwd()), DATA_SOURCE
    return load_config(config, overrides), str(config)
