"""Start-up progress of shard servers: the phase read from a bounded tail of a (fake) server
log, health from a (fake) check, and the console lines the run prints from the snapshots."""

from __future__ import annotations

import logging
import os
import sys

from rlix.inference.fleet.backends import EngineBackendConfig, make_backend
from rlix.inference.fleet.shard_process import ShardProcess
from rlix.inference.fleet.startup import (
    EXITED,
    HEALTHY,
    STARTED,
    TAIL_BYTES,
    VLLM_PHASES,
    ShardStartup,
    StartupReporter,
    StartupWatch,
    read_tail,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_phase_follows_the_log_and_health(tmp_path):
    log = tmp_path / "shard.log"
    log.write_text("Triton is installed\n")
    clock, healthy, alive = Clock(), [False], [True]
    watch = StartupWatch(log, VLLM_PHASES, healthy=lambda: healthy[0], alive=lambda: alive[0], clock=clock)
    assert watch.phase() == STARTED
    with open(log, "a") as fh:
        fh.write("(EngineCore pid=1) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0)\n")
        fh.write("(Worker pid=2) INFO [cpu_model_runner.py:68] Starting to load model /m...\n")
    assert watch.phase() == "loading model"
    with open(log, "a") as fh:
        fh.write("(EngineCore pid=1) INFO CPU KV cache size: 1,048,576 tokens\n")
    assert watch.phase() == "KV cache set-up"
    with open(log, "a") as fh:
        fh.write("x" * (2 * TAIL_BYTES) + "\n")  # the marker scrolls out of the tail: the phase stays
    assert watch.phase() == "KV cache set-up"
    clock.t += 42.0
    state = watch.state(3, 777)
    assert state == ShardStartup(key=3, pid=777, phase="KV cache set-up", elapsed_s=42.0, healthy=False)
    healthy[0] = True
    clock.t += 1.0
    assert watch.state(3, 777).healthy and watch.state(3, 777).elapsed_s == 43.0
    clock.t += 100.0  # healthy: its start-up time stays what it was
    assert watch.state(3, 777) == ShardStartup(3, 777, HEALTHY, 43.0, True)
    assert ShardStartup.from_dict(watch.state(3, 777).as_dict()) == watch.state(3, 777)


def test_an_exited_server_and_a_missing_log(tmp_path):
    watch = StartupWatch(tmp_path / "none.log", VLLM_PHASES, healthy=lambda: False, alive=lambda: False)
    assert watch.phase() == EXITED
    assert read_tail(tmp_path / "none.log") == ""
    big = tmp_path / "big.log"
    big.write_bytes(b"a" * (3 * TAIL_BYTES) + b"END")
    assert len(read_tail(big)) == TAIL_BYTES and read_tail(big).endswith("END")


def test_reporter_lines_every_interval_then_healthy_then_all_up():
    lines: list[str] = []
    clock = Clock()
    rep = StartupReporter(lines.append, "p1", what="vllm server", interval_s=10.0, quiet_s=3.0, clock=clock)

    def at(t: float, *states: tuple[int, str, float, bool]) -> None:
        clock.t = 100.0 + t
        rep.update([ShardStartup(key, 1000 + key, phase, el, ok) for key, phase, el, ok in states])

    at(1, (0, STARTED, 1.0, False), (1, STARTED, 1.0, False))
    assert lines == []  # a quick start says nothing
    at(4, (0, "engine starting", 4.0, False), (1, STARTED, 4.0, False))
    assert lines == ["p1: vllm server 0 engine starting (4s)", "p1: vllm server 1 process started (4s)"]
    at(8, (0, "loading model", 8.0, False), (1, "loading model", 8.0, False))
    assert len(lines) == 2  # not yet due again
    at(14, (0, "KV cache set-up", 14.0, False), (1, "loading model", 14.0, False))
    assert lines[2:] == ["p1: vllm server 0 KV cache set-up (14s)", "p1: vllm server 1 loading model (14s)"]
    at(20, (0, HEALTHY, 19.0, True), (1, "API server starting", 20.0, False))
    assert lines[4:] == ["p1: vllm server 0 healthy after 19s"]
    at(22, (0, HEALTHY, 19.0, True), (1, HEALTHY, 21.0, True))
    assert lines[5:] == ["p1: vllm server 1 healthy after 21s", "p1: all 2 vllm server(s) up in 21s"]
    at(60, (0, HEALTHY, 19.0, True), (1, HEALTHY, 21.0, True))
    assert len(lines) == 7  # nothing more once all are up
    # a replacement later (a new process under key 1) is a batch of its own
    clock.t = 170.0
    rep.update([ShardStartup(0, 1000, HEALTHY, 19.0, True), ShardStartup(1, 2001, "loading model", 6.0, False)])
    clock.t = 180.0
    rep.update([ShardStartup(0, 1000, HEALTHY, 19.0, True), ShardStartup(1, 2001, HEALTHY, 15.0, True)])
    assert lines[7:] == ["p1: vllm server 1 loading model (6s)", "p1: vllm server 1 healthy after 15s",
                         "p1: all 1 vllm server(s) up in 15s"]


def test_reporter_says_a_server_that_exited_while_starting():
    lines: list[str] = []
    clock = Clock()
    rep = StartupReporter(lines.append, "p", interval_s=10.0, quiet_s=3.0, clock=clock)
    rep.update([ShardStartup(0, 5, "loading model", 5.0, False)])
    clock.t += 5
    rep.update([ShardStartup(0, 5, EXITED, 10.0, False)])
    assert lines == ["p: server 0 loading model (5s)", "p: server 0 exited before it was healthy (10s)"]


def test_a_fast_server_through_shard_process_reports_healthy(tmp_path):
    """ShardProcess feeds its watch: started, then healthy once its check passed."""
    cfg = EngineBackendConfig(model="tiny", startup_timeout_s=60)
    proc = ShardProcess(make_backend(cfg), "k", log_dir=tmp_path)
    assert proc.startup(0) is None
    # a stand-in server: serves /health after a moment (no model needed)
    script = ("import http.server,sys,time\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self): self.send_response(200); self.end_headers()\n"
              "    def log_message(self,*a): pass\n"
              "print('Started server process', flush=True); time.sleep(0.3)\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    proc.launch = lambda: ([sys.executable, "-c", script, str(proc.port)], dict(os.environ))
    try:
        proc.start()
        first = proc.startup(0)
        assert first is not None and not first.healthy and first.pid == proc.pid
        proc.wait_ready(30)
        assert proc.startup(0).healthy and proc.startup(0).phase == HEALTHY
    finally:
        code = proc.stop()
    assert code is not None and not proc.alive()


class EngineDead(Exception):
    pass


def _record(exc: BaseException | None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord("vllm.v1.engine.async_llm", logging.ERROR, "async_llm.py", 906,
                             "AsyncLLM output_handler failed.", (), exc_info)
