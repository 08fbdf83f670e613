"""Load YAML into typed config; every failure becomes one ConfigError line naming file and field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from rlix.errors import ConfigError
from rlix.config.models import RlixConfig
from rlix.config.preflight import anchor

M = TypeVar("M", bound=BaseModel)


def format_validation_error(source: str, err: ValidationError) -> str:
    """`file: field.path: reason (got value)` for each problem, joined on one line."""
    parts = []
    for e in err.errors():
        loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in e["loc"]).replace(".[", "[")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling)"
        elif "input" in e and e["type"] != "missing" and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        parts.append(f"{loc or '<top>'}: {msg}")
    return f"{source}: " + "; ".join(parts)


def load_yaml(path: str | Path) -> object:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, not a config file")
    if not p.is_file():
        raise ConfigError(f"{p}: no such file")
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except PermissionError:
        raise ConfigError(f"{p}: not readable (permission denied)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}:{where} not valid YAML: {getattr(exc, 'problem', exc)}") from None


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
