"""The head's job submission socket without Ray (issue 38): who connects is read from the kernel,
not from the request; the token is proved both ways; a bad request is refused in one line and
the server goes on serving.

A real server in this process on a real Unix socket; the registry is a recording stand-in. The
two-account test through a real head is tests/security/test_secrets.py's.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from rlix.cluster import intake
from rlix.cluster.intake import SubmitServer, peer_credentials, remove_socket, submit_job, user_name
from rlix.cluster.jobs import Job, JobBook, PipelineNeeds
from rlix.errors import ConfigError

pytestmark = pytest.mark.skipif(not hasattr(socket, "SO_PEERCRED"), reason="SO_PEERCRED is Linux's")

TOKEN = "the-cluster-token"
ME = pwd.getpwuid(os.getuid()).pw_name


def a_job(name: str = "j1", user: str = "ann") -> Job:
    return Job(name=name, user=user, pipelines=[PipelineNeeds(f"{name}-p", 1, 1, 1, 2, True)],
               config="/cfg/j1.yaml", run_dir="/runs/j1")


class Registry:
    """The registry's `submit` without Ray: a JobBook of a large cluster, what reached it kept."""

    def __init__(self) -> None:
        self.book = JobBook(1 << 30)  # room for the largest job

    @property
    def jobs(self) -> list[Job]:
        return list(self.book.jobs.values())

    def __call__(self, job: Job) -> dict:
        return self.book.row(self.book.submit(job).name)


@pytest.fixture()
def served():
    """A server of TOKEN whose owner is another uid (so this process is an ordinary account)."""
    lines: list[str] = []
    registry = Registry()
    server = SubmitServer(TOKEN, owner_uid=os.getuid() + 1, timeout_s=1.0, say=lines.append)
    server.serve(registry)
    yield server, registry, lines
    server.close()


