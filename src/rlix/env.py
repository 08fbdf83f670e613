"""The one place rlix reads environment variables.

Everything else asks this module, so the full set of knobs is visible in one file.
"""

from __future__ import annotations

import os
from typing import Literal

ControlPlane = Literal["rlix", "standalone"]


def control_plane(default: ControlPlane = "standalone") -> ControlPlane:
    """`RLIX_CONTROL_PLANE=rlix` switches a pipeline into time-sharing mode."""
    value = os.environ.get("RLIX_CONTROL_PLANE", "").strip().lower()
    if value in ("rlix", "standalone"):
        return value  # type: ignore[return-value]
    return default


def ray_address() -> str | None:
    """Address of an existing Ray cluster to join (`RAY_ADDRESS`); None starts a local one."""
    return os.environ.get("RAY_ADDRESS") or None


def is_ci() -> bool:
    """True under CI (`CI=true`), where progress bars and colours are turned off."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
