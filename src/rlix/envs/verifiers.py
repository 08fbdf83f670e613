"""Verifiers: `fn(prompt, answer, response) -> float` in [0, 1], built in or the user's own.

The built-in ones give partial credit where they can (`numeric`), because GRPO learns only from
reward differences within a group.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from rlix.errors import ConfigError

Verifier = Callable[[str, Any, str], float]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _digits(s: str) -> int:
    return sum(ch.isdigit() for ch in s)


def numeric_credit(answer: Any, response: str) -> float:
    """1 when the first number in the response equals the answer; 0.5 for a wrong number with
    as many digits; 0.2 for any other number; 0 when there is none."""
    m = _NUMBER.search(response)
    if m is None:
        return 0.0
    got, want = m.group(0), str(answer).strip()
    try:
        if float(got) == float(want):
            return 1.0
    except ValueError:  # a non-numeric answer: compare the text
        if got == want:
            return 1.0
    return 0.5 if _digits(got) == _digits(want) else 0.2


VERIFIERS: dict[str, Verifier] = {
    "exact": lambda prompt, answer, response: float(response.strip() == str(answer).strip()),
    "contains": lambda prompt, answer, response: float(str(answer) in response),
    "numeric": lambda prompt, answer, response: numeric_credit(answer, response),
}


def anchor_verifier(spec: str, base: Path) -> str:
    """The spec with a module of the user's resolved against `base` (the config's folder):
    `score:fn` with base/score.py (or `pkg.score:fn` with base/pkg/score.py) becomes
    `/abs/base/score.py:fn`, which imports the same from any process and working directory.
    Built-in names and modules found nowhere under `base` are left as they are."""
    if spec in VERIFIERS:
        return spec
    return anchor_function(spec, base)


def anchor_function(spec: str, base: Path) -> str:
    """A user's `module:function` resolved against `base` as `anchor_verifier` does."""
    module, _, attr = spec.partition(":")
    if module.endswith(".py"):
        path = Path(module).expanduser()
        return f"{path if path.is_absolute() else (base / path).resolve()}:{attr}"
    rel = Path(*module.split("."))
    for candidate in (base / rel.with_suffix(".py"), base / rel / "__init__.py"):
        if candidate.is_file():
            return f"{candidate.resolve()}:{attr}"
    return spec


def load_verifier(spec: str) -> Verifier:
    """A built-in verifier by name, or the user's `module:function` / `path/to/file.py:function`."""
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"verifier {spec!r}: use one of {', '.join(VERIFIERS)} or 'module:function'")
    return load_function(spec, "verifier")


def load_function(spec: str, what: str) -> Callable[..., Any]:
    """The user's `module:function` or `path/to/file.py:function`; ConfigError naming `what`
    (the setting) and the spec when it cannot be imported or is not callable."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"{what} {spec!r}: use 'module:function' or 'file.py:function'")
    try:
        mod = _import(module)
    except ImportError as exc:
        raise ConfigError(f"{what} {spec!r} cannot be imported: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while it was imported
        raise ConfigError(f"{what} {spec!r}: importing it raised {type(exc).__name__}: {exc}") from None
    fn = getattr(mod, attr, None)
    if fn is None:
        raise ConfigError(f"{what} {spec!r}: {module} has no {attr!r}")
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r} is not callable")
    return fn


def _import(module: str) -> ModuleType:
    if not module.endswith(".py"):
        return importlib.import_module(module)
    path = Path(module)
    if not path.is_file():
        raise ImportError(f"no such file {path}")
    name = f"rlix_verifier_{abs(hash(str(path)))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