def raw_exchange(path: Path, payload: bytes, *, read_hello: bool = True) -> tuple[dict, dict]:
    """Connect, send `payload` as it is, return (greeting, answer)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        hello = json.loads(conn.makefile("rb").readline()) if read_hello else {}
        try:
            conn.sendall(payload)
        except OSError:  # refused before it read it all: the answer is there
            pass
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    return hello, json.loads(data)


def test_the_peer_is_read_from_the_kernel_and_named_by_the_password_database():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_credentials(a) == (os.getpid(), os.getuid(), os.getgid())
    assert user_name(os.getuid()) == ME
    unknown = next(uid for uid in range(2**31 - 2, 2**31 - 200, -1) if not _known(uid))
    assert user_name(unknown) == f"uid:{unknown}"


def _known(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_the_socket_is_reachable_by_every_account_and_nothing_else_is_open(served):
    server, _, _ = served
    directory = server.path.parent
    assert directory.parent == Path("/tmp") and directory.name.startswith("rlix-submit-")
    assert len(str(server.path).encode()) < 108  # AF_UNIX's limit
    d, s = os.stat(directory), os.stat(server.path)
    assert stat.S_IMODE(d.st_mode) == 0o711 and d.st_uid == os.getuid()  # traverse only
    assert stat.S_ISSOCK(s.st_mode) and stat.S_IMODE(s.st_mode) == 0o666
    assert os.listdir(directory) == ["submit.sock"]


def test_a_job_counts_against_the_account_that_connects_whatever_name_it_asks_for(served):
    server, registry, lines = served
    answer = submit_job(server.path, a_job(user="someone-else"), token=TOKEN)
    (job,) = registry.jobs
    assert job.user == job.account == ME and answer["user"] == answer["account"] == ME
    assert answer["row"]["user"] == ME and answer["row"]["name"] == "j1"
    assert answer["note"] == (f"job j1 counts against {ME!r}, the account that submitted it, not "
                              f"'someone-else': only the cluster's owner may name another user")
    assert job.pipelines == a_job().pipelines and (job.config, job.run_dir) == ("/cfg/j1.yaml", "/runs/j1")
    assert lines == [f"job j1 submitted by {ME} (uid {os.getuid()}, pid {os.getpid()})"]
    # asking for its own name: nothing to say
    assert submit_job(server.path, a_job("j2", user=ME), token=TOKEN)["note"] is None


def test_the_clusters_owner_may_name_the_user_a_job_counts_against():
    registry, lines = Registry(), []
    server = SubmitServer(TOKEN, say=lines.append)  # owned by this uid
    try:
        server.serve(registry)
        answer = submit_job(server.path, a_job(user="carol"), token=TOKEN)
    finally:
        server.close()
    (job,) = registry.jobs
    assert (job.user, job.account) == ("carol", ME) and answer["note"] is None
    assert lines == [f"job j1 submitted by {ME} (uid {os.getuid()}, pid {os.getpid()}) for user 'carol'"]


def test_a_wrong_or_missing_token_is_refused_in_one_line_and_nothing_is_submitted(served):
    server, registry, lines = served
    for token in ("not-the-token", ""):
        with pytest.raises(ConfigError) as err:
            submit_job(server.path, a_job(), token=token)
        assert str(err.value) == ("the cluster's head refused the job: it does not prove the cluster's Ray "
                                  "token (the cluster admits only holders of its token; ask its owner for it)")
    with pytest.raises(ConfigError, match="no Ray token here: the cluster admits only holders"):
        submit_job(server.path, a_job(), token=None)  # refused here: nothing to prove
    assert registry.jobs == []
    # the head's log: each refusal, with who (the client with no token may be logged leaving too)
    assert len([line for line in lines if "does not prove the cluster's Ray token" in line]) == 2, lines
    assert all(line.startswith(f"a submission from uid {os.getuid()} (pid {os.getpid()}) was not taken: ")
               for line in lines), lines
    assert TOKEN not in "".join(lines)


def test_bad_requests_are_refused_with_a_clear_line_and_the_server_goes_on(served):
    server, registry, lines = served
    # over the size cap, with no newline: refused before any parsing
    _, answer = raw_exchange(server.path, b"x" * (intake.MAX_REQUEST_BYTES + 10))
    assert answer == {"ok": False, "error": f"the request is over {intake.MAX_REQUEST_BYTES} bytes"}
    _, answer = raw_exchange(server.path, b"{not json\n")
    assert answer == {"ok": False, "error": "the request is not JSON"}
    _, answer = raw_exchange(server.path, b"[1, 2]\n")
    assert answer == {"ok": False, "error": "the request is not a JSON object"}
    # a well-proved request with bad fields: each named
    hello, answer = _proved(server.path, lambda req: req["job"]["pipelines"][0].update(tp=0, shards=3))
    assert answer["ok"] is False and answer["error"].startswith("the request: job.pipelines[0].tp: "), answer
    assert "job.pipelines[0].shards: unknown field" in answer["error"] and "\n" not in answer["error"]
    _, answer = _proved(server.path, lambda req: req["job"].update(name="a\nb"))
    assert answer["ok"] is False and "job.name: String should match pattern" in answer["error"]
    # a client that connects and says nothing is let go after the timeout
    t0 = time.monotonic()
    _, answer = raw_exchange(server.path, b"")
    assert answer == {"ok": False, "error": "no whole request within 1 s"}
    assert time.monotonic() - t0 < 5
    assert registry.jobs == []
    # still serving
    assert submit_job(server.path, a_job(), token=TOKEN)["row"]["name"] == "j1"
    assert len(registry.jobs) == 1
    # the registry's own refusal is the client's one-line error
    with pytest.raises(ConfigError, match=r"^job 'j1' is already admitted; cancel it or pick another name$"):
        submit_job(server.path, a_job(), token=TOKEN)


def _proved(path: Path, change) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    """A request with a right proof, changed by `change` before it is sent."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        reader = conn.makefile("rb")
        hello = json.loads(reader.readline())
        nonce = os.urandom(32)
        request = {"op": "submit", "nonce": nonce.hex(),
                   "proof": intake._proof(TOKEN, intake._CLIENT, bytes.fromhex(hello["nonce"]), nonce),
                   "user": "ann", "job": {"name": "j9", "config": "/c.yaml", "run_dir": "/r", "pipelines": [
                       {"name": "p9", "train_gpus": 1, "tp": 1, "min_shards": 1, "max_shards": 1,
                        "partial_overlap": True}]}}
        change(request)
        conn.sendall(json.dumps(request).encode() + b"\n")
        return hello, json.loads(reader.readline())


def test_more_clients_than_it_serves_at_once_are_told_it_is_busy():
    server = SubmitServer(TOKEN, timeout_s=5.0, max_clients=1)
    server.serve(Registry())
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        holder.connect(str(server.path))
        holder.makefile("rb").readline()  # greeted: it holds the one slot, saying nothing
        with pytest.raises(ConfigError, match="^the cluster's head is busy with other submissions; try again$"):
            submit_job(server.path, a_job(), token=TOKEN, timeout_s=10)
    finally:
        holder.close()
        server.close()


