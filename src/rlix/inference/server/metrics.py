"""The engine server's Prometheus metrics (`GET /metrics`), under vLLM's names where vLLM has one,
so dashboards and tools that watch vLLM servers watch rlix's too. One registry per app.

Scrape-time gauges read the engine: vllm:num_requests_running, vllm:num_requests_waiting (the
fleet's drain reads these two), vllm:kv_cache_usage_perc (and vllm:gpu_cache_usage_perc, its
older name), rlix:weight_version. Per request, recorded by the data plane when a request ends
(`request_done`; tokens as they are produced): vllm:prompt_tokens_total,
vllm:generation_tokens_total, vllm:request_success_total{finished_reason},
vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds, vllm:request_prompt_tokens,
vllm:request_generation_tokens. Labels are vLLM's: engine, model_name.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from rlix.inference.engine.api import EngineAPI

LABELS = ["engine", "model_name"]
#: seconds to the first token: a prefill on a busy shard up to a request held behind a sleep
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: seconds from arrival to the last token
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
#: tokens in one request's prompt or output
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class EngineMetrics:
    """See module doc. `engine_index`: vLLM's `engine` label (one engine per server: "0")."""

    def __init__(self, engine: EngineAPI, model_name: str, engine_index: str = "0") -> None:
        self.engine = engine
        self.labels = (engine_index, model_name)
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     LABELS, registry=r).labels(*self.labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         LABELS, registry=r).labels(*self.labels)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                LABELS + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS, registry=r).labels(*self.labels)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", LABELS, buckets=E2E_BUCKETS,
                             registry=r).labels(*self.labels)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed per request.", LABELS,
            buckets=TOKEN_BUCKETS, registry=r).labels(*self.labels)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed per request.", LABELS,
            buckets=TOKEN_BUCKETS, registry=r).labels(*self.labels)
        r.register(_EngineGauges(self))

    def tokens(self, prompt: int, generated: int) -> None:
        """Tokens as they are processed: a prompt once it is prefilled, output tokens per step."""
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generated:
            self.generation_tokens.inc(generated)

    def request_done(self, *, prompt_tokens: int, generation_tokens: int, finish_reason: str | None,
                     ttft_s: float | None, e2e_s: float) -> None:
        """One request ended (`finish_reason` None: it failed or its caller left before the end)."""
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))
        if finish_reason is None:
            return
        self._success.labels(*self.labels, finish_reason).inc()
        self.e2e.observe(max(0.0, e2e_s))
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineGauges:
    """Scrape-time gauges read from the engine (prometheus_client's collector protocol)."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        engine, labels = self.metrics.engine, list(self.metrics.labels)
        usage = getattr(engine, "kv_cache_usage", None)  # not every EngineAPI can tell
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             engine.num_running()),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting()),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             usage() if usage is not None else None),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage (vLLM's older name). 1 means 100 percent usage.",
             usage() if usage is not None else None),
            ("rlix:weight_version", "Weight version being served.", engine.weight_version),
            ("rlix:prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache instead of "
             "prefilled, since the start.", getattr(engine, "prefix_hit_tokens", None)),
        ):
            if value is None:
                continue
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, float(value))
            yield g
