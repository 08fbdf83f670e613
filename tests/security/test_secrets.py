"""No secret on a command line, no address or token in a file other users may read (issue 38).

Every user of a machine can read any process's command line (/proc/PID/cmdline, `ps`), but only
its owner can read its environment (/proc/PID/environ): a token rlix hands a process it starts
(a shard server's, which lets its holder sleep or pause shards and push weights) goes in the
environment. Files that hold an address or a token (the run's process table, its logs, a
cluster's state file) are mode 0600; ordinary results keep the umask's mode. And nothing of a run
or of an `rlix up` cluster listens where another machine could connect: every listening socket of
their processes (Ray's included) is on loopback.

`rlix run` and `rlix up` end to end take ~45 s and ~20 s on 2 cores: in the default step too
(the two `rlix up` tests share one cluster; the one that runs a client as another account needs
root and the account `nobody`, and skips, saying so, without them).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from rlix import env
from rlix.agents.supervisor import EnvServerSpec
from rlix.cluster.reaper import session_members
from rlix.envs.agent_config import EnvConfig
from rlix.inference.fleet.backends import EngineBackendConfig, make_backend, server_launch
from rlix.inference.fleet.shard_process import ShardProcess
from rlix.private_files import PRIVATE_MODE, open_private, write_private

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "inference"))
from kit import need_vllm  # noqa: E402
from listen_kit import Listener, listening_sockets, off_loopback  # noqa: E402

#: an address in a file: host:port (IPv4) or a URL's
ADDRESS = re.compile(rb"(?:\b\d{1,3}(?:\.\d{1,3}){3}:\d{2,5}\b)|(?:https?://[\w.-]+:\d{2,5})")
#: files that cannot hold an address as text (weights, optimizer state, images)
BINARY = {".safetensors", ".pt", ".png", ".bin"}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def proc_read(pid: int, what: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as fh:
            return fh.read()
    except OSError:
        return None


def shown(cmdline: bytes) -> str:
    return cmdline.replace(b"\0", b" ")[:300].decode(errors="replace")


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> set[int]:
    """Every live process below `root`, from each one's parent in /proc/PID/stat."""
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        raw = proc_read(pid, "stat")
        if raw is None:
            continue
        try:
            ppid = int(raw.rsplit(b")", 1)[1].split()[1])
        except (IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def environ(pid: int) -> dict[str, str]:
    raw = proc_read(pid, "environ") or b""
    return dict(e.decode(errors="replace").partition("=")[::2] for e in raw.split(b"\0") if b"=" in e)


def assert_no_token_on_any_command_line(token: str) -> None:
    """Not only the run's processes: none on the machine may show it."""
    needle = token.encode()
    for pid in all_pids():
        cmdline = proc_read(pid, "cmdline")
        assert cmdline is None or needle not in cmdline, f"pid {pid} shows the token: {shown(cmdline)}"


def assert_listening_on_loopback_only(listeners: dict[tuple[int, str, int], Listener],
                                      expected: dict[str, str]) -> None:
    """None of `listeners` is reachable from another machine, and among them are sockets of
    every kind of process in `expected` (what: a piece of its command line), so the check saw
    the processes it is about rather than passing on none."""
    wide = off_loopback(listeners.values())
    assert not wide, "listening beyond this machine:\n" + "\n".join(wide)
    missing = {what for what, piece in expected.items()
               if not any(piece in s.cmdline for s in listeners.values())}
    assert not missing, (f"no listening socket seen of {sorted(missing)}; seen: "
                         + "; ".join(str(s) for s in listeners.values()))


def assert_private_where_needed(root: Path, token: str) -> list[Path]:
    """No file under `root` holds the token; each one that holds an address is 0600. Returns
    those that hold an address."""
    holding = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        try:
            if path.suffix in BINARY or path.stat().st_size > 8 * 2**20:
                continue
            data = path.read_bytes()
        except FileNotFoundError:  # replaced or removed as we looked (the run goes on)
            continue
        assert token.encode() not in data, f"{path} holds the token"
        if ADDRESS.search(data):
            holding.append(path)
            assert mode(path) == PRIVATE_MODE, f"{path} holds an address and is mode {oct(mode(path))}"
    return holding


# ----------------------------------------------------------------------------- unit level
def test_private_files_are_0600_whatever_the_umask_and_an_old_file_is_narrowed(tmp_path):
    old = os.umask(0)
    try:
        with open_private(tmp_path / "a.log", "ab") as fh:
            fh.write(b"x")
        write_private(tmp_path / "s.json", "{}")
        wide = tmp_path / "old.log"
        wide.write_text("before\n")
        wide.chmod(0o644)
        with open_private(wide, "a") as fh:
            fh.write("after\n")
    finally:
        os.umask(old)
    assert mode(tmp_path / "a.log") == mode(tmp_path / "s.json") == mode(wide) == 0o600
    assert wide.read_text() == "before\nafter\n" and (tmp_path / "s.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.log", "old.log", "s.json"]  # no temp left


@pytest.mark.parametrize("backend", ["embedded", "vllm"])
def test_a_shard_launch_has_no_token_in_argv_and_passes_it_in_the_environment(tiny_model_dir, monkeypatch,
                                                                              backend):
    token = "tok-" + secrets.token_urlsafe(18)
    inherited = "inherited-" + secrets.token_urlsafe(12)
    for var in env.TOKEN_VARS:  # a token of this process must not leak to a child either
        monkeypatch.setenv(var, inherited)
    cfg = EngineBackendConfig(backend=backend, model=str(tiny_model_dir), python="/opt/py/bin/python")
    b = make_backend(cfg)
    cmd, extra = server_launch(b, host="127.0.0.1", port=9000, api_key=token)
    assert not any(token in a for a in cmd) and not any(a.startswith("--api-key") for a in cmd)
    var = "VLLM_API_KEY" if backend == "vllm" else "RLIX_API_KEY"  # what each server reads
    assert b.api_key_env == var and extra[var] == token

    proc = ShardProcess(b, token, port=9000)
    try:
        full_cmd, child_env = proc.launch()
    finally:
        proc.stop()  # its temp log dir
    assert not any(token in a or inherited in a for a in full_cmd)
    assert child_env[var] == token
    assert {k: v for k, v in child_env.items() if k in env.TOKEN_VARS} == {var: token}


def test_environment_servers_get_no_token_and_their_settings_off_the_command_line(monkeypatch):
    monkeypatch.setenv("RLIX_API_KEY", "run-token-xyz")
    cfg = EnvConfig(options={"tool_api_key": "users-own-credential"})
    spec = EnvServerSpec("resources", cfg)
    proc = ShardProcess(spec, "", port=9001)
    try:
        cmd, child_env = proc.launch()
    finally:
        proc.stop()
    assert not any("users-own-credential" in a or "run-token-xyz" in a for a in cmd)
    assert "run-token-xyz" not in child_env.values() and not set(env.TOKEN_VARS) & set(child_env)
    assert EnvConfig.model_validate_json(child_env[env.ENV_SERVER_CONFIG_VAR]) == cfg


class _SleepingBackend:
    """A 'server' that only sleeps: enough to read its /proc entries."""

    name, health_path, startup_timeout_s, supports_sleep = "sleeping", "/health", 10.0, False

    startup_phases: tuple = ()  # its log marks no phase
    ready_requests = ()
    api_key_env = env.API_KEY_VAR

    def command(self, *, host: str, port: int) -> list[str]:
        return [sys.executable, "-c", "import time; print('listening', flush=True); time.sleep(60)"]

    def env(self) -> dict[str, str]:
        return {}


def test_a_started_shard_process_shows_no_token_in_proc_cmdline(tmp_path):
    token = "tok-" + secrets.token_urlsafe(18)
    proc = ShardProcess(_SleepingBackend(), token, log_dir=tmp_path / "logs")
    proc.start()
    try:
        deadline = time.monotonic() + 20
        while proc.server_pid() is None or b"listening" not in proc.log_path.read_bytes():
            assert time.monotonic() < deadline and proc.alive(), proc.log_tail()
            time.sleep(0.05)
        server = proc.server_pid()
        for pid in (proc.pid, server):
            assert token.encode() not in (proc_read(pid, "cmdline") or b"")
        assert environ(server).get("RLIX_API_KEY") == token  # its owner's to read, no one else's
        assert mode(proc.log_path) == 0o600
    finally:
        proc.stop(grace_s=2)


def test_token_flags_warn_that_other_users_see_them(monkeypatch, capsys):
    import rlix.inference.router.app as router_app
    from rlix.cli import _token_flag

    assert _token_flag("rlix serve", "--api-key", "abc", "RLIX_API_KEY") == "abc"
    err = capsys.readouterr().err
    assert "--api-key is visible to every user" in err and "RLIX_API_KEY" in err
    assert _token_flag("rlix serve", "--api-key", None, "RLIX_API_KEY") is None
    assert capsys.readouterr().err == ""

    served: list[dict] = []
    monkeypatch.setattr(router_app, "serve_router", lambda shards, **kw: served.append(kw))
    monkeypatch.setenv("RLIX_API_KEY", "admin-from-env")
    monkeypatch.setenv("RLIX_SHARD_API_KEY", "shards-from-env")
    router_app.main(["--shard", "http://127.0.0.1:1"])
    assert capsys.readouterr().err == ""  # the variables: no warning
    assert served[-1]["api_key"] == "admin-from-env" and served[-1]["shard_api_key"] == "shards-from-env"
    router_app.main(["--shard", "http://127.0.0.1:1", "--api-key", "a", "--shard-api-key", "s"])
    err = capsys.readouterr().err
    assert "--api-key is visible" in err and "--shard-api-key is visible" in err
    assert served[-1]["api_key"] == "a" and served[-1]["shard_api_key"] == "s"


def test_the_socket_listing_tells_loopback_from_reachable_listeners():
    """The check the end-to-end tests rely on: it finds this process's listening sockets and
    calls a wildcard or machine-wide one reachable, a loopback one (IPv4-mapped too) not."""
    binds = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::1"),
             (socket.AF_INET6, "::"), (socket.AF_INET6, "::ffff:127.0.0.1")]
    socks = []
    try:
        for family, host in binds:
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, 0))
            sock.listen()
        ports = {sock.getsockname()[1]: host for sock, (_, host) in zip(socks, binds)}
        mine = {s.port: s for s in listening_sockets([os.getpid()]) if s.port in ports}
    finally:
        for sock in socks:
            sock.close()
    assert set(mine) == set(ports)
    assert {ports[p]: s.loopback for p, s in mine.items()} == {
        "127.0.0.1": True, "0.0.0.0": False, "::1": True, "::": False, "::ffff:127.0.0.1": True}
    wide = off_loopback(mine.values())
    assert len(wide) == 2 and all(f"pid {os.getpid()} (" in w for w in wide), wide


