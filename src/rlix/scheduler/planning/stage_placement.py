"""Where a non-rollout stage (init, train, logprob) goes: n GPUs on as few nodes as possible.

Price of a GPU for the requester: idle 0 < shard of a pipeline with no rollout demand 0.5 <
its own shard 1 (partial overlap only) < another pipeline's shard: 2 + 2 per priority tier,
+0.5 if woken within the dwell time, + up to 1 by running requests. Non-rollout holdings are
never taken. Among nodes, the one that empties no other pipeline of its last shard wins, then
the cheapest, then the best fit.

Per-node price lists are cached for the whole planning pass (they do not depend on who asks,
except for the asker's own shards, which are re-priced on the few nodes where it has any) and
dropped for the nodes a grant changes, so serving R requests costs O(R x nodes), not
O(R x GPUs). Across passes (`NodePrices`, kept on the ledger) a node is re-priced only when a
holding on it came or went (`Ledger.node_version`), a pipeline with a shard there changed its
demand, tier or report, or one of its shards left its dwell time: between two passes that is
a handful of nodes, not the cluster.
"""

from __future__ import annotations

import heapq

from rlix.scheduler.planning.pool import LOCKED, Pool
from rlix.scheduler.state import Ledger
from rlix.scheduler.types import PipelineSpec, Progress


class NodePrices:
    """Node price lists of the last passes, with what they were computed from."""

    def __init__(self, ledger: Ledger, dwell_s: float) -> None:
        n = len(ledger.node_gpus)
        self.holdings = ledger.holdings  # a restored ledger gets a new dict: start over
        self.dwell_s = dwell_s
        self.node_version = [-1] * n
        self.valid_until = [0.0] * n  # a shard there leaves its dwell time then
        self.computed_at = -float("inf")
        self.prices: list[list[tuple[float, int]] | None] = [None] * n
        self.sums = [0.0] * n
        self.inputs: dict[str, tuple] = {}  # pipeline -> (base price, its Progress object)

    def fits(self, ledger: Ledger, dwell_s: float, now: float) -> bool:
        return (self.holdings is ledger.holdings and self.dwell_s == dwell_s
                and len(self.prices) == len(ledger.node_gpus) and now >= self.computed_at)

    def forget_stale(self, ledger: Ledger, pool: Pool, inputs: dict[str, tuple], now: float) -> None:
        """Drop the lists a change since the last pass may have made wrong."""
        ver = ledger.node_version
        for nd in range(len(self.prices)):
            if self.node_version[nd] != ver[nd] or self.valid_until[nd] <= now:
                self.prices[nd] = None
        for name, (base, prog) in inputs.items():
            old = self.inputs.get(name)
            if old is not None and old[0] == base and old[1] is prog:
                continue
            mine = pool.per_node.get(name)
            if mine:
                for nd, k in enumerate(mine):
                    if k:
                        self.prices[nd] = None
        self.inputs = inputs
        self.computed_at = now


