"""The engine server's Prometheus metrics (`GET /metrics`): vLLM 0.32's engine families, under
its names, types, label names and histogram buckets, so dashboards, alerts and tools that watch
vLLM servers watch rlix's too. One registry per app. Labels are vLLM's: engine ("0": one engine
per server), model_name, and a family's own (finished_reason, reason, source, sleep_state).

Where each value comes from (one owner each):

- the data plane (serving.py), per request as it sees it from outside, into prometheus_client
  metrics here: vllm:prompt_tokens (each sample's prompt once it is prefilled, as vLLM counts
  its child requests'), vllm:generation_tokens, vllm:request_success{finished_reason},
  and per sample at its end vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds
  (both from the request's arrival at the server), vllm:request_prompt_tokens,
  vllm:request_generation_tokens, vllm:request_params_max_tokens; per request
  vllm:request_params_n and vllm:request_max_num_generation_tokens (its longest sample);
- the engine's own measures (engine/stats.py), read at scrape time: vllm:iteration_tokens_total,
  vllm:inter_token_latency_seconds, vllm:request_time_per_output_token_seconds, the phase
  histograms vllm:request_{queue,prefill,decode,inference}_time_seconds,
  vllm:request_num_preemptions, vllm:request_prefill_kv_computed_tokens, vllm:num_preemptions;
  the prefix cache's vllm:prefix_cache_queries / vllm:prefix_cache_hits (tokens); the prompt
  tokens by where their keys and values came from, vllm:prompt_tokens_by_source (local_compute:
  prefilled; local_cache_hit: the prefix cache's hits, and the prompts of a request's samples
  after the first, which copy its prefill), vllm:prompt_tokens_cached(_by_source) (the latter);
- the engine's state, read at scrape time: vllm:num_requests_running, vllm:num_requests_waiting
  (the fleet's drain reads these two), vllm:num_requests_waiting_by_reason (capacity: waiting for
  a free row; deferred: held by a pause), vllm:engine_sleep_state, vllm:kv_cache_usage_perc (and
  vllm:gpu_cache_usage_perc, its older name), vllm:cache_config_info, rlix:weight_version,
  rlix:prefix_cache_hit_tokens.

Families vLLM always exports that stand for something rlix does not have are exported too, with
vLLM's type and labels, at zero (docs/INFERENCE_SERVING.md lists them): vllm:num_preemptions
(the engine never preempts: engine/stats.py), vllm:external_prefix_cache_queries/hits (no KV
connector shares caches across instances), vllm:mm_cache_queries/hits (text only, no
multi-modal cache), vllm:admission_rejections (no queue-length limit: a request waits in the
engine's queue, it is never refused for the queue's length), vllm:estimated_{flops,read_bytes,
write_bytes}_per_gpu (vLLM fills them only with its opt-in per-step FLOP model; rlix has none),
and the cache tiers other than "device" of vllm:prompt_tokens_cached_by_source (the prefix cache
keeps its entries on the engine's device only).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from rlix.inference.engine.api import EngineAPI
from rlix.inference.engine.stats import (HISTOGRAMS, REQUEST_LATENCY_BUCKETS, REQUEST_PARAMS_N_BUCKETS,
                                         TIME_TO_FIRST_TOKEN_BUCKETS, EngineStats, Tally,
                                         request_tokens_buckets)

LABELS = ["engine", "model_name"]
#: vLLM's finish reasons, each counted from zero on (its request_success labels)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
#: vLLM's admission limits (--max-num-queued-reqs / -tokens); rlix's server has neither
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
#: vLLM's sources of prompt tokens: computed here, taken from this engine's prefix cache, or
#: received from another instance (KV transfer: none in rlix)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: vLLM's cache tiers a prefix cache hit comes from; rlix's prefix cache lives on the device
CACHE_TIERS = ("device", "host", "p2p", "disk", "external_unspecified")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
#: vLLM 0.32's cache_config_info labels (its CacheConfig fields). rlix fills those it has an
#: equivalent for (_cache_config); the others read "None", as vLLM writes an unset field.
CACHE_CONFIG_LABELS = (
    "_block_size_resolved", "block_size", "cache_dtype", "cache_hit_alignment_tokens",
    "effective_attention_block_size", "enable_mamba_shared_prefix_checkpoint", "enable_prefix_caching",
    "gpu_memory_utilization", "hash_block_size", "is_attention_free", "kv_cache_dtype_skip_layers",
    "kv_cache_layout", "kv_cache_max_concurrency", "kv_cache_memory_bytes", "kv_cache_size_tokens",
    "kv_offloading_backend", "kv_offloading_size", "kv_sharing_fast_prefill", "mamba_block_size",
    "mamba_cache_dtype", "mamba_cache_mode", "mamba_page_size_padded", "mamba_ssm_cache_dtype",
    "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override", "prefix_cache_retention_interval",
    "prefix_caching_hash_algo", "prefix_match_unit", "replayssm_buffer_len", "skip_page_size_padded",
    "sliding_window", "swa_bounded_replay", "use_kda_recoverssm", "use_replayssm",
    "user_specified_block_size")


class EngineMetrics:
    """See module doc. `engine_index`: vLLM's `engine` label (one engine per server: "0")."""

    def __init__(self, engine: EngineAPI, model_name: str, engine_index: str = "0") -> None:
        self.engine = engine
        self.labels = (engine_index, model_name)
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        token_buckets = request_tokens_buckets(engine.max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self.labels)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     LABELS, registry=r).labels(*self.labels)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         LABELS, registry=r).labels(*self.labels)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELS + ["finished_reason"], registry=r)
        self._success = {reason: success.labels(*self.labels, reason) for reason in FINISH_REASONS}
        # no queue limit to refuse a request for (module doc): vLLM's family, at zero
        rejections = Counter("vllm:admission_rejections",
                             "Number of admission attempts rejected by a queue limit, by reason.",
                             ["model_name", "reason"], registry=r)
        for reason in ADMISSION_REASONS:
            rejections.labels(model_name, reason)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", token_buckets)
        self.request_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                   REQUEST_PARAMS_N_BUCKETS)
        self.request_max_generated = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)
        r.register(_EngineState(self))

    def tokens(self, prompt: int, generated: int) -> None:
        """Tokens as they are processed: a prompt once it is prefilled, output tokens per step."""
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generated:
            self.generation_tokens.inc(generated)

    def sample_done(self, *, prompt_tokens: int, generation_tokens: int, max_tokens: int,
                    finish_reason: str, ttft_s: float | None, e2e_s: float) -> None:
        """One sample (one of a request's n) ended: finish_reason is vLLM's, "abort" for one
        whose caller left and "error" for one the engine failed."""
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))
        self._success[finish_reason if finish_reason in self._success else "stop"].inc()
        self.e2e.observe(max(0.0, e2e_s))
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.request_max_tokens.observe(max_tokens)

    def request_done(self, *, n: int, generated: list[int]) -> None:
        """Every sample of one request ended: its n, and the output tokens of its longest sample."""
        self.request_n.observe(n)
        self.request_max_generated.observe(max(generated, default=0))

    def text(self) -> bytes:
        return generate_latest(self.registry)


