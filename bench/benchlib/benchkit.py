"""Progress for the benches, on stderr: stdout is kept for the one JSON line every bench ends with.

    with Bench("faults", total=3) as bench:   # total=None: a spinner and the current phase
        bench.phase("round 1 shard")           # what runs now
        bench.log("round 1 shard: {...}")      # a figures line, printed above the bar
        bench.advance()                        # one of `total` done

On a terminal: a live bar (done/total, elapsed, time left). Off a terminal (CI, `2> log`,
`2>&1 | tee`): the same facts as plain lines, one per phase change and one at the end, so that a
log stays readable. Benches that run `rlix run` in-process wrap it in `bench.aside()`: the run
draws its own bars on stderr, and two live displays on one terminal overwrite each other.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Column
from rich.text import Text

_active: list[Bench] = []


def clock(seconds: float) -> str:
    """h:mm:ss, as rich's own columns print it."""
    return str(timedelta(seconds=int(max(0.0, seconds))))


def time_left(done: int, total: int, done_at: float, now: float) -> float:
    """Seconds to go at the mean pace of the rounds done so far (`done` of them by `done_at`
    seconds): the projected end minus now, counting down within a round, but never less than
    the rounds still untouched. Rich's own estimate looks at the last 30 s only, and a bench's
    rounds can take minutes."""
    pace = done_at / done
    return max(pace * (total - done - 1), pace * (total - done) - (now - done_at))


class _PhaseColumn(ProgressColumn):
    """The current phase; on a narrow terminal the column that gives way, cut short with '…'
    rather than wrapped onto a second line."""

    def render(self, task: Task) -> Text:
        return Text(task.description, no_wrap=True, overflow="ellipsis")


class _LeftColumn(ProgressColumn):
    """'~h:mm:ss left' from `time_left`; blank until a round is done."""

    def render(self, task: Task) -> Text:
        done_at = task.fields.get("done_at")
        if not task.total or not task.completed or task.finished or done_at is None:
            return Text("")
        left = time_left(int(task.completed), int(task.total), done_at, task.elapsed or 0.0)
        return Text(f"~{clock(left)} left", style="progress.remaining")


class Bench:
    """One bench's progress: phases, optionally counted against a known total."""

    def __init__(self, name: str, total: int | None = None, *, console: Console | None = None) -> None:
        self.name, self.total = name, total or None  # 0 rounds: nothing to count
        self.console = console or Console(stderr=True)
        self.done = 0
        self.done_at: float | None = None  # seconds since start at the last advance
        self.current = ""
        self.t0 = time.monotonic()
        self._bars: Progress | None = None
        self._task: TaskID | None = None
        if self.console.is_terminal:
            fixed = lambda: Column(no_wrap=True)  # noqa: E731
            counted = [BarColumn(bar_width=20), MofNCompleteColumn(table_column=fixed())] if self.total else []
            # refreshed 4 times a second, not rich's 10: the benches time things on few cores
            self._bars = Progress(SpinnerColumn(), TextColumn("{task.fields[name]}", markup=False,
                                                              table_column=fixed()),
                                  *counted, _PhaseColumn(), TimeElapsedColumn(table_column=fixed()),
                                  *([_LeftColumn(table_column=fixed())] if self.total else []),
                                  console=self.console, refresh_per_second=4, redirect_stdout=False)

    # -- context -------------------------------------------------------------------------------
    def __enter__(self) -> Bench:
        self.t0 = time.monotonic()
        if self._bars is not None:
            self._task = self._bars.add_task("", total=self.total, name=self.name)
            self._bars.start()
        _active.append(self)
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        _active.remove(self)
        if self._bars is not None:
            if kind is None:
                self._bars.update(self._task, description="done")  # type: ignore[arg-type]
            self._bars.stop()
        elif kind is None:
            self._line("done")

    # -- progress ------------------------------------------------------------------------------
    def phase(self, text: str) -> None:
        """What the bench does now; off a terminal a line, if it changed."""
        if text == self.current:
            return
        self.current = text
        if self._bars is not None:
            self._bars.update(self._task, description=text)  # type: ignore[arg-type]
        else:
            self._line(text)

    def advance(self, n: int = 1) -> None:
        """`n` more rounds of the total done (the next phase line shows the count)."""
        self.done += n
        self.done_at = time.monotonic() - self.t0
        if self._bars is not None:
            self._bars.update(self._task, advance=n, done_at=self.done_at)  # type: ignore[arg-type]

    def log(self, line: str) -> None:
        """A line of figures, above the bar on a terminal."""
        if self._bars is not None and self._bars.live.is_started:
            self._bars.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, file=self.console.file, flush=True)

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """The bar off the screen while something else draws its own (an in-process `rlix
        run`); its last state stays above as a header."""
        if self._bars is None:
            yield
            return
        self._bars.stop()
        try:
            yield
        finally:
            self._bars.start()

    def _line(self, text: str) -> None:
        now = time.monotonic() - self.t0
        count = f" {self.done}/{self.total}" if self.total else ":"
        times = f"{clock(now)} elapsed"
        if self.total and 0 < self.done < self.total and self.done_at is not None and text != "done":
            times += f", ~{clock(time_left(self.done, self.total, self.done_at, now))} left"
        print(f"{self.name}{count} {text} [{times}]", file=self.console.file, flush=True)


def log(line: str) -> None:
    """A figures line through the innermost running Bench, plainly to stderr without one (for
    helpers that do not hold the Bench object)."""
    if _active:
        _active[-1].log(line)
    else:
        print(line, file=sys.stderr, flush=True)
