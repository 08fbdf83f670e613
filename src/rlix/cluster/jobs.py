"""The jobs of a shared cluster, without Ray: who submitted what, what each may hold, who waits.

A job is one submitted config (one or more pipelines) with its own driver process. Admission
keeps two promises before a job's pipelines reach the scheduler:
- its minimum fits: the GPUs the scheduler promises every admitted pipeline at all times (its
  floor of `min_shards` x `tp`, at least one, plus its trainer's GPUs when its shards may not
  sleep on them) add up to at most the cluster's GPUs; trainers with partial overlap take turns
  on GPUs whose shards sleep meanwhile, so they need no GPUs of their own;
- its user's cap: the most GPUs a user's admitted pipelines could hold at once (max shards x tp,
  plus the trainer's GPUs) stays within the user's quota, so no user can take the cluster.
A job that breaks either waits in a first-come queue, with its position and the reason; the
queue is re-checked whenever a job ends. A job is never admitted past an earlier one of the same
user that is still waiting (its order is kept), but a job that fits may pass one that does not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rlix.errors import ConfigError

#: job states; "queued" waits for admission, the last four are final
STATES = ("queued", "admitted", "running", "done", "failed", "cancelled")
FINAL = frozenset({"done", "failed", "cancelled"})


@dataclass(frozen=True)
class PipelineNeeds:
    """What one pipeline of a job asks of the cluster, in scheduler GPUs (slices)."""

    name: str
    train_gpus: int
    tp: int
    min_shards: int
    max_shards: int
    partial_overlap: bool = True

    @property
    def minimum(self) -> int:
        """GPUs the scheduler promises it at all times (see module doc)."""
        floor = max(1, self.min_shards) * self.tp
        return floor + (0 if self.partial_overlap else self.train_gpus)

    @property
    def most(self) -> int:
        """GPUs it may hold at once at most: every shard awake while its trainer trains."""
        return self.max_shards * self.tp + self.train_gpus


@dataclass
class Job:
    name: str
    user: str  # whose quota it counts against (the submitting account, but for the owner's; see intake)
    pipelines: list[PipelineNeeds]
    config: str = ""
    run_dir: str = ""
    log: str = ""
    state: str = "queued"
    reason: str = ""  # why it waits, or how it ended
    driver_pid: int | None = None
    driver_host: str | None = None  # the machine its driver runs on (its PID means something there)
    submitted_at: float = field(default_factory=time.time)
    started_at: float | None = None
    ended_at: float | None = None
    cancel_requested: bool = False
    #: the local account that submitted it (its socket peer's uid, named: rlix.cluster.intake)
    account: str = ""

    @property
    def minimum(self) -> int:
        return sum(p.minimum for p in self.pipelines)

    @property
    def most(self) -> int:
        return sum(p.most for p in self.pipelines)

    def row(self) -> dict:
        out = asdict(self)
        out["pipelines"] = [p.name for p in self.pipelines]
        out["minimum_gpus"], out["most_gpus"] = self.minimum, self.most
        return out

    def record(self) -> dict:
        """The job as the cluster's book file keeps it (`from_record` reads it back)."""
        return asdict(self)

    @classmethod
    def from_record(cls, d: dict) -> Job:
        return cls(**{**d, "pipelines": [PipelineNeeds(**p) for p in d["pipelines"]]})


# ---------------------------------------------------------------------- the book file
# The head writes every job to a file beside its state file at every change (mode 0600: it names
# config paths and users). When the head dies without going down cleanly, its reaper marks the
# jobs that were still live as failed, with how the head ended; the next `rlix up` reads them
# back, so `rlix jobs` says how each ended instead of forgetting them. A clean `rlix down`
# removes the file.
def jobs_file(state: Path) -> Path:
    """The book file, beside the cluster's state file."""
    return Path(state).with_name("jobs.json")