def _histogram(name: str, doc: str, tally: Tally, labels: list[str]) -> HistogramMetricFamily:
    cumulative, total = tally.snapshot()
    bounds = [*(_bound(b) for b in tally.bounds), "+Inf"]
    family = HistogramMetricFamily(name, doc, labels=LABELS)
    family.add_metric(labels, list(zip(bounds, cumulative)), total)
    return family


def _bound(value: float) -> str:
    """A bucket's `le` as prometheus_client writes its own (floatToGoString: 1 -> "1.0")."""
    return repr(float(value))


def _counter(name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=LABELS)
    family.add_metric(labels, float(value))
    return family


class _EngineState:
    """Families read from the engine at scrape time (prometheus_client's collector protocol).
    An EngineAPI that cannot tell one of them (a test's fake engine) leaves out what needs it,
    or reports it at zero where vLLM always has it."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self._cache_config = _cache_config(metrics.engine)

    def collect(self) -> Iterator[Metric]:
        engine, labels = self.metrics.engine, list(self.metrics.labels)
        yield from self._gauges(engine, labels)
        yield from self._prefix_cache(engine, labels)
        stats: EngineStats | None = getattr(engine, "stats", None)
        yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels,
                       stats.preemptions if stats is not None else 0)
        if stats is not None:
            for fam in HISTOGRAMS:
                yield _histogram(fam.name, fam.doc, getattr(stats, fam.attr), labels)
        # no multi-modal input, hence no multi-modal cache; no FLOP model (module doc)
        for name, doc in (
            ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
            ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
            ("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations per GPU "
             "(for Model Flops Utilization calculations)."),
            ("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU "
             "(for Model Flops Utilization calculations)."),
            ("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU "
             "(for Model Flops Utilization calculations)."),
        ):
            yield _counter(name, doc, labels, 0)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["engine", *CACHE_CONFIG_LABELS])
        info.add_metric([labels[0], *(self._cache_config[k] for k in CACHE_CONFIG_LABELS)], 1.0)
        yield info

    def _gauges(self, engine: EngineAPI, labels: list[str]) -> Iterator[Metric]:
        usage = getattr(engine, "kv_cache_usage", None)  # not every EngineAPI can tell
        waiting = engine.num_waiting()
        deferred_of = getattr(engine, "num_waiting_deferred", None)
        deferred = deferred_of() if deferred_of is not None else 0
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             engine.num_running()),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
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
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason: 'capacity' = waiting for a free row of the batch; "
            "'deferred' = held by a pause until resume. Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*LABELS, "reason"])
        by_reason.add_metric([*labels, "capacity"], float(waiting - deferred))
        by_reason.add_metric([*labels, "deferred"], float(deferred))
        yield by_reason
        level_of = getattr(engine, "sleep_level", None)
        level = level_of() if level_of is not None else int(engine.is_sleeping())
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            labels=[*LABELS, "sleep_state"])
        for state, on in zip(SLEEP_STATES, (level == 0, level == 1, level == 2)):
            sleep.add_metric([*labels, state], float(on))
        yield sleep

    def _prefix_cache(self, engine: EngineAPI, labels: list[str]) -> Iterator[Metric]:
        """The prefix cache's queries and hits (tokens), and the prompt tokens by where their
        keys and values came from: computed (prefilled) or the prefix cache (on the device)."""
        hits = getattr(engine, "prefix_hit_tokens", 0)
        queried = getattr(engine, "prefix_queried_tokens", 0)
        computed = getattr(engine, "prefill_tokens", 0)
        cached = hits + getattr(engine, "forked_prompt_tokens", 0)  # not computed: copied on the device
        yield _counter("vllm:prefix_cache_queries",
                       "Prefix cache queries, in terms of number of queried tokens.", labels, queried)
        yield _counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                       labels, hits)
        # no KV connector: no cache shared with other instances (module doc)
        yield _counter("vllm:external_prefix_cache_queries",
                       "External prefix cache queries from KV connector cross-instance cache sharing, "
                       "in terms of number of queried tokens.", labels, 0)
        yield _counter("vllm:external_prefix_cache_hits",
                       "External prefix cache hits from KV connector cross-instance cache sharing, "
                       "in terms of number of cached tokens.", labels, 0)
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                        labels=[*LABELS, "source"])
        for source, value in zip(PROMPT_SOURCES, (computed, cached, 0)):
            by_source.add_metric([*labels, source], float(value))
        yield by_source
        yield _counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                       labels, cached)
        by_tier = CounterMetricFamily(
            "vllm:prompt_tokens_cached_by_source",
            "Cached prompt tokens by the cache tier that supplied them (rlix: the device only).",
            labels=[*LABELS, "source"])
        for tier in CACHE_TIERS:
            by_tier.add_metric([*labels, tier], float(cached if tier == "device" else 0))
        yield by_tier


def _cache_config(engine: EngineAPI) -> dict[str, str]:
    """cache_config_info's label values: rlix's KV cache described in vLLM's fields where one
    fits (a slot cache: one row of max_model_len positions per sequence, max_num_seqs rows)."""
    rows = getattr(engine, "max_num_seqs", None)
    out = dict.fromkeys(CACHE_CONFIG_LABELS, "None")
    out.update(cache_dtype="auto", is_attention_free="False",
               enable_prefix_caching=str(bool(getattr(engine, "prefix_caching", False))))
    if rows is not None:
        out.update(kv_cache_max_concurrency=str(float(rows)),
                   kv_cache_size_tokens=str(rows * engine.max_model_len))
    return out