class StagePlacer:
    def __init__(self, pool: Pool, ledger: Ledger, progress: dict[str, Progress],
                 demand: dict[str, int], now: float, dwell_s: float) -> None:
        self.pool, self.ledger, self.progress, self.demand = pool, ledger, progress, demand
        self.now, self.dwell_s = now, dwell_s
        tiers = sorted({s.priority for s in ledger.pipelines.values()})
        tier_rank = {p: i for i, p in enumerate(tiers)}
        # A shard's price without its own freshness and load, per pipeline (None: no demand).
        self._base = {name: (2.0 + 2.0 * tier_rank[s.priority]) if demand.get(name, 0) else None
                      for name, s in ledger.pipelines.items()}
        self.biggest = max(ledger.topology.gpus_per_node)
        self._prices: dict[int, list[tuple[float, int]]] = {}
        self._sums: dict[int, float] = {}
        self._order: list[tuple[int, float, int]] | None = None
        cache = ledger.price_cache
        if not isinstance(cache, NodePrices) or not cache.fits(ledger, dwell_s, now):
            cache = ledger.price_cache = NodePrices(ledger, dwell_s)
        cache.forget_stale(ledger, pool, {name: (base, progress.get(name))
                                          for name, base in self._base.items()}, now)
        self._cache = cache
        self._touched: set[int] = set()  # nodes a grant changed in this pass

    # ------------------------------------------------------------------ prices
    def _price(self, g: int) -> float | None:
        """Requester-independent price; None = cannot be taken."""
        key = self.pool.state[g]
        if key is None:
            return 0.0
        if key is LOCKED:
            return None
        base = self._base[key[0]]
        if base is None:
            return 0.5
        h = self.pool.shards[key]
        prog = self.progress.get(key[0])
        load = prog.shard_load.get(key[2], 0) if prog is not None and prog.shard_load else 0
        fresh = 0.5 if self.now - h.since < self.dwell_s else 0.0
        return base + fresh + load / (load + 1)

    def _node_prices(self, node: int, spec: PipelineSpec | None) -> list[tuple[float, int]]:
        mine = self.pool.per_node.get(spec.name) if spec is not None else None
        if mine and mine[node]:
            return self._priced(self.pool.node_gpus[node], spec)
        cached = self._prices.get(node)
        if cached is None:
            cache = self._cache
            if node not in self._touched and cache.prices[node] is not None:
                cached, total = cache.prices[node], cache.sums[node]
            else:
                cached = self._priced(self.pool.node_gpus[node], None)
                total = sum(c for c, _ in cached)
                if node not in self._touched:  # priced on the ledger's state: good next pass too
                    cache.prices[node], cache.sums[node] = cached, total
                    cache.node_version[node] = self.ledger.node_version[node]
                    cache.valid_until[node] = self._fresh_until(node)
            self._prices[node] = cached
            self._sums[node] = total
        return cached

    def _fresh_until(self, node: int) -> float:
        """When the first shard on `node` still within its dwell time leaves it (inf: none)."""
        until = float("inf")
        for g in self.pool.node_gpus[node]:
            key = self.pool.state[g]
            if key is not None and key is not LOCKED:
                t = self.pool.shards[key].since + self.dwell_s
                if t > self.now:
                    until = min(until, t)
        return until

    def _priced(self, gpus, spec: PipelineSpec | None) -> list[tuple[float, int]]:
        out = []
        for g in gpus:
            key = self.pool.state[g]
            if spec is not None and key is not None and key is not LOCKED and key[0] == spec.name:
                if spec.partial_overlap:
                    out.append((1.0, g))
                continue
            price = self._price(g)
            if price is not None:
                out.append((price, g))
        out.sort()
        return out

    def changed(self, gpus: list[int]) -> None:
        """A grant took these GPUs: forget the prices of their nodes."""
        for g in gpus:
            node = self.pool.node_of[g]
            self._prices.pop(node, None)
            self._sums.pop(node, None)
            self._touched.add(node)
        self._order = None

    # ------------------------------------------------------------------ choice
    def empties(self, spec: PipelineSpec, gpus: list[int], min_priority: int | None = None) -> int:
        """Pipelines with rollout demand (of at least `min_priority`, if given) that would
        lose their last shard if `spec` took these GPUs."""
        taken: dict[str, set] = {}
        for g in gpus:
            key = self.pool.state[g]
            if key is not None and key is not LOCKED and key[0] != spec.name:
                taken.setdefault(key[0], set()).add(key)
        return sum(1 for q, keys in taken.items()
                   if len(keys) >= self.pool.shard_count[q] and self.demand.get(q, 0) > 0
                   and (min_priority is None or self.ledger.pipelines[q].priority >= min_priority))

    def rehomed(self, spec: PipelineSpec, gpus: list[int], min_priority: int | None = None) -> bool:
        """Every pipeline that `empties` counts would find idle GPUs for a shard elsewhere (not in
        `gpus`), so the rebalance of this same plan gives it one at once: taking its last shard
        then starves nobody, and the grant need not wait (an idle GPU beside a waiting trainer
        whose fixed home holds a peer's shard helps no one)."""
        taken: dict[str, set] = {}
        for g in gpus:
            key = self.pool.state[g]
            if key is not None and key is not LOCKED and key[0] != spec.name:
                taken.setdefault(key[0], set()).add(key)
        starved = [q for q, keys in taken.items()
                   if len(keys) >= self.pool.shard_count[q] and self.demand.get(q, 0) > 0
                   and (min_priority is None or self.ledger.pipelines[q].priority >= min_priority)]
        pool = self.pool
        # GPUs per node a starved peer's shard can have in this plan: idle ones and those of the
        # requester's own shards (a pipeline that trains yields its floor shard to one that
        # only generates; see shares.rollout_targets), less the GPUs this grant takes.
        free = list(pool.free_on_node)
        mine = pool.per_node.get(spec.name)
        if mine:
            for nd, n in enumerate(mine):
                if n:
                    free[nd] += n * spec.tp
        for g in gpus:
            key = pool.state[g]
            if key is None or (key is not LOCKED and key[0] == spec.name):
                free[pool.node_of[g]] -= 1
        for q in starved:
            tp = self.ledger.pipelines[q].tp
            node = next((nd for nd, f in enumerate(free) if f >= tp), None)
            if node is None:
                return False
            free[node] -= tp
        return True

    def choose(self, spec: PipelineSpec, n: int) -> list[int] | None:
        pool = self.pool
        home = self.ledger.train_home.get(spec.name)
        if home is not None:
            # Without partial overlap it trains on its fixed home only.
            prices = self._priced(sorted(home), spec)
            return [g for _, g in prices[:n]] if len(prices) >= n else None
        if n <= self.biggest:
            fits = [(f, nd) for nd, f in enumerate(pool.free_on_node) if f >= n]
            if fits:  # a node with enough idle GPUs costs nothing: best fit
                return pool.free_gpus_on(min(fits)[1])[:n]
            best = None
            for nd in range(len(pool.node_gpus)):
                prices = self._node_prices(nd, spec)
                if len(prices) < n:
                    continue
                chosen = [g for _, g in prices[:n]]
                key = (self.empties(spec, chosen), sum(c for c, _ in prices[:n]),
                       len(prices) - n, nd)
                if best is None or key < best[0]:
                    best = (key, chosen)
            if best is not None:
                return best[1]
        # Several nodes: the fullest first, the cheapest GPUs within them. The order of the
        # nodes where the requester has no shard is shared by every request of the pass.
        mine = pool.per_node.get(spec.name)
        own = {nd for nd, k in enumerate(mine) if k} if mine else set()
        own_prices = {nd: self._priced(pool.node_gpus[nd], spec) for nd in own}
        own_keys = sorted((-len(p), sum(c for c, _ in p), nd) for nd, p in own_prices.items())
        shared = self._shared_order()
        if own:
            shared = [k for k in shared if k[2] not in own]
        picked: list[int] = []
        for _, _, nd in heapq.merge(shared, own_keys):
            prices = own_prices[nd] if nd in own else self._prices[nd]
            for _, g in prices:
                if len(picked) == n:
                    return picked
                picked.append(g)
        return picked if len(picked) == n else None

    def _shared_order(self) -> list[tuple[int, float, int]]:
        """(-takeable GPUs, price sum, node) of every node, requester-independent, sorted; kept
        until a grant changes prices."""
        if self._order is None:
            keys = []
            for nd in range(len(self.pool.node_gpus)):
                prices = self._node_prices(nd, None)
                keys.append((-len(prices), self._sums[nd], nd))
            keys.sort()
            self._order = keys
        return self._order