def read_book_file(path: Path) -> list[dict]:
    """The job records in `path`; [] when there is none (or it cannot be read as one)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    return data.get("jobs", []) if isinstance(data, dict) else []


def book_file_text(records: list[dict]) -> str:
    return json.dumps({"jobs": records}, indent=1)


def end_unfinished(records: list[dict], reason: str, now: float | None = None) -> int:
    """Every record not in a final state becomes `failed` with `reason` ("... while the job was
    running" is appended with its state); returns how many."""
    n = 0
    for rec in records:
        if rec.get("state") not in FINAL:
            rec["reason"] = f"{reason} while the job was {rec.get('state', 'live')}"
            rec["state"], rec["ended_at"], n = "failed", now or time.time(), n + 1
    return n


@dataclass(frozen=True)
class Quotas:
    """GPU caps per user (scheduler GPUs); `default` for users not named; None: no cap."""

    users: dict[str, int] = field(default_factory=dict)
    default: int | None = None

    def cap(self, user: str) -> int | None:
        return self.users.get(user, self.default)


def parse_quotas(items: list[str], default: int | None = None) -> Quotas:
    """`USER=GPUS` items (the `--quota` options of `rlix up`)."""
    users: dict[str, int] = {}
    for item in items:
        user, sep, value = item.partition("=")
        if not sep or not user or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--quota {item!r}: give USER=GPUS with GPUS >= 1")
        users[user] = int(value)
    if default is not None and default < 1:
        raise ConfigError(f"--default-quota {default}: give a number of GPUs >= 1")
    return Quotas(users, default)


class JobBook:
    """Every job of the cluster, the admission queue and the quotas (see module doc)."""

    def __init__(self, total_gpus: int, quotas: Quotas | None = None) -> None:
        if total_gpus < 1:
            raise ConfigError(f"a cluster needs at least one GPU, got {total_gpus}")
        self.total_gpus = total_gpus
        self.quotas = quotas or Quotas()
        self.jobs: dict[str, Job] = {}

    # ------------------------------------------------------------------ changes
    def restore_ended(self, jobs: Iterable[Job]) -> None:
        """Jobs of the cluster's earlier life, all ended: listed by `rlix jobs`, never admitted
        (a name in use here is kept as it is)."""
        for job in jobs:
            if job.state not in FINAL:
                raise ValueError(f"job {job.name!r} is {job.state}: only ended jobs are restored")
            self.jobs.setdefault(job.name, job)

    def submit(self, job: Job) -> Job:
        """Add a job (queued); refused when its name or a pipeline name is taken by a live job,
        or when it could never be admitted (more than the cluster, or than its user's cap)."""
        old = self.jobs.get(job.name)
        if old is not None and old.state not in FINAL:
            raise ConfigError(f"job {job.name!r} is already {old.state}; cancel it or pick another name")
        taken = {p.name: j.name for j in self.live() for p in j.pipelines}
        clash = sorted(p.name for p in job.pipelines if p.name in taken)
        if clash:
            raise ConfigError(f"pipeline name(s) {clash} are in use by job(s) "
                              f"{sorted({taken[n] for n in clash})}; pipeline names are unique on a cluster")
        if job.minimum > self.total_gpus:
            raise ConfigError(f"job {job.name!r} needs at least {job.minimum} GPUs; the cluster has {self.total_gpus}")
        cap = self.quotas.cap(job.user)
        if cap is not None and job.most > cap:
            raise ConfigError(f"job {job.name!r} may hold up to {job.most} GPUs; user {job.user!r} is "
                              f"capped at {cap} (lower max_shards, or ask for a larger quota)")
        job.state, job.reason = "queued", ""
        self.jobs[job.name] = job
        self.admit()
        return job

    def admit(self) -> list[str]:
        """Admit every queued job that fits now, in submission order; returns their names and
        sets each waiting job's reason."""
        admitted: list[str] = []
        held_back_users: set[str] = set()
        for job in self.queue():
            why = self._why_not(job)
            if why is None and job.user not in held_back_users:
                job.state, job.reason = "admitted", ""
                admitted.append(job.name)
            else:
                job.reason = why or f"an earlier job of user {job.user!r} waits"
                held_back_users.add(job.user)
        return admitted

    def set_state(self, name: str, state: str, reason: str = "") -> Job:
        if state not in STATES:
            raise ValueError(f"unknown job state {state!r}")
        job = self.get(name)
        job.state, job.reason = state, reason
        if state == "running" and job.started_at is None:
            job.started_at = time.time()
        if state in FINAL:
            job.ended_at = time.time()
            self.admit()
        return job

    def cancel(self, name: str) -> Job:
        """A queued job ends at once, and so does one whose driver never attached (its client
        died before starting it, or it died before joining): nothing would ever see its flag,
        and its floor would hold the queue. A live one is asked to stop (its driver sees the
        flag). A driver that attaches to a job cancelled so finds it ended and leaves."""
        job = self.find(name)
        if job.state in FINAL:
            return job
        if job.state == "queued":
            return self.set_state(job.name, "cancelled", "cancelled while queued")
        if job.driver_pid is None:
            return self.set_state(job.name, "cancelled", "cancelled before its driver started")
        job.cancel_requested = True
        return job

    def lost_drivers(self, alive: Callable[[int], bool], host: str) -> list[str]:
        """Live jobs whose driver ran on `host` and is gone without saying how its job ended
        (SIGKILLed, OOM-killed): nothing else would ever end them, and their promised floors
        would hold the queue for good."""
        return [j.name for j in self.live() if j.driver_pid is not None and j.driver_host == host
                and not alive(j.driver_pid)]

    # ------------------------------------------------------------------ reading
    def get(self, name: str) -> Job:
        if name not in self.jobs:
            raise ConfigError(f"no job {name!r} (jobs: {', '.join(sorted(self.jobs)) or 'none'})")
        return self.jobs[name]

    def find(self, name: str) -> Job:
        """A job by its name, or by the name of one of its pipelines (newest live one first)."""
        if name in self.jobs:
            return self.jobs[name]
        owners = [j for j in sorted(self.jobs.values(), key=lambda j: (j.state in FINAL, -j.submitted_at))
                  if any(p.name == name for p in j.pipelines)]
        if not owners:
            return self.get(name)  # the error names the jobs there are
        return owners[0]

    def live(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state not in FINAL]

    def queue(self) -> list[Job]:
        return sorted((j for j in self.jobs.values() if j.state == "queued"), key=lambda j: j.submitted_at)

    def position(self, name: str) -> int | None:
        """1-based place in the admission queue; None when not queued."""
        for i, job in enumerate(self.queue(), start=1):
            if job.name == name:
                return i
        return None

    def row(self, name: str) -> dict:
        """A job as `rlix jobs` shows it (its place in the queue included)."""
        job = self.find(name)
        return {**job.row(), "queue_position": self.position(job.name)}

    def rows(self) -> list[dict]:
        return [self.row(j.name) for j in sorted(self.jobs.values(), key=lambda j: j.submitted_at)]

    def _admitted(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state in ("admitted", "running")]

    def _why_not(self, job: Job) -> str | None:
        promised = sum(j.minimum for j in self._admitted())
        if promised + job.minimum > self.total_gpus:
            return (f"needs {job.minimum} GPU(s) as its minimum; {promised} of the cluster's "
                    f"{self.total_gpus} are promised to running jobs")
        cap = self.quotas.cap(job.user)
        if cap is not None:
            used = sum(j.most for j in self._admitted() if j.user == job.user)
            if used + job.most > cap:
                return (f"user {job.user!r} is at {used} of a {cap}-GPU cap; this job may hold "
                        f"up to {job.most}")
        return None