def test_a_client_believes_no_socket_that_does_not_prove_the_token(tmp_path):
    """Something else listening on the path (it greets, takes the request, says "ok"): the
    client hands it no token and refuses its answer."""
    path = tmp_path / "s"
    seen: list[bytes] = []
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    impostor.bind(str(path))
    impostor.listen(1)

    def serve() -> None:
        conn, _ = impostor.accept()
        with conn:
            conn.sendall(json.dumps({"rlix": intake.PROTOCOL, "nonce": os.urandom(32).hex(),
                                     "token": True}).encode() + b"\n")
            seen.append(conn.makefile("rb").readline())
            conn.sendall(json.dumps({"ok": True, "proof": "0" * 64, "row": {"name": "j1"}}).encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(ConfigError, match="did not prove it holds the cluster's Ray token: not this "):
            submit_job(path, a_job(), token=TOKEN)
    finally:
        thread.join(10)
        impostor.close()
    assert TOKEN.encode() not in seen[0]


def test_an_unreachable_socket_is_one_line_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"^cannot reach the cluster's submission socket .*/gone\.sock: no such "
                                          r"socket on this machine \(jobs are submitted on the cluster head's"):
        submit_job(tmp_path / "gone.sock", a_job(), token=TOKEN)
    with pytest.raises(ConfigError, match="takes no jobs by socket"):
        submit_job("", a_job(), token=TOKEN)


def test_closing_removes_the_socket_and_its_directory_and_nothing_else(tmp_path):
    server = SubmitServer(None)
    server.serve(Registry())
    directory = server.path.parent
    server.close()
    assert not directory.exists()
    # what is not a directory the head made is left alone
    other = tmp_path / "other"
    other.mkdir()
    (other / "submit.sock").write_text("")
    remove_socket(other / "submit.sock")
    assert (other / "submit.sock").exists()


def test_without_token_auth_nothing_is_proved_and_the_peer_still_names_the_user():
    registry = Registry()
    server = SubmitServer(None, owner_uid=os.getuid() + 1)
    try:
        server.serve(registry)
        answer = submit_job(server.path, a_job(user="root-or-anyone"), token=None)
    finally:
        server.close()
    assert answer["user"] == ME and registry.jobs[0].user == ME


def test_the_largest_job_fits_the_size_cap_and_one_pipeline_more_is_refused_by_name(served):
    server, registry, _ = served
    pipes = [PipelineNeeds(f"{i:03d}" + "p" * 61, 4096, 64, 4096, 4096, False) for i in range(intake.MAX_JOB_PIPELINES)]
    big = Job(name="n" * 128, user="u" * 128, pipelines=pipes, config="/" + "c" * 4095, run_dir="/" + "r" * 4095)
    assert submit_job(server.path, big, token=TOKEN)["row"]["name"] == "n" * 128
    big.name, big.pipelines = "more", [*pipes, PipelineNeeds("one-more", 1, 1, 1, 1)]
    with pytest.raises(ConfigError, match=rf"^the request: job.pipelines: List should have at most "
                                          rf"{intake.MAX_JOB_PIPELINES} items"):
        submit_job(server.path, big, token=TOKEN)
    assert len(registry.jobs) == 1


def test_rlix_submit_prints_the_heads_note_and_starts_the_driver_after_the_head_took_the_job(
        served, tmp_path, monkeypatch):
    """`commands.submit` up to the socket as the CLI runs it (Ray's part stood in for: the
    registry only says where the socket is): the head's line comes first, then the usual one
    with the user the head named; a refusal starts no driver."""
    import yaml

    from rlix.cluster import commands

    server, registry, _ = served
    pipe = {"name": "pa", "model": "tiny", "min_shards": 1, "max_shards": 1, "steps": 2,
            "task": {"name": "pattern", "patterns": ["a"]}}
    config = tmp_path / "ja.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "pipelines": [pipe]}))

    class Info:
        submit_socket = str(server.path)

    class Handle:
        class cluster_info:  # noqa: N801 - as a Ray actor handle's method
            @staticmethod
            def remote() -> Info:
                return Info()

    started: list[list[str]] = []
    monkeypatch.setattr(commands, "connect", lambda address=None: "127.0.0.1:6379")
    monkeypatch.setattr(commands, "get_registry", lambda: Handle)
    monkeypatch.setattr(commands.ray, "get", lambda ref, **kw: ref)
    monkeypatch.setattr(commands.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    monkeypatch.setattr(commands.env, "ray_token", lambda: TOKEN)
    lines: list[str] = []
    row = commands.submit(str(config), user="carol", out=lines.append)
    assert row["user"] == ME and registry.jobs[0].user == ME
    assert lines == [f"job ja counts against {ME!r}, the account that submitted it, not 'carol': only the "
                     f"cluster's owner may name another user",
                     f"submitted job ja (user {ME}; pipelines pa): admitted; log: rlix logs ja"]
    assert len(started) == 1 and started[0][2:5] == ["rlix.cluster.driver", "--job", "ja"]
    monkeypatch.setattr(commands.env, "ray_token", lambda: "not-the-token")
    with pytest.raises(ConfigError, match="does not prove the cluster's Ray token"):
        commands.submit(str(config), name="jb", overwrite=True, out=lines.append)
    assert len(started) == 1 and len(lines) == 2