def test_rlix_commands_ask_for_a_loopback_ray_unless_told_otherwise(monkeypatch):
    """What a Ray started by an rlix command binds hangs on RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at
    Ray's import: set to "0" when absent, an explicit value (the user widening it) kept; which
    node IPs count as this machine's loopback."""
    from rlix.httpkit import is_loopback

    monkeypatch.delenv(env.RAY_CLUSTER_VAR, raising=False)
    env.keep_ray_on_loopback()
    assert os.environ[env.RAY_CLUSTER_VAR] == "0" and not env.ray_widened()
    monkeypatch.setenv(env.RAY_CLUSTER_VAR, "1")
    child = {env.RAY_CLUSTER_VAR: "1"}
    env.keep_ray_on_loopback()
    env.keep_ray_on_loopback(child)
    assert os.environ[env.RAY_CLUSTER_VAR] == child[env.RAY_CLUSTER_VAR] == "1" and env.ray_widened()
    fresh: dict[str, str] = {}
    env.keep_ray_on_loopback(fresh)
    assert fresh == {env.RAY_CLUSTER_VAR: "0"}
    assert [is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost", "::ffff:127.0.0.1")] \
        == [True] * 6
    assert not any(is_loopback(h) for h in ("192.0.2.2", "10.0.0.1", "::", "0.0.0.0", "::ffff:10.0.0.1", "node-7"))


def test_a_rendezvous_store_listens_on_its_host_alone():
    """A TCPStore server torch makes from a host and port listens on every interface; the one of
    a data-parallel step or a weight broadcast (serve_store) only on its host, and joins there."""
    from rlix.tcp_store import join_store, serve_store

    store = serve_store("127.0.0.1", 0, 2, 30.0, wait_for_workers=False)
    client = join_store("127.0.0.1", store.port, 2, 30.0)
    client.set("k", "v")
    assert store.get("k") == b"v"
    mine = [(s.address, s.port) for s in listening_sockets([os.getpid()]) if s.port == store.port]
    assert mine == [("127.0.0.1", store.port)], mine


def test_rlix_up_opens_the_head_log_0600(tmp_path, monkeypatch):
    """The head log names the cluster's address; one left 0644 by an older rlix is narrowed."""
    from rlix.cluster import commands
    from rlix.errors import ConfigError

    monkeypatch.setenv("RLIX_CACHE_DIR", str(tmp_path))
    (tmp_path / "cluster").mkdir()
    old = tmp_path / "cluster" / "head.log"
    old.write_text("rlix head: up at 10.0.0.1:6379\n")
    old.chmod(0o644)

    class ExitedHead:  # the head exits at once: `up` reports it, having opened the log
        returncode = 2

        def __init__(self, cmd, stdout, **kw):  # noqa: ANN001
            stdout.write(b"rlix head: failed\n")

        def poll(self) -> int:
            return 2

    monkeypatch.setattr(commands.subprocess, "Popen", ExitedHead)
    with pytest.raises(ConfigError, match="head exited"):
        commands.up(num_gpus=1, num_cpus=2, gpu_slices=1, quotas=[], default_quota=None, address=None,
                    dwell_s=1.0, aging_s=1.0, out=lambda line: None)
    assert mode(old) == 0o600 and old.read_text().endswith("rlix head: failed\n")


# ----------------------------------------------------------------------------- end to end
def _config(tmp_path: Path) -> Path:
    pipe = {"name": "agent", "model": "tiny", "train_gpus": 1, "min_shards": 1, "max_shards": 1, "steps": 2,
            "seed": 1, "checkpoint_every": 0, "task": {"name": "pattern", "patterns": ["z"]},
            "env": {"name": "repeat", "max_turns": 2, "show_tools": False, "tool_latency_s": 0.0},
            "rollout": {"groups_per_step": 2, "group_size": 4, "max_new_tokens": 8, "concurrency": 4,
                        "max_model_len": 512}}
    cfg = {"cluster": {"nodes": 1, "gpus_per_node": 2},
           "scheduler": {"dwell_s": 0, "aging_s": 5, "dashboard_port": 0},  # 0: a free port
           "control_plane": "rlix", "run_dir": str(tmp_path / "run"), "pipelines": [pipe]}
    path = tmp_path / "secrets.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _end(pid: int) -> None:
    """The run's process group (its id is the run's PID), by that PID: SIGINT, then SIGKILL."""
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.2)


