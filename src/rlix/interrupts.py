"""Ctrl-C noted, and raised where the driver polls, not wherever Python happens to be.

Python raises KeyboardInterrupt at the next bytecode of the main thread, which may be inside a
finaliser (an object's `__del__`, a weakref callback), where the exception is printed as
"ignored" and lost: a run driven by a polling loop that makes garbage every turn then carries
on as if nothing happened (seen once in CI: the SIGINT sent after a few steps, the run went on
to its last step and exited 0). `InterruptFlag` replaces the handler for its block: the first
SIGINT only sets a flag, which the loop's `check()` turns into KeyboardInterrupt at a point of
its choosing; a second SIGINT raises at once (a user pressing Ctrl-C twice wants out).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any


class InterruptFlag:
    def __init__(self) -> None:
        self.count = 0
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> InterruptFlag:
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            self._previous = signal.signal(signal.SIGINT, self._note)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count > 1:
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C came (the caller's loop calls this every turn)."""
        if self.count:
            raise KeyboardInterrupt
