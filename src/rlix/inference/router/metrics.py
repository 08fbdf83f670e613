"""The router's Prometheus metrics (`GET /metrics`), typed so that a scraper knows what it reads.

Every family is read from the router at scrape time (the relay's counts and the shard table), so
no second copy of the counts is kept and none can drift from what `Relay` and the pipeline
summaries report. Families are built with prometheus_client's metric families and written by its
exposition code, as vLLM's /metrics is: each has `# HELP` and `# TYPE`; a counter's sample ends in
`_total` and its TYPE line names it so (Prometheus text format 0.0.4), which parsers file under
the family without the suffix. A family left untyped parses as "unknown", which a scraper cannot
tell from a gauge.

Counters: rlix:router_requests_total (requests the router took in; an n > 1 request counts once),
rlix:router_redispatched_total (attempts sent again after their shard was preempted or went
down; a cut n > 1 request counts each cut sample), rlix:router_shards_marked_down_total (times a
shard was found unreachable and marked DOWN). Gauge: rlix:router_outstanding{rank,state}
(requests a shard holds now, with its state in the router's table).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rlix.inference.router.relay import Relay
from rlix.inference.router.shard_table import ShardTable


class RouterMetrics:
    """See module doc. One registry per router app (two apps in one process must not share
    prometheus_client's global registry, nor each other's counts)."""

    def __init__(self, relay: Relay, table: ShardTable) -> None:
        self.relay, self.table = relay, table
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        """prometheus_client's collector protocol: the families as they stand now."""
        relay = self.relay
        for name, doc, value in (
            ("rlix:router_requests", "Requests the router took in (an n > 1 request counts once).",
             relay.requests),
            ("rlix:router_redispatched", "Attempts sent again to another shard after theirs was "
             "preempted or went down.", relay.redispatched),
            ("rlix:router_shards_marked_down", "Times a shard was found unreachable and marked DOWN.",
             relay.down_marks),
        ):
            yield CounterMetricFamily(name, doc, value=float(value))
        outstanding = GaugeMetricFamily("rlix:router_outstanding",
                                        "Requests a shard holds now, by rank and its state in the table.",
                                        labels=["rank", "state"])
        for shard in self.table.shards.values():
            outstanding.add_metric([str(shard.rank), shard.state.value], float(shard.outstanding))
        yield outstanding

    def text(self) -> bytes:
        """The exposition page (Prometheus text format)."""
        return generate_latest(self.registry)