def test_a_run_shows_its_token_on_no_command_line_and_keeps_addresses_private(tmp_path):
    token = "rlix-secret-" + secrets.token_urlsafe(18)
    child_env = {**os.environ, "RLIX_API_KEY": token, "RLIX_CONTROL_PLANE": "rlix"}
    child_env.pop("RAY_ADDRESS", None)
    run_dir = tmp_path / "run"
    out_path = tmp_path / "out.txt"
    with out_path.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rlix.cli", "run", str(_config(tmp_path))],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env, start_new_session=True)
    seen: dict[str, set[int]] = {"shard": set(), "env": set()}
    holding: set[str] = set()  # files seen holding an address (processes.json is {} once the run ends)
    listeners: dict[tuple[int, str, int], Listener] = {}  # every listening socket seen of the run
    checked = 0
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not finish in 300 s"
            below = descendants(proc.pid)
            if checked % 5 == 0:  # about every second: servers come and go as the run goes on
                listeners.update({(s.pid, s.address, s.port): s for s in listening_sockets(below | {proc.pid})})
            for pid in below:
                cmdline = proc_read(pid, "cmdline")
                if cmdline is None:
                    continue
                assert token.encode() not in cmdline, f"pid {pid} shows the token: {shown(cmdline)}"
                words = cmdline.split(b"\0")
                if b"rlix.procguard" in words:  # a guard: its server is checked as its child
                    continue
                if b"rlix.cli" in words and b"serve" in words:
                    if environ(pid).get("RLIX_API_KEY") == token:  # how the token reached it
                        seen["shard"].add(pid)
                elif b"rlix.agents.serve" in words:
                    seen_env = environ(pid)
                    if seen_env:  # the user's code: no token of any kind
                        assert token not in seen_env.values() and not set(env.TOKEN_VARS) & set(seen_env)
                        seen["env"].add(pid)
            assert_no_token_on_any_command_line(token)
            if run_dir.is_dir() and checked % 10 == 0:  # files every ~2 s: reading them costs CPU
                holding |= {p.relative_to(run_dir).as_posix() for p in assert_private_where_needed(run_dir, token)}
            checked += 1
            time.sleep(0.2)
        output = out_path.read_text(errors="replace")
        assert proc.returncode == 0, output[-3000:]
    finally:
        if proc.poll() is None:
            _end(proc.pid)
            proc.wait(10)
    assert checked >= 5, checked
    assert_listening_on_loopback_only(listeners, {
        "Ray's GCS": "gcs_server", "a raylet": "raylet/raylet", "a Ray worker": "ray::",
        "a shard server": "rlix.cli serve", "an environment server": "rlix.agents.serve"})
    assert seen["shard"], "no shard server seen holding the token in its environment"
    assert seen["env"], "no environment server seen"
    holding |= {p.relative_to(run_dir).as_posix() for p in assert_private_where_needed(run_dir, token)}
    assert {"processes.json", "run.log"} <= holding, holding  # shard and env URLs; the dashboard's URL
    assert any(p.startswith("agent/shard-logs/") for p in holding), holding
    assert mode(run_dir / "processes.json") == 0o600
    assert all(mode(p) == 0o600 for p in (run_dir / "agent").rglob("*.log")), \
        {p: oct(mode(p)) for p in (run_dir / "agent").rglob("*.log")}
    assert token not in output  # the console neither
    # the agents reached the policy with the gateway's own token: episodes ran, turns were sampled
    collector = json.loads((run_dir / "summary.json").read_text())["pipelines"]["agent"]["collector"]
    assert collector["episode_turns"] > 0, collector
    # ordinary results are not made private
    assert mode(run_dir / "summary.json") == 0o666 & ~umask()
    assert mode(run_dir / "agent" / "metrics.jsonl") == 0o666 & ~umask()


