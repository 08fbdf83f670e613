"""The head's job submission socket: a job counts against the account that submits it.

Why a socket: the cluster's Ray token admits every holder alike (as the cluster's owner), so a
name a client gives could be anyone's. On a Unix-domain socket the kernel tells the server who
connected (SO_PEERCRED: the peer's pid, uid and gid, recorded at connect() and not forgeable by
the client), so the head names each job's user itself: the peer's account name (`pwd`; "uid:N"
for a uid with no name). The job registry takes jobs from the head alone (its `submit` needs a
key only the head holds), so calling the registry through Ray does not get around this.

Who may name another user: the cluster's owner (the uid the head runs as), whose `--user` /
`RLIX_USER` is honoured as before. Its account runs every Ray process of the cluster and holds
the head's key, so refusing it a name would protect nothing, and a team that shares one account
splits its quotas by name. Any other account's job counts against that account; when it asked
for another name, the answer says so (`rlix submit` prints it). The job keeps both: `user`
(whose quota) and `account` (who submitted it).

Who is admitted: a holder of the cluster's Ray token, proved without sending it. The head sends
a fresh random nonce; the client answers with HMAC-SHA256(token, the head's nonce and its own);
the head checks it (hmac.compare_digest) and proves the token back the same way, so a client
never hands its token, or anything replayable, to whatever listens on a path, and can tell the
real head from an impostor. With no token auth (Ray admits anyone who reaches it) nothing is
proved either way. Neither side ever logs a token or puts one on a command line.

Where it lives, for a machine with many users: in a directory the head creates anew under /tmp
(`mkdtemp`: a random name made atomically, owned by the cluster's owner), mode 0711, holding only
the socket, mode 0666. Every local account can reach the socket by its path (connect() needs
search permission on each directory of the path and write permission on the socket); none can
list the directory, add to it or replace the socket, and /tmp's sticky bit keeps others from
renaming or removing the directory. Reaching the socket is not being admitted: that takes the
token, and what a job counts against is the connecting uid. Not the cluster directory beside
the state file: that is under the owner's home (often 0700 or 0750, and no place to open to
others), and AF_UNIX paths are limited to 107 bytes. Clients find the path in the registry's
`ClusterInfo` (token holders only) and the owner in the state file. The socket is reachable on
the head's machine only: a client on another node is told so.

Bounds: one request per connection; its line at most MAX_REQUEST_BYTES (refused before it is
parsed) within REQUEST_TIMEOUT_S in all, so a slow writer cannot hold the head; at most
MAX_CLIENTS connections at once (more are told the head is busy); the request is typed (pydantic,
strict, no unknown fields) and a malformed one gets a one-line error while the server goes on.

The exchange, one JSON object per line:
    head -> client  {"rlix": "submit/1", "nonce": HEX, "token": bool}
    client -> head  {"op": "submit", "nonce": HEX, "proof": HEX, "user": NAME, "job": {...}}
    head -> client  {"ok": true, "proof": HEX, "row": {...}, "user": ..., "account": ..., "note": ...}
                 or {"ok": false, "error": "one line"}
Linux only (SO_PEERCRED); no Ray here: the head serves it, `rlix submit` is its client.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import pwd
import secrets
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlix.cluster.jobs import Job, PipelineNeeds
from rlix.config.models import MAX_GPUS, MAX_GPUS_PER_NODE, Name, PathStr
from rlix.errors import ConfigError, format_validation_error, one_line

PROTOCOL = "submit/1"
#: where the head makes the socket's directory (see module doc); not TMPDIR, often private to a user
SOCKET_PARENT = Path("/tmp")
SOCKET_DIR_PREFIX = "rlix-submit-"
SOCKET_NAME = "submit.sock"
#: the most pipelines one job may have (a request of that many, every name and path its longest: ~55 KiB)
MAX_JOB_PIPELINES = 256
#: the largest request line the head reads
MAX_REQUEST_BYTES = 128 * 1024
#: how long the head waits for a whole request after a client connects
REQUEST_TIMEOUT_S = 10.0
#: connections the head serves at once; more are told it is busy
MAX_CLIENTS = 8
#: how often the accepting thread looks whether the server was closed
ACCEPT_POLL_S = 0.25
#: how long the head waits for the registry to take a job
SUBMIT_TIMEOUT_S = 60.0
#: how long a client waits for the head's answer (the registry's call included)
CLIENT_TIMEOUT_S = REQUEST_TIMEOUT_S + SUBMIT_TIMEOUT_S + 10.0
#: the largest line a client reads back (a job's row)
MAX_ANSWER_BYTES = 1024 * 1024
_CLIENT, _HEAD = b"rlix submit/1 client\0", b"rlix submit/1 head\0"

#: a job's or user's name: shown in tables and logs, so no control characters
Label = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]
Hex = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PipelineRequest(_Strict):
    """One pipeline's needs (`PipelineNeeds`), as checked by the config it came from."""

    name: Name
    train_gpus: int = Field(ge=1, le=MAX_GPUS)
    tp: int = Field(ge=1, le=MAX_GPUS_PER_NODE)
    min_shards: int = Field(ge=0, le=MAX_GPUS)
    max_shards: int = Field(ge=1, le=MAX_GPUS)
    partial_overlap: bool


