"""RunLog: lines go to the console and run.log alike; on a terminal each pipeline gets a bar."""

from __future__ import annotations

import io
import re

from rlix.run_log import RunLog


def test_off_a_terminal_only_stamped_lines(tmp_path):
    out = io.StringIO()
    say = RunLog(tmp_path / "run.log", out)
    say("a: ready")
    say.step("a", 1, 4, 0.25)
    say.close()
    printed = out.getvalue().splitlines()
    assert len(printed) == 1 and printed[0].endswith("] a: ready")
    assert (tmp_path / "run.log").read_text().splitlines() == printed


def test_on_a_terminal_bars_show_each_pipelines_steps(tmp_path):
    out = io.StringIO()
    say = RunLog(tmp_path / "run.log", out, force_terminal=True)
    say("a: ready")
    say.step("a", 1, 4, 0.25)
    say.step("b", 2, 8, None)
    say.step("a", 3, 4, 0.5)
    say.step("a", 4, 4, None)  # finished: the last reward stays
    say.close()
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # colours and cursor moves off
    assert "a: ready" in screen
    assert "4/4 reward 0.500" in screen and "2/8" in screen
    # the file gets the lines only, never the bars
    assert [line.split("] ", 1)[1] for line in (tmp_path / "run.log").read_text().splitlines()] == ["a: ready"]
