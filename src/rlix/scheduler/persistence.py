"""The scheduler's state outside its process: written at every change, read back after a restart.

Ray restarts the scheduler's actor when its worker dies; without this it would come back empty
and every pipeline of the run would be lost. Kept: the ledger (registrations, holdings, training
homes, last shard GPUs, shardless order, holding spells, version), pending requests, progress, the plan log, the
numbered role log and its sequence number, the request-id counter, each pipeline's last release
and the departed pipelines (what calls retried after the restart are answered with), and the
service's own small state (`ServiceState`). Waiters are not kept: the calls Ray retries on the
new instance wait again.

No Ray here: a store is anything with get/put/delete/delete_prefix (`MemoryStore` in tests; the
service adapts Ray's GCS key-value store). The role log is written in chunks, only the newest
ones at each save, so a save costs the size of the small state, not of the whole log. Times are
the core's clock (monotonic, one per host); they are stored with the saving process's wall-clock
offset and moved onto the loading process's clock, so ages, dwell times and ageing deadlines go
on across a restart, even on another host (up to the hosts' wall-clock skew).
"""

from __future__ import annotations

import itertools
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from rlix.errors import LedgerError, SchedulerStateError
from rlix.scheduler.core import SchedulerCore
from rlix.scheduler.types import GpuRequest, Holding, PipelineSpec, Progress, Role, Stage

FORMAT = 1
#: role-log entries per stored chunk
ROLE_CHUNK = 256


class StateStore(Protocol):
    """Bytes by key, outliving the scheduler's process."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def delete_prefix(self, prefix: str) -> None: ...


class MemoryStore:
    """A `StateStore` in a dict (tests; the state outlives a `SchedulerCore`, not the process)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.puts = 0

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, value: bytes) -> None:
        self.data[key] = bytes(value)
        self.puts += 1

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def delete_prefix(self, prefix: str) -> None:
        for key in [k for k in self.data if k.startswith(prefix)]:
            del self.data[key]


@dataclass
class ServiceState:
    """What the service keeps beside the core: the first plan held (`hold`), recent failures and
    errors (times on the core's clock), and how often it was restarted."""

    holding: bool = False
    failures: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    restarts: int = 0