class JobRequest(_Strict):
    """What a job is (`Job`); who it counts against is the head's to say."""

    name: Label
    config: PathStr
    run_dir: PathStr
    pipelines: list[PipelineRequest] = Field(min_length=1, max_length=MAX_JOB_PIPELINES)


class SubmitRequest(_Strict):
    op: Literal["submit"]
    nonce: Hex
    proof: str = Field(max_length=64)
    user: Label  # the name the client asks for (honoured for the cluster's owner only)
    job: JobRequest


class Refused(Exception):
    """A request the head does not take; its message is the client's one-line answer."""


# ---------------------------------------------------------------------- identity
def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the kernel
    recorded them when it connected."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("iII", raw)  # struct ucred: pid_t, uid_t (unsigned), gid_t
    return pid, uid, gid


def user_name(uid: int) -> str:
    """The account name of `uid`; "uid:N" for a uid the password database does not know."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid:{uid}"


def _proof(token: str, label: bytes, head_nonce: bytes, client_nonce: bytes) -> str:
    return hmac.new(token.encode(), label + head_nonce + client_nonce, hashlib.sha256).hexdigest()


# ---------------------------------------------------------------------- wire
def _send(conn: socket.socket, obj: dict) -> None:
    conn.sendall(json.dumps(obj).encode() + b"\n")


def _read_line(conn: socket.socket, limit: int, deadline: float, what: str) -> bytes:
    """One newline-ended line of at most `limit` bytes, whole before `deadline` (monotonic)."""
    buf = b""
    while b"\n" not in buf:
        if len(buf) > limit:
            raise Refused(f"the {what} is over {limit} bytes")
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout
        conn.settimeout(left)
        chunk = conn.recv(min(65536, limit + 1 - len(buf)) or 1)
        if not chunk:
            raise Refused(f"the connection closed before a whole {what}")
        buf += chunk
    line = buf.split(b"\n", 1)[0]
    if len(line) > limit:
        raise Refused(f"the {what} is over {limit} bytes")
    return line


def _one_line(text: str, limit: int = 500) -> str:
    return " ".join(str(text).split())[:limit]


# ---------------------------------------------------------------------- the head's side
class SubmitServer:
    """The head's socket (see module doc). Made and listening at construction, so its path can
    go into the cluster's info before the registry exists; `serve` starts taking jobs, handing
    each (its user named) to `submit`, whose ConfigError is the client's answer."""

    def __init__(self, token: str | None, *, owner_uid: int | None = None, parent: Path = SOCKET_PARENT,
                 timeout_s: float = REQUEST_TIMEOUT_S, max_bytes: int = MAX_REQUEST_BYTES,
                 max_clients: int = MAX_CLIENTS, say: Callable[[str], None] = lambda line: None) -> None:
        if not hasattr(socket, "SO_PEERCRED"):
            raise ConfigError("the cluster's head needs Linux (SO_PEERCRED) to know who submits a job")
        self.token = token
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid
        self.timeout_s, self.max_bytes, self.say = timeout_s, max_bytes, say
        self._slots, self._max_clients = threading.BoundedSemaphore(max_clients), max_clients
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.directory = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir=parent))
        self.path = self.directory / SOCKET_NAME
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(str(self.path))
            os.chmod(self.path, 0o666)  # connect() needs write permission: the token gates it
            os.chmod(self.directory, 0o711)  # reachable by path, not listable, not writable
            self._sock.listen(64)
            self._sock.settimeout(ACCEPT_POLL_S)  # accept() wakes to see `close`
        except BaseException:
            self.close()
            raise

    def serve(self, submit: Callable[[Job], dict]) -> None:
        self._thread = threading.Thread(target=self._accept, args=(submit,), name="rlix-intake", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop taking connections, let those being answered finish (within the request timeout
        and the registry's call: a job taken as the head goes down is in the registry before
        the head cancels the live ones), and remove the socket and its directory. Again: nothing."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 + ACCEPT_POLL_S)
            deadline = time.monotonic() + self.timeout_s + SUBMIT_TIMEOUT_S
            for _ in range(self._max_clients):  # every slot back: no answer in flight
                if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    break
        self._sock.close()
        remove_socket(self.path)

    def _accept(self, submit: Callable[[Job], dict]) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)  # out of descriptors, say: try again rather than stop serving
                continue
            if not self._slots.acquire(blocking=False):
                with conn:  # one short line into a fresh socket's empty buffer: it does not block
                    try:
                        conn.settimeout(0.5)
                        _send(conn, {"ok": False, "error": "the cluster's head is busy with other "
                                                           "submissions; try again"})
                    except OSError:
                        pass
                continue
            try:
                threading.Thread(target=self._serve_one, args=(conn, submit), daemon=True).start()
            except RuntimeError:  # no thread to be had: this one is not served
                conn.close()
                self._slots.release()

    def _serve_one(self, conn: socket.socket, submit: Callable[[Job], dict]) -> None:
        try:
            with conn:
                self._answer(conn, submit)
        finally:
            self._slots.release()

    def _answer(self, conn: socket.socket, submit: Callable[[Job], dict]) -> None:
        pid = uid = -1
        try:
            pid, uid, _gid = peer_credentials(conn)
            deadline = time.monotonic() + self.timeout_s
            nonce = secrets.token_bytes(32)
            conn.settimeout(self.timeout_s)
            _send(conn, {"rlix": PROTOCOL, "nonce": nonce.hex(), "token": self.token is not None})
            try:
                line = _read_line(conn, self.max_bytes, deadline, "request")
            except socket.timeout:
                raise Refused(f"no whole request within {self.timeout_s:g} s") from None
            request, client_nonce = self._parse(line, nonce)
            account = user_name(uid)
            owner = uid == self.owner_uid
            user = request.user if owner else account
            j = request.job
            job = Job(name=j.name, user=user, account=account, config=j.config, run_dir=j.run_dir,
                      pipelines=[PipelineNeeds(p.name, p.train_gpus, p.tp, p.min_shards, p.max_shards,
                                               p.partial_overlap) for p in j.pipelines])
            row = submit(job)
            note = None
            if request.user != user:
                note = (f"job {job.name} counts against {account!r}, the account that submitted it, not "
                        f"{request.user!r}: only the cluster's owner may name another user")
            self.say(f"job {job.name} submitted by {account} (uid {uid}, pid {pid})"
                     + (f" for user {user!r}" if user != account else ""))
            proof = _proof(self.token, _HEAD, nonce, client_nonce) if self.token is not None else ""
            _send(conn, {"ok": True, "proof": proof, "row": row, "user": user, "account": account,
                         "note": note})
        except (Refused, ConfigError) as exc:
            self._refuse(conn, str(exc), uid, pid)
        except OSError as exc:  # the client went away: nothing to answer
            self.say(f"a submission from uid {uid} (pid {pid}) broke off: {one_line(exc)}")
        except Exception as exc:  # noqa: BLE001 - answered, logged, and the server goes on
            self._refuse(conn, f"the cluster's head could not take the job: {one_line(exc)}", uid, pid)

    def _parse(self, line: bytes, nonce: bytes) -> tuple[SubmitRequest, bytes]:
        """The request, its proof checked before its fields (a stranger learns nothing more)."""
        try:
            raw = json.loads(line)
        except ValueError:
            raise Refused("the request is not JSON") from None
        if not isinstance(raw, dict):
            raise Refused("the request is not a JSON object")
        client_nonce, proof = raw.get("nonce"), raw.get("proof")
        if not isinstance(client_nonce, str) or len(client_nonce) != 64:
            raise Refused("the request has no nonce (64 hex digits)")
        try:
            client_bytes = bytes.fromhex(client_nonce)
        except ValueError:
            raise Refused("the request's nonce is not hex") from None
        if self.token is not None:
            expected = _proof(self.token, _CLIENT, nonce, client_bytes)
            if not isinstance(proof, str) or not hmac.compare_digest(proof.encode(), expected.encode()):
                raise Refused("the cluster's head refused the job: it does not prove the cluster's Ray token "
                              "(the cluster admits only holders of its token; ask its owner for it)")
        try:
            return SubmitRequest.model_validate(raw), client_bytes
        except ValidationError as exc:
            raise Refused(format_validation_error("the request", exc)) from None

    def _refuse(self, conn: socket.socket, why: str, uid: int, pid: int) -> None:
        why = _one_line(why)
        self.say(f"a submission from uid {uid} (pid {pid}) was not taken: {why}")
        try:
            conn.settimeout(1.0)
            _send(conn, {"ok": False, "error": why})
        except OSError:
            pass


