"""A run's console and log file: every line stamped with the run's clock, and on a terminal one
progress bar per pipeline (step of steps, last reward, time left) kept under the lines.

Off a terminal (CI, `| tee`, a job driver's log) only the lines are printed, as before.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from rlix.private_files import open_private


class RunLog:
    """Prints to the console and appends to run.log; `step()` moves a pipeline's bar."""

    def __init__(self, path: Path, out: TextIO = sys.stdout, *, force_terminal: bool | None = None) -> None:
        self.fh = open_private(path, "a")  # 0600: lines name servers' addresses (metrics, dashboard, Ray)
        self.out = out
        self.t0 = time.time()
        console = Console(file=out, force_terminal=force_terminal)
        self.bars: Progress | None = None
        if console.is_terminal:
            self.bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 TimeRemainingColumn(), console=console)
        self._tasks: dict[str, TaskID] = {}

    def __call__(self, line: str) -> None:
        stamped = f"[{time.time() - self.t0:7.1f}s] {line}"
        if self.bars is not None:
            self.bars.console.print(stamped, markup=False, highlight=False, soft_wrap=True)
        else:
            print(stamped, file=self.out, flush=True)
        self.fh.write(stamped + "\n")
        self.fh.flush()

    def step(self, pipeline: str, step: int, steps: int, reward: float | None) -> None:
        """A pipeline finished `step` of `steps` (a no-op off a terminal: the lines say it); a
        reward of None keeps the last one shown."""
        if self.bars is None:
            return
        if not self._tasks:
            self.bars.start()
        if pipeline not in self._tasks:
            self._tasks[pipeline] = self.bars.add_task(pipeline, total=steps, info="")
        fields = {} if reward is None else {"info": f"reward {reward:.3f}"}  # None keeps the last
        self.bars.update(self._tasks[pipeline], completed=step, total=steps, **fields)

    def close(self) -> None:
        if self.bars is not None and self._tasks:
            self.bars.stop()
        self.fh.close()
