"""Writes this process's PID to argv[1], then runs examples/external_loop/loop.py in it (so the
test can SIGKILL the very process that holds the pipeline's client)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

Path(sys.argv[1]).write_text(str(os.getpid()))
sys.argv = sys.argv[1:]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "external_loop" / "loop.py"),
               run_name="__main__")