def remove_socket(path: str | Path) -> None:
    """Remove a submission socket and the directory the head made for it (only one that is this
    account's and named so: nothing else is touched)."""
    path = Path(path)
    directory = path.parent
    try:
        st = os.lstat(directory)
    except OSError:
        return
    if (not directory.name.startswith(SOCKET_DIR_PREFIX) or st.st_uid != os.getuid()
            or not stat.S_ISDIR(st.st_mode)):
        return
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            path.unlink()
    except OSError:
        pass
    try:
        directory.rmdir()
    except OSError:
        pass


# ---------------------------------------------------------------------- the client's side
def submit_job(path: str | Path, job: Job, *, token: str | None,
               timeout_s: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
    """Hand `job` to the head listening at `path` (job.user: the name asked for). Returns the
    head's answer: "row" (the job as `rlix jobs` shows it), "user" (whom it counts against),
    "account" (who submitted it), "note" (a line to show, or None). Every refusal is a one-line
    ConfigError."""
    path = str(path)
    if not path:
        raise ConfigError("this cluster's head takes no jobs by socket (started by an older rlix?); "
                          "restart it with `rlix down` and `rlix up`")
    deadline = time.monotonic() + timeout_s
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout_s)
        try:
            conn.connect(path)
        except OSError as exc:
            raise ConfigError(_unreachable(path, exc)) from None
        try:
            hello = json.loads(_read_line(conn, 4096, deadline, "greeting"))
        except socket.timeout:
            raise ConfigError(f"the cluster's head did not greet within {timeout_s:g} s ({path})") from None
        except (ValueError, Refused, OSError):
            raise ConfigError(f"{path} does not speak rlix's {PROTOCOL}: not this cluster's head") from None
        if isinstance(hello, dict) and hello.get("ok") is False:  # busy
            raise ConfigError(_one_line(hello.get("error") or "the cluster's head refused the connection"))
        try:
            if not isinstance(hello, dict) or hello.get("rlix") != PROTOCOL:
                raise ValueError
            head_nonce = bytes.fromhex(hello["nonce"])
            needs_token = bool(hello.get("token"))
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"{path} does not speak rlix's {PROTOCOL}: not this cluster's head") from None
        if needs_token and token is None:
            raise ConfigError("no Ray token here: the cluster admits only holders of its token (its owner's, "
                              "mode 0600)")
        client_nonce = secrets.token_bytes(32)
        proof = _proof(token, _CLIENT, head_nonce, client_nonce) if needs_token and token else ""
        request = {"op": "submit", "nonce": client_nonce.hex(), "proof": proof, "user": job.user,
                   "job": {"name": job.name, "config": job.config, "run_dir": job.run_dir,
                           "pipelines": [{"name": p.name, "train_gpus": p.train_gpus, "tp": p.tp,
                                          "min_shards": p.min_shards, "max_shards": p.max_shards,
                                          "partial_overlap": p.partial_overlap} for p in job.pipelines]}}
        try:
            _send(conn, request)
        except OSError:
            pass  # refused before it read all of it: its answer says why
        try:
            answer = json.loads(_read_line(conn, MAX_ANSWER_BYTES, deadline, "answer"))
        except socket.timeout:
            raise ConfigError(f"the cluster's head did not answer within {timeout_s:g} s") from None
        except (ValueError, Refused, OSError) as exc:
            raise ConfigError(f"no answer from the cluster's head at {path}: {one_line(exc)}") from None
        if not isinstance(answer, dict):
            raise ConfigError(f"{path} gave no rlix answer: not this cluster's head")
        if not answer.get("ok"):
            raise ConfigError(_one_line(answer.get("error") or "the cluster's head refused the job"))
        if needs_token:
            expected = _proof(token, _HEAD, head_nonce, client_nonce)  # type: ignore[arg-type]
            if not hmac.compare_digest(str(answer.get("proof", "")).encode(), expected.encode()):
                raise ConfigError(f"{path} did not prove it holds the cluster's Ray token: not this cluster's "
                                  "head (its answer is ignored)")
        if not isinstance(answer.get("row"), dict):
            raise ConfigError(f"{path} gave no job row: not this cluster's head")
        return {k: answer.get(k) for k in ("row", "user", "account", "note")}
    finally:
        conn.close()


def _unreachable(path: str, exc: OSError) -> str:
    why = {errno.ENOENT: "no such socket on this machine (jobs are submitted on the cluster head's machine)",
           errno.ECONNREFUSED: "nothing listens there (is the cluster's head up?)",
           errno.EACCES: "permission denied"}.get(exc.errno or 0, exc.strerror or one_line(exc))
    return f"cannot reach the cluster's submission socket {path}: {why}"
