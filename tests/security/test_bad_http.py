"""Bad HTTP input against the engine server, the router and the scheduler's dashboard (issue 38,
"bounded work before any work"): every field and body is bounded and checked before any work is
done, with a 4xx naming the field.

Each case (the CASES table) is sent over a plain socket (so that a body can be announced larger
than what is sent, or sent chunked until the server answers) and must end within 2 s with its 4xx,
name the field where there is one, and answer briefly (error messages are capped). While it runs,
a thread asks the same server's /health over and over: every answer must come within 100 ms (an
`n` of 3,000,000 used to hold the engine's event loop, and its /health, for 31 s), and one more
right after (the machines these run on are shared: a slow /health is measured once more, with
the case sent again; a request that blocks the loop blocks it every time). The engine server is a
real process (tests/inference/kit.py), the dashboard too (as the scheduler's actor serves it, on
a thread of its own), so that its threads can be counted; the router runs on a thread of this
process. The last test checks that the servers' memory grew by less than 100 MB over the whole
suite (VmRSS)."""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from kit import AUTH, KEY, shard_processes  # noqa: E402

from rlix.inference.router.app import RouterServer  # noqa: E402
from rlix.inference.router.router import Router  # noqa: E402

BUDGET_S = 2.0  # each case ends within this
HEALTH_S = 0.1  # /health answers within this, during and after each case
MAX_ANSWER = 4096  # an error answer is short (no echo of a huge input)
DEEP = b"[" * 100_000 + b"]" * 100_000
UNCLOSED = b'{"a": ' + b"[" * 100_000


