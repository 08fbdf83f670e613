"""bench/benchkit.py: a bench's progress goes to stderr (bars on a terminal, plain lines off
one), never to stdout, which carries the bench's one JSON line."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from benchlib import benchkit  # noqa: E402
from benchlib.benchkit import Bench, time_left  # noqa: E402


def test_off_a_terminal_one_plain_line_per_phase_on_stderr(capsys):
    with Bench("demo", total=2) as bench:
        bench.phase("round 1")
        bench.phase("round 1")  # unchanged: no second line
        bench.log("round 1: {'x': 1}")
        bench.advance()
        bench.phase("round 2")
        benchkit.log("from a helper")  # the module-level log goes through the running Bench
        bench.advance()
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 5, lines
    assert re.fullmatch(r"demo 0/2 round 1 \[0:00:00 elapsed\]", lines[0])
    assert lines[1] == "round 1: {'x': 1}"
    assert re.fullmatch(r"demo 1/2 round 2 \[0:00:00 elapsed, ~0:00:00 left\]", lines[2])
    assert lines[3] == "from a helper"
    assert re.fullmatch(r"demo 2/2 done \[0:00:00 elapsed\]", lines[4])


def test_off_a_terminal_without_a_total_the_phase_alone(capsys):
    with Bench("demo") as bench:
        bench.phase("starting shards")
    out, err = capsys.readouterr()
    assert out == ""
    assert [line.split(" [")[0] for line in err.splitlines()] == ["demo: starting shards", "demo: done"]


def test_on_a_terminal_a_bar_shows_done_of_total(capsys):
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    with Bench("demo", total=3, console=console) as bench:
        bench.phase("round 1")
        bench.advance()
        bench.phase("round 2")
        with bench.aside():  # what an in-process `rlix run` prints while the bar is away
            print("nested output", file=console.file)
        bench.log("round 2: {'x': 2}")
        bench.advance()
    out, err = capsys.readouterr()
    assert out == "" and err == ""  # everything went to the console given
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # colours and cursor moves off
    # frames are drawn on a timer, but stopping draws one: aside() shows 1/3, the end 2/3
    assert "demo" in text and "1/3 round 2" in text and "left" in text
    assert "nested output" in text and "round 2: {'x': 2}" in text
    assert "2/3 done" in text  # the last frame stays on screen


def test_time_left_counts_down_within_a_round_but_not_below_the_rounds_to_go():
    # 2 of 5 rounds done in 20 s: 10 s a round
    assert time_left(2, 5, 20.0, 20.0) == 30.0
    assert time_left(2, 5, 20.0, 25.0) == 25.0
    assert time_left(2, 5, 20.0, 60.0) == 20.0  # a slow round: still two untouched rounds
