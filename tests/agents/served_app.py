"""An ASGI app (FastAPI) served by uvicorn on a free loopback port in a thread of the test's
process: the agents' tests' stand-in policies, agents and resources servers (one copy)."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from rlix.httpkit import free_port


class ServedApp:
    """`with ServedApp(app) as served:` ... `served.url`; or `start()` / `stop()`."""

    def __init__(self, app: Any, start_timeout_s: float = 10.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout_s = start_timeout_s
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name=f"served-{self.port}", daemon=True)

    def start(self) -> ServedApp:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started, f"the app on port {self.port} did not start in {self.start_timeout_s:g} s"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)

    def __enter__(self) -> ServedApp:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
