"""rlix: time-share one GPU cluster across many LLM reinforcement-learning pipelines.

The Python API: `rlix.run(config)` runs a config (a YAML file's path, its data as a dict, or an
`rlix.RlixConfig`) to the end and returns its summary; `rlix.load_config(path)` reads a file
into an `RlixConfig`. Both are imported on first use: `import rlix` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlix.version import VERSION as __version__
__all__ = ["RlixConfig", "load_config", "run"]

if TYPE_CHECKING:
    from rlix.config import RlixConfig, load_config
    from rlix.run import run

#: the lazily imported names and the module each comes from
_LAZY = {"RlixConfig": "rlix.config", "load_config": "rlix.config"}


def __getattr__(name: str) -> Any:
    if name == "run":  # the module itself, which is callable (rlix/run.py): Ray and more, on first use
        return importlib.import_module("rlix.run")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rlix' has no attribute {name!r}")
