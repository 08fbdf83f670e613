"""A task setting that cannot work, with the `task:` field it concerns (for `rlix check`'s line)."""

from __future__ import annotations

from rlix.errors import ConfigError


class TaskFieldError(ConfigError):
    """A ConfigError about one field of a pipeline's `task:` section (`field`: its name there)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def one_line(exc: BaseException, limit: int = 200) -> str:
    """`Type: message` of an exception from a library or the user's code, on one short line."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
