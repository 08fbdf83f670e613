"""Verifiers: `fn(prompt, answer, response) -> float` in [0, 1], built in or the user's own.

The built-in ones give partial credit where they can (`numeric`), because GRPO learns only from
reward differences within a group.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
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


def load_verifier(spec: str) -> Verifier:
    """A built-in verifier by name, or the user's `module:function`."""
    if spec in VERIFIERS:
        return VERIFIERS[spec]
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"verifier {spec!r}: use one of {', '.join(VERIFIERS)} or 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"verifier {spec!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"verifier {spec!r} is not callable")
    return fn