JOB = "listens"


def _job_config(tmp_path: Path, model: Path) -> str:
    pipe = {"name": JOB, "model": str(model), "min_shards": 1, "max_shards": 1, "steps": 20000, "seed": 1,
            "checkpoint_every": 0, "task": {"name": "pattern", "patterns": ["a"]},
            "rollout": {"groups_per_step": 2, "group_size": 4, "max_new_tokens": 8, "concurrency": 2}}
    path = tmp_path / f"{JOB}.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "runs" / JOB), "pipelines": [pipe]}))
    return str(path)


def _job_drivers(tmp_path: Path) -> set[int]:
    """The drivers of this test's jobs (each in a session of its own), by their command line."""
    out = set()
    for pid in all_pids():
        words = (proc_read(pid, "cmdline") or b"").split(b"\0")
        if b"rlix.cluster.driver" in words and any(str(tmp_path).encode() in w for w in words):
            out.add(pid)
    return out


def _wait_for_job_listeners(session: int, head: int, tmp_path: Path,
                            listeners: dict[tuple[int, str, int], Listener], timeout_s: float = 120.0) -> None:
    """Adds to `listeners` what the cluster's processes (its session, the head's descendants:
    Ray's workers and the servers they start in sessions of their own) and the job's driver
    listen on, until the driver and a shard server of the job both do."""
    deadline = time.monotonic() + timeout_s
    while True:
        drivers = _job_drivers(tmp_path)
        pids = set(session_members(session, os.getpid())) | descendants(head) | drivers
        listeners.update({(s.pid, s.address, s.port): s for s in listening_sockets(pids)})
        shown_pids = {s.pid for s in listeners.values()}
        shard = any("rlix.cli serve" in s.cmdline for s in listeners.values())
        if drivers & shown_pids and shard:
            return
        assert time.monotonic() < deadline, (f"in {timeout_s:g} s: driver(s) {sorted(drivers)}, a shard server "
                                             f"{'seen' if shard else 'not seen'}; listening: "
                                             + "; ".join(str(s) for s in listeners.values()))
        time.sleep(0.5)


