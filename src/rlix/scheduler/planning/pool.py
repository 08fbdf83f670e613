"""A scratch view of the cluster for one planning pass.

The planner tries out shrinks, grants and expands here without touching the ledger; the pass
ends by reading the decided moves off this view. Everything is kept per node so that finding
room for a shard or a training group costs O(nodes + GPUs of a node), not O(cluster).
"""

from __future__ import annotations

from rlix.scheduler.state import Ledger
from rlix.scheduler.types import Holding, Role, ShardMove

LOCKED = ("locked",)  # a GPU held by a non-rollout stage or granted in this pass


class Pool:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.topology = ledger.topology
        self.node_of = ledger.node_of
        self.node_gpus = ledger.node_gpus
        self.state: list = list(ledger.owner)  # None = free, shard key, or LOCKED
        self.shards: dict[tuple, Holding] = {}
        self.shard_count: dict[str, int] = {name: 0 for name in ledger.pipelines}
        # Per pipeline: its active dp ranks and its shards per node, kept up to date so that
        # placing one shard never scans the whole cluster.
        self.ranks: dict[str, set[int]] = {name: set() for name in ledger.pipelines}
        self.per_node: dict[str, list[int]] = {}
        state = self.state
        for g in ledger.lost:  # gone with their node: never free again
            state[g] = LOCKED
        locked = len(ledger.lost)
        # nodes are consecutive GPU ranges: count the free ones at C speed
        self.free_on_node = [state[r[0]:r[-1] + 1].count(None) if r else 0 for r in self.node_gpus]
        shards, count, ranks, per_node = self.shards, self.shard_count, self.ranks, self.per_node
        node_of, n_nodes = self.node_of, len(self.node_gpus)
        #: pipelines holding a non-rollout stage now
        self.training: set[str] = set()
        for key, h in ledger.holdings.items():
            name = h.pipeline
            if h.role is Role.GENERATE:
                shards[key] = h
                count[name] += 1
                ranks[name].add(h.dp_rank)
                counts = per_node.get(name)
                if counts is None:
                    counts = per_node[name] = [0] * n_nodes
                counts[node_of[h.gpus[0]]] += 1
            else:
                self.training.add(name)
                locked += len(h.gpus)
                for g in h.gpus:
                    state[g] = LOCKED
        self.locked_total = locked
        #: free GPUs in the whole cluster (sum of free_on_node): a claim skips the search when
        #: fewer than a shard's GPUs are free anywhere
        self.free_total = sum(self.free_on_node)
        self.shrinks: list[ShardMove] = []
        self.expands: list[ShardMove] = []

    # ------------------------------------------------------------------ queries
    def is_free(self, g: int) -> bool:
        return self.state[g] is None

    def shard_at(self, g: int) -> Holding | None:
        key = self.state[g]
        return self.shards.get(key) if key is not None and key is not LOCKED else None

    def unlocked(self) -> int:
        """GPUs not held by a non-rollout stage: free ones plus rollout shards."""
        return self.topology.num_gpus - self.locked_total

    def active_ranks(self, pipeline: str) -> set[int]:
        return self.ranks[pipeline]

    def _count_in(self, h: Holding, key: tuple | None = None) -> None:
        self.shards[key or h.key] = h
        self.shard_count[h.pipeline] += 1
        self.ranks[h.pipeline].add(h.dp_rank)
        counts = self.per_node.get(h.pipeline)
        if counts is None:
            counts = self.per_node[h.pipeline] = [0] * len(self.node_gpus)
        counts[self.node_of[h.gpus[0]]] += 1

    def _count_out(self, key: tuple) -> Holding:
        h = self.shards.pop(key)
        self.shard_count[h.pipeline] -= 1
        self.ranks[h.pipeline].discard(h.dp_rank)
        self.per_node[h.pipeline][self.node_of[h.gpus[0]]] -= 1
        return h

    # ------------------------------------------------------------------ changes
    def shrink(self, key: tuple) -> None:
        h = self._count_out(key)
        for g in h.gpus:
            self.state[g] = None
            self.free_on_node[self.node_of[g]] += 1
        self.free_total += len(h.gpus)
        # A shard woken in this same pass and shrunk again never reaches the ledger.
        for i, e in enumerate(self.expands):
            if (e.pipeline, "shard", e.dp_rank) == key:
                del self.expands[i]
                return
        self.shrinks.append(ShardMove(h.pipeline, h.dp_rank, h.gpus))

    def lock(self, gpus: list[int]) -> None:
        """Take GPUs for a non-rollout grant; shards on them must already be shrunk."""
        for g in gpus:
            if self.state[g] is not None:
                raise RuntimeError(f"planner bug: locking GPU {g} held by {self.state[g]}")
            self.state[g] = LOCKED
            self.free_on_node[self.node_of[g]] -= 1
        self.free_total -= len(gpus)
        self.locked_total += len(gpus)

    def expand(self, pipeline: str, dp_rank: int, gpus: tuple[int, ...], now: float) -> None:
        key = (pipeline, "shard", dp_rank)
        for g in gpus:
            if self.state[g] is not None:
                raise RuntimeError(f"planner bug: shard on GPU {g} held by {self.state[g]}")
            self.state[g] = key
            self.free_on_node[self.node_of[g]] -= 1
        self.free_total -= len(gpus)
        self._count_in(Holding(pipeline, Role.GENERATE, gpus, now, dp_rank=dp_rank))
        self.expands.append(ShardMove(pipeline, dp_rank, gpus))

    # ------------------------------------------------------------------ placement
    def free_gpus_on(self, node: int, exclude: frozenset[int] = frozenset()) -> list[int]:
        return [g for g in self.node_gpus[node] if self.state[g] is None and g not in exclude]

    def place_shard(self, pipeline: str, tp: int, dp_rank: int,
                    exclude: frozenset[int] = frozenset()) -> tuple[int, ...] | None:
        """Free GPUs for one shard: its previous GPUs if free (its engine is still there),
        else the node holding the fewest of this pipeline's shards (so one node-sized training
        grant never takes all of them), best fit among those. Within the node, GPUs outside every
        training home first, then its own home (it sleeps there only while its own trainer
        trains), another pipeline's home last (that pipeline's every train step preempts it)."""
        last = self.ledger.last_shard_gpus.get((pipeline, dp_rank))
        if last and all(self.state[g] is None for g in last) and not exclude.intersection(last):
            return last
        mine = self.per_node.get(pipeline) or [0] * len(self.free_on_node)
        best, best_key = None, None
        for node, nfree in enumerate(self.free_on_node):
            if nfree < tp:
                continue
            if exclude and len(self.free_gpus_on(node, exclude)) < tp:
                continue
            key = (mine[node], nfree - tp)
            if best_key is None or key < best_key:
                best, best_key = node, key
        if best is None:
            return None
        return tuple(sorted(self.free_gpus_on(best, exclude), key=lambda g: self._home_cost(pipeline, g))[:tp])

    def _home_cost(self, pipeline: str, g: int) -> int:
        homes = self.ledger.train_home
        if g in homes.get(pipeline, ()):
            return 1
        return 2 if any(g in home for home in homes.values()) else 0

    def next_rank(self, pipeline: str, max_shards: int) -> int | None:
        """An inactive dp rank, preferring one whose previous GPUs are free again (its engine
        is still there), and avoiding ranks put to sleep in this same pass (waking one
        elsewhere at once would mean relaunching it). On whole GPUs, a rank that never ran
        goes before one whose engine sleeps on GPUs still busy: a shard process cannot change
        devices, so that one would be started anew elsewhere, and its engine lost where it
        could have woken once those GPUs are free (a process start costs orders of magnitude
        more than a wake: docs/BENCHMARKS.md)."""
        active = self.active_ranks(pipeline)
        slept = {m.dp_rank for m in self.shrinks if m.pipeline == pipeline}
        whole_gpus = self.ledger.topology.slices == 1  # a move between slices keeps the process
        fallback = None
        for rank in range(max_shards):
            if rank in active:
                continue
            last = self.ledger.last_shard_gpus.get((pipeline, rank))
            if last and rank not in slept and all(self.state[g] is None for g in last):
                return rank
            key = (rank in slept, whole_gpus and last is not None, rank)
            if fallback is None or key < fallback:
                fallback = key
        return None if fallback is None else fallback[-1]