def j(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def gen(**sampling: object) -> bytes:
    return j({"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2, **sampling}})


def cmpl(**fields: object) -> bytes:
    return j({"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields})


def chat(**fields: object) -> bytes:
    return j({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})


# ---------------------------------------------------------------- plumbing
def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


def rss_mb(pid: int) -> float:
    return proc_status(pid, "VmRSS") / 1024


@dataclass
class Answer:
    status: int
    body: bytes
    took: float

    def error(self) -> tuple[str, str]:
        """(message, param) of the error body, whatever its shape."""
        try:
            data = json.loads(self.body)
        except ValueError:
            return self.body.decode(errors="replace"), ""
        err = data.get("error") if isinstance(data, dict) else data
        if isinstance(err, dict):
            return str(err.get("message")), str(err.get("param") or "")
        return str(err or data), ""


def send(url: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
         announce: int | None = None, chunked: bool = False) -> Answer:
    """One request over a fresh connection. `announce`: the Content-Length sent (the body is then
    repeated up to it, piece by piece); `chunked`: the body sent as 1 MiB chunks, repeated to
    `announce` bytes. Sending stops as soon as the server answers (a refused body is not read)."""
    host, port = url.split("//")[1].split(":")
    head = [f"{method} {path} HTTP/1.1", "host: x", "connection: close",
            *(f"{k}: {v}" for k, v in (headers or {}).items())]
    head.append("transfer-encoding: chunked" if chunked else f"content-length: {announce or len(body)}")
    total = announce or len(body)
    piece = (body or b" ") * max(1, 2**20 // max(1, len(body)))
    t0 = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        except OSError:
            total = 0  # a head refused before it was all sent: read the answer
        sent = 0
        while sent < total:
            if select.select([s], [], [], 0)[0]:
                break  # answered already
            part = body[sent:sent + 2**20] if announce is None else piece[:total - sent]
            framed = b"%x\r\n%s\r\n" % (len(part), part) if chunked else part
            try:
                s.sendall(framed)
            except OSError:
                break
            sent += len(part)
        else:
            if chunked:
                try:
                    s.sendall(b"0\r\n\r\n")
                except OSError:
                    pass  # refused and closed already
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    took = time.perf_counter() - t0
    assert data, f"no answer to {method} {path}"
    status = int(data.split(b" ", 2)[1])
    raw = data.partition(b"\r\n\r\n")[2]
    return Answer(status, raw, took)


class HealthProbe(threading.Thread):
    """Asks `url`/health again and again (keep-alive) until stopped; the slowest answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.host, self.port = url.split("//")[1].split(":")
        self.stop_at = threading.Event()
        self.slowest, self.count, self.failures = 0.0, 0, []

    @staticmethod
    def once(conn: http.client.HTTPConnection) -> float:
        t0 = time.perf_counter()
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        return time.perf_counter() - t0

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=10)
        while not self.stop_at.is_set():
            t0 = time.perf_counter()
            try:
                took = self.once(conn)
            except (OSError, http.client.HTTPException):  # closed by the server (the dashboard
                conn.close()  # drops an idle keep-alive connection at its cap): a new one
                conn = http.client.HTTPConnection(self.host, int(self.port), timeout=10)
                try:
                    self.once(conn)
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.failures.append(repr(exc))
                took = time.perf_counter() - t0
            self.slowest = max(self.slowest, took)
            self.count += 1
            time.sleep(0.005)
        conn.close()

    def __enter__(self) -> HealthProbe:
        self.start()
        time.sleep(0.02)  # a first answer before the case
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_at.set()
        self.join(15)


def health_after(url: str) -> float:
    conn = http.client.HTTPConnection(*url.split("//")[1].split(":"), timeout=10)
    try:
        return HealthProbe.once(conn)
    finally:
        conn.close()


# ---------------------------------------------------------------- servers
#: the dashboard's process: a scheduler core with one pipeline, its page served until stdin closes
DASHBOARD = """
import sys
from rlix.scheduler import dashboard as D
from rlix.scheduler.core import SchedulerCore
from rlix.scheduler.planning.planner import PlannerParams
from rlix.scheduler.types import PipelineSpec, Topology

D.HEAD_TIMEOUT_S = 0.5  # (5 s in service) half-open connections closed sooner, for the test
core = SchedulerCore(Topology((2, 2)), PlannerParams(dwell_s=0.0))
feed = D.DashboardFeed()
feed.start(core)
core.register(PipelineSpec("a", train_gpus=1, max_shards=4))
core.replan()
feed.refresh(core)
server = D.DashboardServer(feed.state)
print(server.serve(0), flush=True)
sys.stdin.read()
server.close()
"""


@pytest.fixture(scope="module")
def dashboard():
    """The dashboard in a process of its own: (url, pid); ended by its PID."""
    proc = subprocess.Popen([sys.executable, "-c", DASHBOARD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def servers(tiny_model_dir, dashboard):
    """A real engine server process (max_num_seqs 64), a router in front of it (on a thread of
    this process, with its own loop) and the dashboard's process; every one ended at the end."""
    dash_url, dash_pid = dashboard
    with shard_processes(tiny_model_dir, 1, max_model_len=512) as (shard,):
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        router = Router(KEY)
        server = RouterServer(router)
        try:
            asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
            asyncio.run_coroutine_threadsafe(router.set_shard(0, shard.url, "active"), loop).result(10)
            urls = {"engine": shard.url, "router": server.url, "dashboard": dash_url}
            # warm both up (first requests load lazily), then note the memory the suite starts from
            for where in ("engine", "router"):
                assert send(urls[where], "POST", "/inference/v1/generate", gen(), AUTH).status == 200
            pids = {"engine": shard.server_pid(), "here": _self_pid(), "dashboard": dash_pid}
            yield {**urls, "pids": pids, "rss": {k: rss_mb(pid) for k, pid in pids.items()}}
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def _self_pid() -> int:
    import os

    return os.getpid()


# ---------------------------------------------------------------- the cases
def engine_state(path: str, key: str) -> Callable[[dict], None]:
    """A check after the case: the engine's `key` (from GET `path`) is still false."""
    def check(urls: dict) -> None:
        answer = send(urls["engine"], "GET", path, headers=AUTH)
        assert answer.status == 200 and json.loads(answer.body) == {key: False}, answer.body
    return check


@dataclass
class Case:
    server: str  # engine | router | dashboard
    what: str
    path: str
    body: Callable[[], bytes]  # made when the case runs (some are MBs)
    status: int
    names: str | None = None  # what the error must name (its param or message)
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {**AUTH, "content-type": "application/json"})
    announce: int | None = None  # a Content-Length larger than what is sent: see send()
    chunked: bool = False
    after: Callable[[dict], None] | None = None


E, R, DB = "engine", "router", "dashboard"
GEN, CMPL, CHAT = "/inference/v1/generate", "/v1/completions", "/v1/chat/completions"
MB = 2**20
CASES = [
    # ------------------------------------------------ n and the other numbers, at parse time
    Case(E, "n = 3,000,000 (generate)", GEN, lambda: gen(n=3_000_000), 400, "sampling_params.n"),
    Case(E, "n = 3,000,000 (completions)", CMPL, lambda: cmpl(n=3_000_000), 400, "n"),
    Case(E, "n = 3,000,000 (chat, streamed)", CHAT, lambda: chat(n=3_000_000, stream=True), 400, "n"),
    Case(E, "n = 1000 above max_num_seqs (the engine's check, before per-sample work)", CHAT,
         lambda: chat(n=1000, stop=["x"]), 400, "n"),
    Case(E, "n = 65 with stop strings (generate)", GEN, lambda: gen(n=65, stop=["x"]), 400, "n"),
    Case(E, "max_tokens = 10**30", GEN, lambda: gen(max_tokens=10**30), 400, "max_tokens"),
    Case(E, "max_completion_tokens = 2**40", CHAT, lambda: chat(max_completion_tokens=2**40), 400,
         "max_completion_tokens"),
    Case(E, "seed = 2**70", GEN, lambda: gen(seed=2**70), 400, "seed"),
    Case(E, "top_k = 2**40", CMPL, lambda: cmpl(top_k=2**40), 400, "top_k"),
    Case(E, "best_of = 5000", CMPL, lambda: cmpl(best_of=5000), 400, "best_of"),
    # ------------------------------------------------ lists and strings
    Case(E, "100 stop strings", GEN, lambda: gen(stop=["a"] * 100), 400, "stop"),
    Case(E, "a 5000-character stop string", CMPL, lambda: cmpl(stop="x" * 5000), 400, "stop"),
    Case(E, "5000 stop_token_ids", GEN, lambda: gen(stop_token_ids=[1] * 5000), 400, "stop_token_ids"),
    Case(E, "2000 logit_bias entries", GEN, lambda: gen(logit_bias={str(i): 1.0 for i in range(2000)}), 400,
         "logit_bias"),
    Case(E, "300,000 token_ids", GEN, lambda: j({"token_ids": [5] * 300_000}), 400, "token_ids"),
    Case(E, "200,000 strings as token_ids: one error, not 200,000", GEN,
         lambda: j({"token_ids": ["a"] * 200_000}), 400, "token_ids"),
    Case(E, "100,000 wrong logit_bias entries (counted before they are read)", CMPL,
         lambda: cmpl(logit_bias={str(i): "x" for i in range(100_000)}), 400, "logit_bias"),
    Case(E, "a prompt of 300,000 ids", CMPL, lambda: cmpl(prompt=[5] * 300_000), 400, "prompt"),
    Case(E, "a prompt of 1.5 M characters", CMPL, lambda: cmpl(prompt="hello " * 250_000), 400, "prompt"),
    Case(E, "5000 messages", CHAT, lambda: chat(messages=[{"role": "user", "content": "x"}] * 5000), 400,
         "messages"),
    Case(E, "a chat message of role 'god'", CHAT, lambda: chat(messages=[{"role": "god", "content": "x"}]), 400,
         "messages[0].role"),
    Case(E, "a chat message without a role", CHAT, lambda: chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    Case(E, "300 tools", CHAT, lambda: chat(tools=[{"type": "function", "function": {"name": "f"}}] * 300),
         400, "tools"),
    Case(E, "a 10,000-character request_id", GEN, lambda: j({"token_ids": [5], "request_id": "r" * 10_000}),
         400, "request_id"),
    Case(E, "/detokenize of 300,000 tokens", "/detokenize", lambda: j({"tokens": [5] * 300_000}), 400, "tokens"),
    Case(E, "/tokenize of 1.5 M characters", "/tokenize", lambda: j({"prompt": "x" * 1_500_000}), 400, "prompt"),
    Case(E, "/v1/responses with 5000 input items", "/v1/responses",
         lambda: j({"model": "tiny", "input": [{"role": "user", "content": "x"}] * 5000}), 400, "input"),
    Case(E, "/abort_requests naming 20,000 ids", "/abort_requests", lambda: j({"request_ids": ["r"] * 20_000}),
         400, "request_ids"),
    Case(E, "/sync_weights with 70,000 updates", "/sync_weights",
         lambda: j({"weight_version": 1, "layout_id": "x", "updates": [{}] * 70_000}), 400, "updates"),
    # ------------------------------------------------ JSON nested 100,000 deep
    Case(E, "deep JSON on generate", GEN, lambda: DEEP, 400, "deeper than 64"),
    Case(E, "deep JSON on chat", CHAT, lambda: b'{"messages": ' + DEEP + b"}", 400, "deeper than 64"),
    Case(E, "deep JSON, never closed, on completions", CMPL, lambda: UNCLOSED, 400, "deeper than 64"),
    Case(E, "deep JSON on /abort_requests", "/abort_requests", lambda: DEEP, 400, "deeper than 64"),
    Case(E, "deep JSON on /sync_weights", "/sync_weights", lambda: b'{"updates": ' + DEEP + b"}", 400,
         "deeper than 64"),
    Case(E, "deep JSON on /update_weights", "/update_weights", lambda: DEEP, 400, "deeper than 64"),
    Case(E, "deep JSON on /init_weight_transfer_engine", "/init_weight_transfer_engine", lambda: UNCLOSED, 400,
         "deeper than 64"),
    Case(E, "a layout given as deep JSON text", "/init_weight_transfer_engine",
         lambda: j({"init_info": {"layout": "[" * 1000 + "]" * 1000}}), 400, "layout"),
    Case(E, "tool-call arguments given as deep JSON text", CHAT, lambda: chat(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
        {"role": "user", "content": "y"}]), 400, "messages"),
    # ------------------------------------------------ body sizes: 413 before the body is read
    Case(E, "a 100 MB control body (announced)", "/abort_requests", lambda: b"x", 413, "exceeds the limit",
         announce=100 * MB),
    Case(E, "a 5 MB control body, chunked", "/sleep", lambda: b"x", 413, "exceeds the limit",
         announce=5 * MB, chunked=True, after=engine_state("/is_sleeping", "is_sleeping")),
    Case(E, "a 100 MB data-plane body (announced)", CMPL, lambda: b"x", 413, "exceeds the limit",
         announce=100 * MB),
    Case(E, "a 2 GB safetensors body for a few-MB model", "/update_weights", lambda: b"\0", 413,
         "exceeds the limit", announce=2**31,
         headers={**AUTH, "content-type": "application/octet-stream"}),
    Case(E, "a 40 MB JSON body to /sync_weights (announced)", "/sync_weights", lambda: b"x", 413,
         "exceeds the limit", announce=40 * MB),
    Case(E, "a 100 KB request header", "/health", lambda: b"", 431, "request head", method="GET",
         headers={"x-big": "h" * 100_000}),
    # ------------------------------------------------ malformed control bodies change nothing
    Case(E, "/sleep with a garbage body", "/sleep", lambda: b"garbage\xff{", 400, "Invalid JSON",
         after=engine_state("/is_sleeping", "is_sleeping")),
    Case(E, "/sleep with a JSON list", "/sleep?level=1", lambda: b"[1, 2]", 400, "JSON object",
         after=engine_state("/is_sleeping", "is_sleeping")),
    Case(E, "/sleep with its level in the body", "/sleep", lambda: j({"level": 2}), 400, "level",
         after=engine_state("/is_sleeping", "is_sleeping")),
    Case(E, "/pause with a garbage body", "/pause?mode=keep", lambda: b"pause now", 400, "Invalid JSON",
         after=engine_state("/is_paused", "is_paused")),
    Case(E, "/wake_up with a garbage body", "/wake_up", lambda: b"\x00\x01", 400, "Invalid JSON"),
    Case(E, "/wake_up with an unknown tag", "/wake_up?tags=weights&tags=everything", lambda: b"", 400, "tags"),
    Case(E, "/resume with a garbage body", "/resume", lambda: b"{{{", 400, "Invalid JSON"),
    # ------------------------------------------------ errors do not echo huge inputs
    Case(E, "an unknown field with a 100,000-character name", CMPL,
         lambda: cmpl(**{"x" * 100_000: 1}), 400, "unknown or unsupported field"),
    Case(E, "a 4000-character model name", CMPL, lambda: cmpl(model="m" * 4000), 404, "model"),
    Case(E, "a logit_bias key of 50,000 characters", GEN, lambda: gen(logit_bias={"k" * 50_000: 1.0}), 400,
         "logit_bias"),
    # ------------------------------------------------ the router (its data plane needs no token)
    Case(R, "n = 1,000,000 (generate)", GEN, lambda: gen(n=1_000_000), 400, "sampling_params.n"),
    Case(R, "n = 1,000,000 (completions, streamed)", CMPL, lambda: cmpl(n=1_000_000, stream=True), 400, "n"),
    Case(R, "n = 1,000,000 (chat)", CHAT, lambda: chat(n=1_000_000), 400, "n"),
    Case(R, "max_tokens = 10**30", CMPL, lambda: cmpl(max_tokens=10**30), 400, "max_tokens"),
    Case(R, "100 stop strings", CHAT, lambda: chat(stop=["a"] * 100), 400, "stop"),
    Case(R, "5000 messages", CHAT, lambda: chat(messages=[{"role": "user", "content": "x"}] * 5000), 400,
         "messages"),
    Case(R, "300,000 token_ids", GEN, lambda: j({"token_ids": [5] * 300_000}), 400, "token_ids"),
    Case(R, "/v1/responses with 5000 input items", "/v1/responses",
         lambda: j({"model": "tiny", "input": [{"role": "user", "content": "x"}] * 5000}), 400, "input"),
    Case(R, "deep JSON on completions", CMPL, lambda: DEEP, 400, "deeper than 64"),
    Case(R, "deep JSON on generate", GEN, lambda: UNCLOSED, 400, "deeper than 64"),
    Case(R, "deep JSON on /v1/responses", "/v1/responses", lambda: DEEP, 400, "deeper than 64"),
    Case(R, "deep JSON on /tokenize", "/tokenize", lambda: DEEP, 400, "deeper than 64"),
    Case(R, "deep JSON on the admin API", "/router/shards", lambda: DEEP, 400, "deeper than 64"),
    Case(R, "a 100 MB admin body (announced)", "/router/shards", lambda: b"x", 413, "exceeds the limit",
         announce=100 * MB),
    Case(R, "a 3 MB admin body, chunked", "/router/shards", lambda: b"x", 413, "exceeds the limit",
         announce=3 * MB, chunked=True),
    Case(R, "a 100 MB data-plane body (announced)", CHAT, lambda: b"x", 413, "exceeds the limit",
         announce=100 * MB),
    Case(R, "a 2 MB request header", "/health", lambda: b"", 431, "request head", method="GET",
         headers={"x-big": "h" * 2_000_000}),
    Case(R, "a 10,000-character shard url", "/router/shards",
         lambda: j({"rank": 5, "url": "http://" + "h" * 10_000}),
         400, "url"),
    Case(R, "an unknown field with a 100,000-character name (the shard's error, relayed)", CMPL,
         lambda: cmpl(**{"x" * 100_000: 1}), 400, "unknown or unsupported field"),
    # ------------------------------------------------ the dashboard (GET only)
    Case(DB, "a POST of deep JSON", "/api/state", lambda: DEEP, 405, "GET only"),
    Case(DB, "a 100 MB POST (announced)", "/api/state", lambda: b"x", 405, "GET only", announce=100 * MB),
    Case(DB, "a GET with a body", "/api/state", lambda: b"{}", 413, "no body", method="GET"),
    Case(DB, "a 20 KB request head", "/api/state", lambda: b"", 431, "request head", method="GET",
         headers={"x-big": "h" * 20_000}),
    Case(DB, "a 6000-character path", "/" + "p" * 6000, lambda: b"", 404, "no such page", method="GET"),
    Case(DB, "a 6000-character window_s", "/api/state?window_s=" + "9" * 6000, lambda: b"", 400, "window_s",
         method="GET"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.server}: {c.what}" for c in CASES])
def test_bad_request_is_refused_fast_and_health_stays_fast(case: Case, servers) -> None:
    url = servers[case.server]
    body = case.body()
    for _ in range(2):  # a slow /health measured once more (see the module's doc)
        with HealthProbe(url) as probe:
            answer = send(url, case.method, case.path, body, case.headers, case.announce, case.chunked)
        if probe.slowest < HEALTH_S:
            break
    assert answer.status == case.status, (answer.status, answer.body[:500])
    assert answer.took < BUDGET_S, f"took {answer.took:.2f} s"
    assert len(answer.body) < MAX_ANSWER, f"a {len(answer.body)}-byte answer"
    message, param = answer.error()
    if case.names:
        assert case.names.lower() in f"{param} {message}".lower(), (param, message)
    assert not probe.failures, probe.failures
    assert probe.count >= 1 and probe.slowest < HEALTH_S, f"/health took {probe.slowest * 1000:.0f} ms"
    assert health_after(url) < HEALTH_S
    if case.after is not None:
        case.after(servers)


def _over(name: str, bound) -> list[object]:  # type: ignore[no-untyped-def]
    """Values of field `name` just past each of `bound`'s limits."""
    out: list[object] = []
    if bound.most is not None:
        out.append(bound.most + 1)
    if bound.least is not None:
        out.append(bound.least - 1)
    if bound.items is not None:
        if name in ("logit_bias", "chat_template_kwargs"):
            out.append({str(i): 1.0 for i in range(bound.items + 1)})
        else:
            item = {"messages": {"role": "user", "content": "x"}, "input": {"role": "user", "content": "x"},
                    "tools": {"type": "function", "function": {"name": "f"}}, "stop": "a"}.get(name, 1)
            out.append([item] * (bound.items + 1))
    if bound.chars is not None:
        out.append("x" * (bound.chars + 1))
    return out


def _bounded_fields() -> list[tuple[str, str]]:
    from rlix.inference.server.limits import FIELD_BOUNDS, SAMPLING_BOUNDS
    from rlix.inference.server.paths import GENERATE

    fields = [(path, name) for path, bounds in FIELD_BOUNDS.items() for name in bounds]
    return fields + [(GENERATE, f"sampling_params.{name}") for name in SAMPLING_BOUNDS]


@pytest.mark.parametrize("path,name", _bounded_fields())
def test_the_router_and_the_engine_bound_the_same_fields(path: str, name: str) -> None:
    """limits.FIELD_BOUNDS is the one table: every bound the router checks (check_bounds) the
    engine's models refuse too, naming the field (no server needed)."""
    from pydantic import ValidationError

    from rlix.errors import InvalidRequestError
    from rlix.inference.server import openai_schema as S
    from rlix.inference.server.limits import FIELD_BOUNDS, SAMPLING_BOUNDS, check_bounds
    from rlix.inference.server.responses_api import parse

    base = {"/v1/completions": {"prompt": "hi"},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
            "/inference/v1/generate": {"token_ids": [1]}, "/v1/responses": {"input": "hi"}}[path]
    field = name.split(".")[-1]
    bound = SAMPLING_BOUNDS[field] if name.startswith("sampling_params.") else FIELD_BOUNDS[path][name]
    model = {"/v1/completions": S.CompletionRequest, "/v1/chat/completions": S.ChatCompletionRequest,
             "/inference/v1/generate": S.GenerateRequest}.get(path)
    for value in _over(field, bound):
        body = {**base, "sampling_params": {field: value}} if name.startswith("sampling_params.") \
            else {**base, field: value}
        with pytest.raises(InvalidRequestError) as refused:
            check_bounds(path, body)
        assert refused.value.param == name
        if model is None:  # /v1/responses: read by responses_api.parse, which checks the same table
            with pytest.raises(InvalidRequestError):
                parse(body)
        elif field in (S.GenerateSamplingParams if name.startswith("sampling_params.") else model).model_fields:
            # (a field the model lacks is refused by name as unknown: openai_schema.refuse_unsupported)
            with pytest.raises(ValidationError) as invalid:
                model.model_validate(body)
            assert any(field in map(str, e["loc"]) for e in invalid.value.errors()), invalid.value.errors()[:2]


def test_json_brackets_inside_strings_are_not_nesting(servers) -> None:
    """The depth check reads strings as strings: 100,000 brackets in a prompt are text."""
    body = chat(messages=[{"role": "user", "content": "[{" * 50_000 + '\\"]' * 10}], max_tokens=1)
    for where in ("engine", "router"):
        answer = send(servers[where], "POST", CHAT, body, {**AUTH, "content-type": "application/json"})
        # refused as longer than the context: the brackets were read as text
        assert answer.status == 400 and "input_tokens" in answer.error()[1], answer.body[:300]


def half_open(url: str, n: int) -> tuple[list[socket.socket], HealthProbe]:
    port = int(url.rsplit(":", 1)[1])
    socks = []
    with HealthProbe(url) as probe:
        for i in range(n):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 2:
                s.sendall(b"GET /api/state HTTP/1.1\r\nhost: x\r\n")  # a head never finished
            socks.append(s)
        time.sleep(0.1)
    return socks, probe


def test_dashboard_half_open_connections_do_not_grow_threads(servers) -> None:
    """300 connections that never finish a request: no thread each (the old server made 329
    threads), /health still answers within 100 ms, and they are closed (over the cap at once,
    the rest after HEAD_TIMEOUT_S)."""
    url, pid = servers["dashboard"], servers["pids"]["dashboard"]
    threads = proc_status(pid, "Threads")
    socks, probe = half_open(url, 300)
    assert proc_status(pid, "Threads") == threads
    if probe.slowest >= HEALTH_S:  # measured once more (see the module's doc)
        time.sleep(1)
        for s in socks:
            s.close()
        socks, probe = half_open(url, 300)
    assert not probe.failures, probe.failures
    assert probe.slowest < HEALTH_S, f"/health took {probe.slowest * 1000:.0f} ms"
    deadline = time.monotonic() + 3
    open_ = 0
    for s in socks:  # every one is closed by the server: over the cap at once, the rest timed out
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            open_ += 1
        finally:
            s.close()
    assert open_ == 0, f"{open_} connections left open"
    assert proc_status(pid, "Threads") == threads


def test_a_connection_without_a_request_head_is_closed() -> None:
    """The engine's and the router's uvicorn protocol (httpkit.bounded_http_protocol): a new
    connection that sends no complete head, or an idle kept-alive one that starts a head and
    stalls, is closed after the head timeout; a kept-alive connection still serves requests."""
    import uvicorn

    from rlix.httpkit import bounded_http_protocol, free_port

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error", lifespan="off",
                                           http=bounded_http_protocol(head_timeout_s=0.3)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        silent = socket.create_connection(("127.0.0.1", port), timeout=3)
        kept = socket.create_connection(("127.0.0.1", port), timeout=3)
        kept.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert kept.recv(1024).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET / HTTP/1.1\r\n")  # a second head, never finished
        t0 = time.perf_counter()
        for s in (silent, kept):
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
            s.close()
        assert time.perf_counter() - t0 < 2
    finally:
        server.should_exit = True
        thread.join(10)


def test_memory_stayed_bounded(servers) -> None:
    """After every case above: the RSS of the engine server, of the dashboard's process and of
    this one (the router's) grew by less than 100 MB each."""
    for name, pid in servers["pids"].items():
        grown = rss_mb(pid) - servers["rss"][name]
        assert grown < 100, f"{name}: grew by {grown:.0f} MB"
