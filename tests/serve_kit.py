"""`rlix serve` as the tests start it: a free port, no token in its environment (the OpenAI API
open, the control plane refused), ready once /health answers; ended by its own PID."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from rlix import env
from rlix.httpkit import free_port


def start_serve(*args: str, keep_stderr: bool = False, timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`rlix serve ARGS --port P` started and answering /health: the process and its base URL.
    `keep_stderr`: its stderr is piped (stop_serve returns it); else dropped."""
    port = free_port()
    child_env = {k: v for k, v in os.environ.items() if k not in env.TOKEN_VARS}
    proc = subprocess.Popen([sys.executable, "-m", "rlix.cli", "serve", *args, "--port", str(port)],
                            env=child_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE if keep_stderr else subprocess.DEVNULL, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"rlix serve exited with {proc.returncode}: "
                                     f"{proc.stderr.read() if proc.stderr else ''}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"rlix serve did not come up within {timeout_s:g} s")
            time.sleep(0.3)
    except BaseException:
        stop_serve(proc)
        raise


def stop_serve(proc: subprocess.Popen) -> str:
    """SIGTERM to the server by its PID, SIGKILL after 20 s; what it wrote to stderr (kept only)."""
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""