@dataclass
class SharedCluster:
    env: dict[str, str]  # the owner's: its HOME (Ray's token) and RLIX_CACHE_DIR
    home: Path
    cluster: Path  # the state file's directory
    state: dict

    def cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlix.cli", *args], capture_output=True, text=True,
                              env=env or self.env, timeout=120)


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    """One `rlix up` (a fresh HOME: Ray makes its token there) for the tests below; `rlix down`
    after them, and whatever is left in its session ended by PID."""
    from rlix.cluster.reaper import session_members

    tmp_path = tmp_path_factory.mktemp("shared")
    home = tmp_path / "home"
    home.mkdir()
    cli_env = {**os.environ, "RLIX_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(home)}
    for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RLIX_USER"):
        cli_env.pop(var, None)
    up = subprocess.run([sys.executable, "-m", "rlix.cli", "up", "--num-gpus", "1", "--num-cpus", "2"],
                        capture_output=True, text=True, env=cli_env, timeout=180)
    assert up.returncode == 0, up.stderr[-2000:]
    cluster = tmp_path / "cache" / "cluster"
    state = json.loads((cluster / "state.json").read_text())
    session = int(state["session"])
    try:
        yield SharedCluster(cli_env, home, cluster, state)
    finally:
        down = subprocess.run([sys.executable, "-m", "rlix.cli", "down"], capture_output=True, text=True,
                              env=cli_env, timeout=300)
        for pid in [*session_members(session, os.getpid()), *_job_drivers(tmp_path)]:
            try:  # only what is still in its session, and the job's driver
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert down.returncode == 0, down.stderr[-2000:]
    assert not Path(state["submit_socket"]).parent.exists()  # the head removed its socket


def test_rlix_up_writes_its_state_and_log_0600_and_admits_only_holders_of_its_token(shared_cluster, tmp_path,
                                                                                      tiny_model_dir):
    """Ray writes the cluster's token (~/.ray/auth_token) mode 0644; the head narrows it to
    0600. A client with no token (another HOME: another user, who could not read the owner's
    token) is refused in one line, at once. The job submission socket is reachable by every
    account (the token and the peer's uid gate it: rlix.cluster.intake), in a directory of its own.
    Nothing of the cluster listens beyond this machine: its head and Ray, a job's driver, the
    job's shard server."""
    from rlix.cluster.reaper import session_members

    cluster, state = shared_cluster.cluster, shared_cluster.state
    session = int(state["session"])
    assert mode(cluster / "state.json") == mode(cluster / "head.log") == 0o600
    assert state["address"].split(":")[0] in (cluster / "head.log").read_text()
    listeners = {(s.pid, s.address, s.port): s for s in listening_sockets(session_members(session, os.getpid()))}
    assert_listening_on_loopback_only(listeners, {
        "Ray's GCS": "gcs_server", "a raylet": "raylet/raylet", "the head": "rlix.cluster.head",
        "a Ray worker": "ray::"})
    assert state["address"].startswith("127.0.0.1:"), state["address"]
    # a job: its driver joins the cluster, its pipeline's servers start under the head's Ray; its
    # shards' token (given as RLIX_API_KEY here, to look for it) and Ray's are on no command line
    shard_token = "rlix-secret-" + secrets.token_urlsafe(18)
    submitted = shared_cluster.cli("submit", _job_config(tmp_path, tiny_model_dir),
                                   env={**shared_cluster.env, "RLIX_API_KEY": shard_token})
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    _wait_for_job_listeners(session, int(state["pid"]), tmp_path, listeners)
    assert_listening_on_loopback_only(listeners, {
        "the job's driver": f"rlix.cluster.driver --job {JOB}", "a shard server": "rlix.cli serve"})
    shards = [s.pid for s in listeners.values() if "rlix.cli serve" in s.cmdline]
    assert any(environ(pid).get("RLIX_API_KEY") == shard_token for pid in shards), "the job's shards got another token"
    ray_token = (shared_cluster.home / ".ray" / "auth_token").read_text().strip()
    for token in (shard_token, ray_token):
        assert_no_token_on_any_command_line(token)
    job_files = assert_private_where_needed(tmp_path / "runs" / JOB, shard_token)
    assert "driver.log" in {p.name for p in job_files}, job_files  # it holds the cluster's address: 0600
    token = shared_cluster.home / ".ray" / "auth_token"
    assert state["token_auth"] is True and mode(token) == 0o600, (state, oct(mode(token)))
    assert "made 0600" in (cluster / "head.log").read_text()
    sock = Path(state["submit_socket"])
    assert mode(sock.parent) == 0o711 and sock.parent.stat().st_uid == os.getuid() and mode(sock) == 0o666
    assert f"rlix head: takes jobs at {sock} " in (cluster / "head.log").read_text()
    owner = shared_cluster.cli("jobs")
    assert owner.returncode == 0 and owner.stdout.startswith("job"), owner.stderr[-2000:]
    stranger_home = cluster.parent.parent / "stranger"
    stranger_home.mkdir()
    t0 = time.monotonic()
    stranger = shared_cluster.cli("jobs", env={**shared_cluster.env, "HOME": str(stranger_home)})
    err = stranger.stderr.strip().splitlines()
    assert stranger.returncode == 2 and len(err) == 1, stranger.stderr[-2000:]
    assert f"no Ray token at {stranger_home / '.ray' / 'auth_token'}" in err[0], err
    assert time.monotonic() - t0 < 30


#: run as another account: submit a job asking for the owner's name, first with a wrong token
AS_ANOTHER_ACCOUNT = """
import json, sys
from rlix import env
from rlix.cluster.intake import submit_job
from rlix.cluster.jobs import Job, PipelineNeeds
from rlix.errors import ConfigError

sock, asked = sys.argv[1], sys.argv[2]
job = Job(name="intruder", user=asked, pipelines=[PipelineNeeds("intruder", 1, 1, 1, 1)],
          config="/nowhere/intruder.yaml", run_dir="/nowhere/intruder")
out = {}
try:
    submit_job(sock, job, token="not-the-token")
except ConfigError as exc:
    out["wrong_token"] = str(exc)
out.update(submit_job(sock, job, token=env.ray_token()))  # its own copy of the token (its HOME)
print(json.dumps(out))
"""

#: run as the owner: call the job registry through Ray, as any token holder can, naming a user
DIRECT = """
import json
from rlix import env
env.join_ray_with_token()
env.keep_ray_on_loopback()  # as every rlix command: the cluster's Ray is on 127.0.0.1
from rlix.cluster.commands import connect
from rlix.cluster.jobs import Job, PipelineNeeds
from rlix.cluster.registry import ask, get_registry
from rlix.errors import ConfigError

connect()
registry, out = get_registry(), {}
for how, args in (("no key", ()), ("a guessed key", (b"0" * 32,))):
    job = Job(name="forged", user="someone", pipelines=[PipelineNeeds("forged", 1, 1, 1, 1)])
    try:
        ask(registry.submit.remote(job, *args), timeout=60)
        out[how] = "taken"
    except ConfigError as exc:
        out[how] = str(exc)
print(json.dumps(out))
"""


def interpreter_for(uid: int, gid: int) -> tuple[str, str] | None:
    """A Python that account `uid` can run and import rlix's submission client with, and the
    PYTHONPATH that does it: this one, else the system's python3 with this environment's
    site-packages (an interpreter under /root, as here, is out of another account's reach)."""
    import pydantic

    import rlix

    src = str(Path(rlix.__file__).resolve().parents[1])
    site = str(Path(pydantic.__file__).resolve().parents[1])
    system = shutil.which("python3", path=os.pathsep.join(("/usr/local/bin", "/usr/bin", "/bin")))
    for exe in dict.fromkeys(p for p in (sys.executable, system) if p):
        for path in (src, f"{src}{os.pathsep}{site}"):
            try:
                probe = subprocess.run([exe, "-c", "import rlix.cluster.intake"], user=uid, group=gid,
                                       extra_groups=[], env={"PYTHONPATH": path, "HOME": "/"}, cwd="/",
                                       capture_output=True, timeout=60)
            except OSError:  # it cannot even start it
                break
            if probe.returncode == 0:
                return exe, path
    return None


def test_a_job_submitted_by_another_account_counts_against_that_account(shared_cluster):
    """Issue 38: a client holding the token, run as another uid (nobody) and asking for the
    cluster owner's name, gets a job that counts against nobody: the head reads the uid from
    the socket (SO_PEERCRED), not from the request, and `rlix jobs` shows it. The same account
    with a wrong token is refused; the owner calling the registry through Ray without the head's
    key cannot put a name on a job either."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a client as another account")
    try:
        other = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no account 'nobody' to run a client as")
    found = interpreter_for(other.pw_uid, other.pw_gid)
    if found is None:
        pytest.skip("no Python that 'nobody' can run imports rlix.cluster.intake here")
    python, pythonpath = found
    owner_name = pwd.getpwuid(os.getuid()).pw_name
    sock = shared_cluster.state["submit_socket"]
    home = Path(tempfile.mkdtemp(prefix="rlix-nobody-", dir="/tmp"))  # tmp_path's parents are 0700
    try:
        (home / ".ray").mkdir()
        shutil.copyfile(shared_cluster.home / ".ray" / "auth_token", home / ".ray" / "auth_token")
        for path in (home, home / ".ray", home / ".ray" / "auth_token"):
            os.chown(path, other.pw_uid, other.pw_gid)
        os.chmod(home / ".ray" / "auth_token", 0o600)
        child = subprocess.run([python, "-c", AS_ANOTHER_ACCOUNT, sock, owner_name], user=other.pw_uid,
                               group=other.pw_gid, extra_groups=[], cwd=home, capture_output=True, text=True,
                               env={"HOME": str(home), "PYTHONPATH": pythonpath}, timeout=120)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert child.returncode == 0, child.stderr[-2000:]
    out = json.loads(child.stdout)
    assert out["wrong_token"].startswith("the cluster's head refused the job: it does not prove the cluster's Ray "
                                         "token"), out
    assert out["user"] == out["account"] == "nobody" and out["row"]["user"] == "nobody", out
    assert out["note"] == (f"job intruder counts against 'nobody', the account that submitted it, not "
                           f"{owner_name!r}: only the cluster's owner may name another user"), out

    direct = subprocess.run([sys.executable, "-c", DIRECT], capture_output=True, text=True,
                            env=shared_cluster.env, timeout=120)
    assert direct.returncode == 0, direct.stderr[-2000:]
    refusal = ("the job registry takes jobs from the cluster's head only: submit with `rlix submit`, which "
               "names the job's user by the account that submits it")
    assert json.loads(direct.stdout) == {"no key": refusal, "a guessed key": refusal}

    listed = shared_cluster.cli("jobs", "--json")
    assert listed.returncode == 0, listed.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert "intruder" in rows and "forged" not in rows, rows  # nothing forged (the other job: the test above's)
    assert (rows["intruder"]["user"], rows["intruder"]["account"]) == ("nobody", "nobody"), rows
    log = (shared_cluster.cluster / "head.log").read_text()
    submitted = rf"rlix head: job intruder submitted by nobody \(uid {other.pw_uid}, pid \d+\)\n"
    assert re.search(submitted, log), log[-2000:]
    assert re.search(rf"a submission from uid {other.pw_uid} \(pid \d+\) was not taken: the cluster's head "
                     r"refused the job: it does not prove", log), log[-2000:]
    token = (shared_cluster.home / ".ray" / "auth_token").read_text().strip()
    assert token not in log
    # its driver never started: a cancel ends it at once (`rlix down` does not wait for it)
    cancel = shared_cluster.cli("cancel", "intruder")
    assert cancel.returncode == 0, cancel.stderr[-2000:]
    # queued behind the up test's job (it holds the one GPU) or admitted: either way ended now
    assert re.search(r"job intruder: cancelled \(cancelled (while queued|before its driver started)\)",
                     cancel.stdout), cancel.stdout


@pytest.mark.vllm
def test_a_vllm_shard_takes_its_token_from_vllm_api_key(tiny_model_dir, tmp_path):
    """vLLM's server given the token only in VLLM_API_KEY: not on its command line, and /v1
    refuses a request without it."""
    import httpx

    need_vllm()
    token = "tok-" + secrets.token_urlsafe(18)
    backend = make_backend(EngineBackendConfig(backend="vllm", model=str(tiny_model_dir), served_model_name="tiny",
                                               max_model_len=512, max_num_seqs=4, dtype="bfloat16",
                                               startup_timeout_s=600))
    proc = ShardProcess(backend, token, log_dir=tmp_path)
    try:
        proc.start()
        proc.wait_ready()  # its first call (/update_weight_version) already carries the token
        for pid in {proc.pid} | descendants(proc.pid):
            assert token.encode() not in (proc_read(pid, "cmdline") or b""), shown(proc_read(pid, "cmdline") or b"")
        assert environ(proc.server_pid()).get("VLLM_API_KEY") == token
        assert httpx.get(proc.url + "/v1/models", timeout=30).status_code == 401
        ok = httpx.get(proc.url + "/v1/models", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert ok.status_code == 200, ok.text
        assert mode(proc.log_path) == 0o600 and token not in proc.log_path.read_text(errors="replace")
    finally:
        proc.stop()
    assert not proc.alive()
