"""The GPU ledger: which pipeline holds which GPU, in which role.

Invariants, checked on every change (a change that breaks one raises `LedgerError` and leaves
the ledger as it was):
  1. every held GPU exists, and no GPU is in two holdings;
  2. a shard holds exactly `tp` GPUs of its pipeline, all on one node, under a dp rank
     below `max_shards`;
  3. one pipeline's train and generate roles share GPUs only through a declared partial
     overlap. A pipeline without partial overlap gets a fixed training home at registration:
     its non-rollout stages run only there and its shards never go there (its engines never
     sit on the GPUs its trainer uses). A pipeline with partial overlap may train on GPUs its
     own shards used a moment before: those shards sleep while it trains. A pipeline whose
     trainer is a process bound to GPUs (`fixed_trainer`) also gets a home, and with partial
     overlap its shards may use it;
  4. every holding belongs to a registered pipeline, at most one holding per stage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from rlix.errors import LedgerError
from rlix.scheduler.types import Holding, PipelineSpec, Plan, Role, Stage, Topology

HoldingKey = tuple


class Ledger:
    """Mutable GPU state. The planner reads it; only `apply`, `release`, `unregister` and
    `note_engines_starting` change it."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.node_of: list[int] = topology.node_of()
        self.node_gpus: list[list[int]] = [list(topology.node_gpus(n)) for n in range(topology.num_nodes)]
        self.owner: list[HoldingKey | None] = [None] * topology.num_gpus
        self.holdings: dict[HoldingKey, Holding] = {}
        self.pipelines: dict[str, PipelineSpec] = {}
        self.train_home: dict[str, frozenset[int]] = {}
        # where each pipeline's engines are still starting (its reports say; not persisted: a
        # restarted scheduler learns it from the next report, and meanwhile only plans as before)
        self.engines_starting: dict[str, frozenset[int]] = {}
        self.last_shard_gpus: dict[tuple[str, int], tuple[int, ...]] = {}
        # pipeline -> ledger version since which it has held no shard (absent: it holds one);
        # the rollout floor serves the longest-waiting first, so names never decide who starves
        self.shardless_since: dict[str, int] = {}
        # pipeline -> time its current spell of holding at least one shard began (absent: it
        # holds none); after `rotate_s` of it a waiting pipeline of its tier may take its shard
        self.holding_since: dict[str, float] = {}
        self.version = 0  # bumped on every change; lets callers cache derived views
        # per node, bumped whenever a holding on it comes or goes (or a GPU of it is lost):
        # the planner re-prices only the nodes that changed since its last pass
        self.node_version: list[int] = [0] * topology.num_nodes
        self.price_cache = None  # the planner's cache of node prices (derived, never persisted)
        # GPUs whose node left the cluster: nothing is placed on them again
        self.lost: set[int] = set()

    # ------------------------------------------------------------------ pipelines
    def register(self, spec: PipelineSpec) -> None:
        if spec.name in self.pipelines:
            raise LedgerError(f"pipeline {spec.name!r} is already registered")
        total = self.topology.num_gpus
        biggest_node = max(self.topology.gpus_per_node)
        if spec.train_gpus > total:
            raise LedgerError(
                f"pipeline {spec.name!r}: train_gpus={spec.train_gpus} exceeds the cluster's {total} GPUs"
            )
        if spec.tp > biggest_node:
            raise LedgerError(
                f"pipeline {spec.name!r}: tp={spec.tp} does not fit on one node "
                f"(largest node has {biggest_node} GPUs)"
            )
        if (not spec.partial_overlap or spec.fixed_trainer) and spec.train_gpus > 0:
            home = self._pick_train_home(spec)
            if not spec.partial_overlap and not self._fits_outside(spec.tp, home):
                raise LedgerError(
                    f"pipeline {spec.name!r}: without partial_overlap its {spec.train_gpus} training "
                    f"GPUs leave no room for one shard of tp={spec.tp}"
                )
            self.train_home[spec.name] = home
        self.pipelines[spec.name] = spec
        self.shardless_since[spec.name] = self.version
        self.version += 1

    def unregister(self, name: str) -> list[int]:
        """Forget a pipeline and return the GPUs it held (they become idle)."""
        self._require(name)
        freed: list[int] = []
        for key in [k for k, h in self.holdings.items() if h.pipeline == name]:
            freed.extend(self._drop(key))
        del self.pipelines[name]
        self.train_home.pop(name, None)
        self.engines_starting.pop(name, None)
        self.shardless_since.pop(name, None)
        self.holding_since.pop(name, None)
        for key in [k for k in self.last_shard_gpus if k[0] == name]:
            del self.last_shard_gpus[key]
        self.version += 1
        self.check_invariants()
        return sorted(freed)

    def note_engines_starting(self, pipeline: str, gpus: frozenset[int]) -> None:
        """Where `pipeline`'s engines are still starting, as it last said (replaces the last)."""
        self._require(pipeline)
        bad = sorted(g for g in gpus if not (isinstance(g, int) and 0 <= g < self.topology.num_gpus))
        if bad:
            raise LedgerError(f"pipeline {pipeline!r}: engines starting on GPUs {bad} that do not exist")
        if gpus:
            self.engines_starting[pipeline] = frozenset(gpus)
        else:
            self.engines_starting.pop(pipeline, None)

    # ------------------------------------------------------------------ queries
    def holding_of(self, gpu: int) -> Holding | None:
        key = self.owner[gpu]
        return None if key is None else self.holdings[key]

    def shards_of(self, pipeline: str) -> dict[int, Holding]:
        return {
            h.dp_rank: h
            for h in self.holdings.values()
            if h.pipeline == pipeline and h.role is Role.GENERATE
        }

    def stage_holding(self, pipeline: str, stage: Stage) -> Holding | None:
        return self.holdings.get((pipeline, "stage", stage))

    def shard_exclusion(self, pipeline: str) -> frozenset[int]:
        """GPUs this pipeline's shards may never use: its training home, unless it declares
        partial overlap (then its shards sleep there while it trains)."""
        spec = self.pipelines.get(pipeline)
        if spec is None or spec.partial_overlap:
            return frozenset()
        return self.train_home.get(pipeline, frozenset())

    def idle_gpus(self) -> list[int]:
        return [g for g, key in enumerate(self.owner) if key is None and g not in self.lost]

    def gpus_of(self, pipeline: str) -> list[int]:
        return sorted(g for h in self.holdings.values() if h.pipeline == pipeline for g in h.gpus)

    # ------------------------------------------------------------------ changes
    def apply(self, plan: Plan, now: float) -> None:
        """Apply a plan atomically: validated as a whole first, so a bad plan changes nothing."""
        owner = dict()  # gpu -> key, overlay on self.owner for the validation pass
        removed: set[HoldingKey] = set()

        def current(gpu: int) -> HoldingKey | None:
            return owner[gpu] if gpu in owner else self.owner[gpu]

        for move in plan.shrinks:
            key = (move.pipeline, "shard", move.dp_rank)
            held = self.holdings.get(key)
            if held is None or key in removed:
                raise LedgerError(f"shrink of {move.pipeline}#{move.dp_rank}: no such active shard")
            if tuple(held.gpus) != tuple(move.gpus):
                raise LedgerError(
                    f"shrink of {move.pipeline}#{move.dp_rank}: gpus {list(move.gpus)} "
                    f"do not match the ledger's {list(held.gpus)}"
                )
            removed.add(key)
            for g in held.gpus:
                owner[g] = None

        new: list[Holding] = []
        for grant in plan.grants:
            holding = Holding(grant.pipeline, Role.TRAIN, tuple(grant.gpus), now,
                              stage=grant.stage, request_id=grant.request_id)
            self._validate_new(holding, removed)
            self._claim(holding, current, owner)
            new.append(holding)
        for move in plan.expands:
            holding = Holding(move.pipeline, Role.GENERATE, tuple(move.gpus), now,
                              dp_rank=move.dp_rank)
            self._validate_new(holding, removed)
            self._claim(holding, current, owner)
            new.append(holding)
        if len({h.key for h in new}) != len(new):
            raise LedgerError("plan creates the same holding twice")

        for key in removed:
            self._drop(key)
        for holding in new:
            self._add(holding)
        self._note_spells(now)
        self.version += 1
        self.check_invariants()

    def _note_spells(self, now: float) -> None:
        """Start or end each pipeline's spell with shards (`holding_since`) or without
        (`shardless_since`): the rollout floor's order comes from these."""
        with_shards = {h.pipeline for h in self.holdings.values() if h.role is Role.GENERATE}
        for name in self.pipelines:
            if name in with_shards:
                self.shardless_since.pop(name, None)
                self.holding_since.setdefault(name, now)
            else:
                self.shardless_since.setdefault(name, self.version)
                self.holding_since.pop(name, None)

    def mark_lost(self, gpus: Iterable[int]) -> list[Holding]:
        """GPUs that left the cluster with their node: every holding on one is dropped (its
        processes went with the node) and no plan uses them again. Returns the holdings dropped."""
        lost = {int(g) for g in gpus if 0 <= int(g) < self.topology.num_gpus} - self.lost
        dropped = [h for h in self.holdings.values() if lost & set(h.gpus)]
        for h in dropped:
            self._drop(h.key)
        self.lost |= lost
        self._touch(lost)
        self._note_spells(0.0)  # only ends spells: no shard is added here
        self.version += 1
        self.check_invariants()
        return dropped

    def release(self, pipeline: str, stage: Stage) -> list[int]:
        """A pipeline gives back the GPUs it holds for a non-rollout stage."""
        self._require(pipeline)
        key = (pipeline, "stage", stage)
        if key not in self.holdings:
            raise LedgerError(f"pipeline {pipeline!r} holds no GPUs for stage {stage.name.lower()}")
        freed = self._drop(key)
        self.version += 1
        self.check_invariants()
        return freed

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        seen: dict[int, HoldingKey] = {}
        n = self.topology.num_gpus
        for key, h in self.holdings.items():
            if key != h.key:
                raise LedgerError(f"holding stored under {key} but keyed {h.key}")
            spec = self.pipelines.get(h.pipeline)
            if spec is None:
                raise LedgerError(f"holding {key} belongs to unregistered pipeline {h.pipeline!r}")
            for g in h.gpus:
                if not 0 <= g < n:
                    raise LedgerError(f"holding {key} names GPU {g}, which does not exist")
                if g in seen:
                    raise LedgerError(f"GPU {g} is in two holdings: {seen[g]} and {key}")
                seen[g] = key
                if self.owner[g] != key:
                    raise LedgerError(f"GPU {g}: owner index says {self.owner[g]}, holding says {key}")
            self._check_shape(h, spec)
        stray = [g for g, key in enumerate(self.owner) if key is not None and g not in seen]
        if stray:
            raise LedgerError(f"GPUs {stray} are marked held but no holding names them")

    # ------------------------------------------------------------------ internals
    def _require(self, name: str) -> PipelineSpec:
        spec = self.pipelines.get(name)
        if spec is None:
            raise LedgerError(f"pipeline {name!r} is not registered")
        return spec

    def _check_shape(self, h: Holding, spec: PipelineSpec) -> None:
        if len(set(h.gpus)) != len(h.gpus) or not h.gpus:
            raise LedgerError(f"holding {h.key} has an empty or repeated GPU list {list(h.gpus)}")
        home = self.train_home.get(h.pipeline)
        if h.role is Role.GENERATE:
            if h.dp_rank is None or not 0 <= h.dp_rank < spec.max_shards:
                raise LedgerError(f"shard {h.key}: dp rank outside [0, max_shards={spec.max_shards})")
            if len(h.gpus) != spec.tp:
                raise LedgerError(f"shard {h.key} holds {len(h.gpus)} GPUs, its tp is {spec.tp}")
            if len({self.node_of[g] for g in h.gpus}) != 1:
                raise LedgerError(f"shard {h.key} spans several nodes: {list(h.gpus)}")
            if home is not None and not spec.partial_overlap and home.intersection(h.gpus):
                raise LedgerError(
                    f"shard {h.key} sits on its own training GPUs {sorted(home.intersection(h.gpus))} "
                    f"but {h.pipeline!r} declares no partial overlap"
                )
        else:
            if h.stage is Stage.ROLLOUT:
                raise LedgerError(f"holding {h.key}: rollout is held by shards, not by a stage")
            if home is not None and not home.issuperset(h.gpus):
                raise LedgerError(
                    f"{h.pipeline!r} trains only on its home {sorted(home)}, not on {list(h.gpus)}"
                )

    def _validate_new(self, h: Holding, removed: set[HoldingKey]) -> None:
        spec = self._require(h.pipeline)
        if h.key in self.holdings and h.key not in removed:
            raise LedgerError(f"{h.key} is already held")
        n = self.topology.num_gpus
        bad = [g for g in h.gpus if not 0 <= g < n]
        if bad:
            raise LedgerError(f"{h.key}: GPUs {bad} do not exist (cluster has {n})")
        gone = sorted(set(h.gpus) & self.lost)
        if gone:
            raise LedgerError(f"{h.key}: GPUs {gone} left the cluster with their node")
        self._check_shape(h, spec)

    @staticmethod
    def _claim(h: Holding, current, owner: dict) -> None:
        for g in h.gpus:
            if current(g) is not None:
                raise LedgerError(f"{h.key} wants GPU {g}, still held by {current(g)}")
            owner[g] = h.key

    def _touch(self, gpus: Iterable[int]) -> None:
        for node in {self.node_of[g] for g in gpus}:
            self.node_version[node] += 1

    def _add(self, h: Holding) -> None:
        self.holdings[h.key] = h
        self._touch(h.gpus)
        for g in h.gpus:
            self.owner[g] = h.key
        if h.role is Role.GENERATE:
            self.last_shard_gpus[(h.pipeline, h.dp_rank)] = h.gpus

    def _drop(self, key: HoldingKey) -> list[int]:
        h = self.holdings.pop(key)
        self._touch(h.gpus)
        for g in h.gpus:
            self.owner[g] = None
        return list(h.gpus)

    def _pick_train_home(self, spec: PipelineSpec) -> frozenset[int]:
        """Node-packed GPUs for a pipeline's trainer, spread away from earlier homes. On slices
        (`Topology.slices` > 1) homes are spread over the physical devices first: two trainers
        on slices of one device would contend for its compute while another device trained
        nothing, and the ranks of one trainer never share a device (NCCL needs one each)."""
        used = {g for home in self.train_home.values() for g in home}
        per = self.topology.slices
        homes_on = Counter(g // per for g in used)  # trainers' slices per physical device
        order = sorted(range(self.topology.num_gpus),
                       key=lambda g: (g in used, homes_on[g // per], self.node_of[g], g))
        # Prefer whole nodes: take GPUs node by node, least-used nodes first.
        by_node: dict[int, list[int]] = {}
        for g in order:
            by_node.setdefault(self.node_of[g], []).append(g)
        nodes = sorted(by_node, key=lambda nd: (sum(g in used for g in by_node[nd]), nd))
        picked: list[int] = []
        for nd in nodes:
            for g in by_node[nd]:
                if len(picked) < spec.train_gpus and all(g // per != p // per for p in picked):
                    picked.append(g)
        return frozenset(picked)

    def _fits_outside(self, tp: int, home: Iterable[int]) -> bool:
        home = set(home)
        for node in range(self.topology.num_nodes):
            free = sum(1 for g in self.topology.node_gpus(node) if g not in home)
            if free >= tp:
                return True
        return False

    def snapshot(self) -> dict:
        """A JSON-friendly picture of the ledger."""
        return {
            "gpus": self.topology.num_gpus,
            "nodes": list(self.topology.gpus_per_node),
            "idle": self.idle_gpus(),
            "lost": sorted(self.lost),
            "holdings": [
                {
                    "pipeline": h.pipeline,
                    "role": h.role.value,
                    "stage": h.stage.name.lower(),
                    "dp_rank": h.dp_rank,
                    "gpus": list(h.gpus),
                    "since": h.since,
                }
                for h in sorted(self.holdings.values(), key=lambda h: h.gpus)
            ],
        }