class SchedulerPersistence:
    """Saves a `SchedulerCore` (and a `ServiceState`) to a store under `prefix`; loads it into a
    fresh core. `wall_clock` is what the core's clock is related to across processes."""

    def __init__(self, store: StateStore, prefix: str,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.prefix = prefix
        self.wall_clock = wall_clock
        self.saves = 0  # writes of the small state (an unchanged state is not written)
        self._last: str | None = None
        self._roles_saved = 0  # seq of the newest role change stored
        self._first_chunk = 0  # the oldest role chunk stored

    # ------------------------------------------------------------------ keys
    @property
    def _core_key(self) -> str:
        return f"{self.prefix}core"

    def _chunk_key(self, index: int) -> str:
        return f"{self.prefix}roles:{index}"

    # ------------------------------------------------------------------ blobs
    def put_blob(self, name: str, data: bytes) -> None:
        """Opaque bytes beside the state (the service's pickled coordinator handles)."""
        self.store.put(f"{self.prefix}blob:{name}", data)

    def get_blob(self, name: str) -> bytes | None:
        return self.store.get(f"{self.prefix}blob:{name}")

    def clear(self) -> None:
        """Forget everything under the prefix (a fresh scheduler must not load a stale state)."""
        self.store.delete_prefix(self.prefix)
        self._last, self._roles_saved, self._first_chunk = None, 0, 0

    # ------------------------------------------------------------------ save
    def save(self, core: SchedulerCore, service: ServiceState) -> bool:
        """Write the state if it changed; True if written. Role chunks go first: the state names
        the last role change, and every change up to it must be stored when it is."""
        self._save_roles(core)
        body = json.dumps(_encode(core, service), separators=(",", ":"))
        if body == self._last:
            return False
        offset = self.wall_clock() - core.clock()
        self.store.put(self._core_key, f'{{"offset":{offset!r},"state":{body}}}'.encode())
        self._last = body
        self.saves += 1
        return True

    def _save_roles(self, core: SchedulerCore) -> None:
        log = core.role_log
        if not log or log[-1]["seq"] <= self._roles_saved:
            return
        first_seq, last_seq = log[0]["seq"], log[-1]["seq"]
        first_chunk = (first_seq - 1) // ROLE_CHUNK
        start = max(first_chunk, self._roles_saved // ROLE_CHUNK)
        for index in range(start, (last_seq - 1) // ROLE_CHUNK + 1):
            lo = max(index * ROLE_CHUNK + 1, first_seq)
            hi = min((index + 1) * ROLE_CHUNK, last_seq)
            entries = list(itertools.islice(log, lo - first_seq, hi - first_seq + 1))
            self.store.put(self._chunk_key(index), json.dumps(entries, separators=(",", ":")).encode())
        for index in range(self._first_chunk, first_chunk):  # fell out of the kept log
            self.store.delete(self._chunk_key(index))
        self._first_chunk, self._roles_saved = first_chunk, last_seq

    # ------------------------------------------------------------------ load
    def load(self, core: SchedulerCore) -> ServiceState | None:
        """Fill a fresh core with the stored state; None if nothing is stored. Raises
        SchedulerStateError if the state cannot be read or breaks a ledger invariant."""
        raw = self.store.get(self._core_key)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            shift = float(doc["offset"]) - (self.wall_clock() - core.clock())
            service = _decode(core, doc["state"], shift, self._read_roles)
            core.ledger.check_invariants()
        except SchedulerStateError:
            raise
        except (LedgerError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SchedulerStateError(f"the scheduler's state under {self.prefix!r} is unreadable: "
                                      f"{type(exc).__name__}: {exc}") from None
        self._last = None  # the next save writes (the restart count changed)
        self._roles_saved = core.role_seq
        self._first_chunk = (core.role_log[0]["seq"] - 1) // ROLE_CHUNK if core.role_log else 0
        return service

    def _read_roles(self, first: int, last: int) -> list[dict]:
        """Role changes numbered first..last, all of them, or SchedulerStateError."""
        out: list[dict] = []
        if last < first:
            return out
        for index in range((first - 1) // ROLE_CHUNK, (last - 1) // ROLE_CHUNK + 1):
            raw = self.store.get(self._chunk_key(index))
            if raw is None:
                raise SchedulerStateError(f"the scheduler's role log under {self.prefix!r} lacks "
                                          f"chunk {index} (changes {first}..{last} expected)")
            out.extend(c for c in json.loads(raw) if first <= c["seq"] <= last)
        if [c["seq"] for c in out] != list(range(first, last + 1)):
            raise SchedulerStateError(f"the scheduler's role log under {self.prefix!r} is not "
                                      f"continuous from {first} to {last}")
        return out


# ---------------------------------------------------------------------- encoding
def _encode(core: SchedulerCore, service: ServiceState) -> dict[str, Any]:
    ledger = core.ledger
    return {
        "format": FORMAT,
        "gpus_per_node": list(ledger.topology.gpus_per_node),
        "pipelines": [asdict(spec) for spec in ledger.pipelines.values()],
        "holdings": [
            {"pipeline": h.pipeline, "role": h.role.value, "gpus": list(h.gpus), "since": h.since,
             "stage": h.stage.name, "dp_rank": h.dp_rank, "request_id": h.request_id}
            for h in ledger.holdings.values()
        ],
        "train_home": {name: sorted(home) for name, home in ledger.train_home.items()},
        "last_shard_gpus": [[name, rank, list(gpus)]
                            for (name, rank), gpus in ledger.last_shard_gpus.items()],
        "shardless_since": dict(ledger.shardless_since),
        "holding_since": dict(ledger.holding_since),
        "lost": sorted(ledger.lost),
        "version": ledger.version,
        "pending": [{"id": r.id, "pipeline": r.pipeline, "stage": r.stage.name, "gpus": r.gpus,
                     "submitted_at": r.submitted_at} for r in core.pending.values()],
        "progress": [dict(asdict(p), engines_starting=sorted(p.engines_starting)) for p in core.progress.values()],
        "plan_log": list(core.plan_log),
        "role_seq": core.role_seq,
        "role_first": core.role_log[0]["seq"] if core.role_log else core.role_seq + 1,
        "next_id": core.next_id,
        "last_error": core.last_error,
        "last_release": core.last_release,
        "departed": [[name, info] for name, info in core.departed.items()],
        "service": asdict(service),
    }


def _decode(core: SchedulerCore, state: dict[str, Any], shift: float,
            read_roles: Callable[[int, int], list[dict]]) -> ServiceState:
    if state.get("format") != FORMAT:
        raise SchedulerStateError(f"the scheduler's stored state has format {state.get('format')!r}; "
                                  f"this rlix reads format {FORMAT}")
    ledger = core.ledger
    if tuple(state["gpus_per_node"]) != ledger.topology.gpus_per_node:
        raise SchedulerStateError(f"the scheduler's stored state is for GPUs per node "
                                  f"{state['gpus_per_node']}, not {list(ledger.topology.gpus_per_node)}")
    ledger.pipelines = {d["name"]: PipelineSpec(**d) for d in state["pipelines"]}
    ledger.train_home = {name: frozenset(int(g) for g in home)
                         for name, home in state["train_home"].items()}
    ledger.holdings = {}
    ledger.owner = [None] * ledger.topology.num_gpus
    for d in state["holdings"]:
        holding = Holding(d["pipeline"], Role(d["role"]), tuple(int(g) for g in d["gpus"]),
                          float(d["since"]) + shift, stage=Stage[d["stage"]], dp_rank=d["dp_rank"],
                          request_id=d["request_id"])
        if holding.key in ledger.holdings:
            raise SchedulerStateError(f"the scheduler's stored state holds {holding.key} twice")
        ledger.holdings[holding.key] = holding
        for g in holding.gpus:
            if not 0 <= g < len(ledger.owner) or ledger.owner[g] is not None:
                raise SchedulerStateError(f"the scheduler's stored state puts GPU {g} in two "
                                          f"holdings, or names a GPU that does not exist")
            ledger.owner[g] = holding.key
    ledger.last_shard_gpus = {(name, int(rank)): tuple(int(g) for g in gpus)
                              for name, rank, gpus in state["last_shard_gpus"]}
    ledger.shardless_since = {name: int(v) for name, v in state["shardless_since"].items()}
    ledger.holding_since = {name: float(v) + shift
                            for name, v in state.get("holding_since", {}).items()}
    ledger.lost = {int(g) for g in state.get("lost", [])}  # GPUs gone with their node stay gone
    ledger.version = int(state["version"])

    core.pending = {}
    for d in state["pending"]:
        core.pending[int(d["id"])] = GpuRequest(int(d["id"]), d["pipeline"], Stage[d["stage"]],
                                                int(d["gpus"]), float(d["submitted_at"]) + shift)
    core.progress = {}
    for d in state["progress"]:
        d = dict(d, shard_load={int(k): int(v) for k, v in d["shard_load"].items()},
                 reported_at=float(d["reported_at"]) + shift,
                 engines_starting=frozenset(int(g) for g in d.get("engines_starting", ())))
        core.progress[d["pipeline"]] = Progress(**d)
    core.plan_log.clear()
    core.plan_log.extend(dict(p, at=p["at"] + shift) for p in state["plan_log"])
    core.role_log.clear()
    roles = read_roles(int(state["role_first"]), int(state["role_seq"]))
    core.role_log.extend(dict(c, at=c["at"] + shift) for c in roles)
    core.role_seq = int(state["role_seq"])
    core.next_id = int(state["next_id"])
    core.last_error = state["last_error"]
    core.last_release = {name: dict(v) for name, v in state["last_release"].items()}
    core.departed = OrderedDict((name, dict(info)) for name, info in state["departed"])
    core.resync_roles()

    svc = state["service"]
    moved = lambda rows: [dict(r, at=r["at"] + shift) if "at" in r else dict(r) for r in rows]  # noqa: E731
    return ServiceState(holding=bool(svc["holding"]), failures=moved(svc["failures"]),
                        errors=moved(svc["errors"]), restarts=int(svc["restarts"]))
