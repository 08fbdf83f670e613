"""What the engine measures of its own work, for the server's vLLM-named /metrics: per-step token
counts, each token's latency, and each request's phases (queued, prefill, decode) once it leaves.

Why here: only the engine's worker thread sees when a request was scheduled, when each of its
tokens was sampled and how many tokens a step computed; the server's data plane sees a request
from outside (arrival, first token delivered, end). The worker aggregates into plain bucket
counts (`Tally`), cheap enough for the step loop: a step costs one observation, a token an O(1)
comparison (tokens sampled by the same step share one observation: `Tally.observe(value,
times)`), a request a handful of observations when it leaves. Nothing here locks: the worker is
the only writer, and a scrape reads a snapshot (`Tally.snapshot`: a list copy, atomic under the
GIL) from another thread.

The bucket boundaries are vLLM 0.32's defaults (its vllm/v1/metrics/buckets.py), so histograms
scraped from rlix and vLLM line up bucket for bucket on one dashboard.

Preemptions: rlix's engine never preempts. Its KV cache gives each admitted sequence a row of
max_model_len positions for the whole of its life (admission waits for a free row instead), so
no running request is ever evicted and re-queued. Each finished request therefore records 0
preemptions (`request_num_preemptions`), and the engine-wide counter stays at 0.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlix.inference.engine.sequence import Sequence

#: seconds of a request's phases (end to end, queued, prefill, decode, inference)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
#: seconds from a request's arrival to its first token
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
#: seconds between two tokens of one sequence (and a request's mean of them)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
#: tokens one engine step computed (prompt tokens prefilled + tokens sampled)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: a request's `n`
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
#: times one request was preempted
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """Token counts of one request (prompt, output, max_tokens): 1, 2, 5, 10, 20, 50, ... up to
    max_model_len, the most a request can hold."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


class Tally:
    """A histogram's raw state: observations per bucket (bucket i holds values <= bounds[i] and
    > bounds[i-1]; the last one the values above every bound) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Seq[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """Record `value` `times` times (the tokens of one step share their latency)."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times

    def snapshot(self) -> tuple[list[int], float]:
        """(cumulative counts per bound, +Inf last, sum): Prometheus's `le` buckets. Read from
        another thread while the worker writes: each bucket is a consistent copy, the sum may
        lead or lag it by the observations of the moment."""
        counts, total = list(self.counts), self.total
        cumulative, running = [], 0
        for c in counts:
            running += c
            cumulative.append(running)
        return cumulative, total

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(frozen=True)
class Family:
    """One histogram the engine keeps: its vLLM name and help text, and where it lives."""

    name: str
    doc: str
    attr: str


#: the engine's histograms, by their vLLM names (EngineStats attribute holding each)
HISTOGRAMS = (
    Family("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iteration_tokens"),
    Family("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "inter_token"),
    Family("vllm:request_time_per_output_token_seconds",
           "Histogram of time_per_output_token_seconds per request.", "time_per_output_token"),
    Family("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
           "queue_time"),
    Family("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
           "inference_time"),
    Family("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
           "prefill_time"),
    Family("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
           "decode_time"),
    Family("vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
           "num_preemptions"),
    Family("vllm:request_prefill_kv_computed_tokens",
           "Histogram of new KV tokens computed during prefill (excluding cached tokens).", "prefill_computed"),
)


class EngineStats:
    """The engine's own measures (module doc), written by its worker thread only.

    Times are time.monotonic() seconds. A sequence's phases follow vLLM's definitions: queued
    from its arrival at the engine to its admission into the batch, prefill from admission to
    its first token, decode from its first token to its last, inference from admission to its
    last token; its mean time per output token is the decode time over the tokens after the
    first. A request's n samples are sequences of their own here (as vLLM's child requests)."""

    def __init__(self, max_model_len: int) -> None:
        self.iteration_tokens = Tally(ITERATION_TOKENS_BUCKETS)
        self.inter_token = Tally(INTER_TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = Tally(INTER_TOKEN_LATENCY_BUCKETS)
        self.queue_time = Tally(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Tally(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Tally(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Tally(REQUEST_LATENCY_BUCKETS)
        self.num_preemptions = Tally(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.prefill_computed = Tally(request_tokens_buckets(max_model_len))
        #: requests preempted, ever: 0, as the engine never preempts (module doc)
        self.preemptions = 0

    def finished(self, seq: Sequence) -> None:
        """A sequence that was admitted leaves the batch: its phases (module doc). One that
        never got a token (aborted in its prefill step) has no prefill or decode to record."""
        scheduled, first, last = seq.scheduled_at, seq.first_token_at, seq.last_token_at
        self.queue_time.observe(max(0.0, scheduled - seq.arrived_at))
        self.num_preemptions.observe(0)
        self.prefill_computed.observe(len(seq.prompt_token_ids) - seq.cached_prompt_tokens)
        if not first:
            return
        decode = last - first
        self.prefill_time.observe(first - scheduled)
        self.decode_time.observe(decode)
        self.inference_time.observe(last - scheduled)
        generated = len(seq.output_ids)
        self.time_per_output_token.observe(decode / (generated - 1) if generated > 1 else 0.0)
