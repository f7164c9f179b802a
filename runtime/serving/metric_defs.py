"""The ``/metrics`` families, defined once: name, kind, help, labels and histogram buckets. Both
frontends make their metrics from these: infhip-serve through prometheus_client
(runtime/serving/metrics.py ServerMetrics) and the Triton model through Triton's custom metrics
(runtime/serving/triton/metrics.py TritonMetrics, a subset). Meanings: docs/serving.md.

Plain data, no prometheus_client: the Triton model imports it inside Triton's stub.
"""

from __future__ import annotations

from dataclasses import dataclass

# histogram buckets (seconds)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


@dataclass(frozen=True)
class MetricDef:
    """One family. ``name`` as prometheus_client takes it: a counter's exposed family gets
    "_total" appended (``family``), which is the name Triton is given."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only

    @property
    def family(self) -> str:
        """The family's name as a scrape shows it."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


def _counter(name: str, what: str, *labels: str) -> MetricDef:
    return MetricDef(name, "counter", what, labels)


def _gauge(name: str, what: str, *labels: str) -> MetricDef:
    return MetricDef(name, "gauge", what, labels)


def _histogram(name: str, what: str, buckets: tuple[float, ...]) -> MetricDef:
    return MetricDef(name, "histogram", what, (), buckets)


# -- requests and tokens ---------------------------------------------------------------------------
REQUESTS_RUNNING = _gauge("infhip_requests_running", "Requests holding KV pages (scheduled)")
REQUESTS_WAITING = _gauge("infhip_requests_waiting", "Requests queued, new or preempted")
PROMPT_TOKENS = _counter("infhip_prompt_tokens", "Prompt tokens of accepted requests")
GENERATION_TOKENS = _counter("infhip_generation_tokens", "Tokens generated")
REQUESTS_FINISHED = _counter("infhip_requests_finished", "Requests that ended, by finish reason", "finish_reason")
REQUEST_SUCCESS = _counter("infhip_request_success", "Requests that ended by themselves, by finish reason "
                           "(stop, length)", "finish_reason")
REQUEST_ABORTS = _counter("infhip_request_aborts", "Requests aborted because their client left")
REQUEST_ERRORS = _counter("infhip_request_errors", "Requests failed by the engine: alone (scope=request) or "
                          "with a whole step (scope=engine)", "scope")

# -- latencies: per token, and per request (vLLM's e2e / queue / prefill / decode / time per output
# token), observed when a request ends
TTFT = _histogram("infhip_time_to_first_token_seconds",
                  "From the hand-in to the engine (body read, prompt tokenized) to the first token", TTFT_BUCKETS)
ITL = _histogram("infhip_inter_token_latency_seconds",
                 "Time between tokens of a request (a delta of k tokens counts k times its gap / k)", ITL_BUCKETS)
E2E = _histogram("infhip_e2e_request_latency_seconds",
                 "From the hand-in to the engine to the request's end (finished or aborted)", REQUEST_BUCKETS)
QUEUE_TIME = _histogram("infhip_request_queue_time_seconds",
                        "From the hand-in to the step that first gave the request KV pages", REQUEST_BUCKETS)
PREFILL_TIME = _histogram("infhip_request_prefill_time_seconds", "From that first step to the first token",
                          REQUEST_BUCKETS)
DECODE_TIME = _histogram("infhip_request_decode_time_seconds", "From the first token to the last", REQUEST_BUCKETS)
TPOT = _histogram("infhip_time_per_output_token_seconds",
                  "A request's decode time / (its output tokens - 1), requests of 2+ tokens", ITL_BUCKETS)

# -- lifecycle (docs/serving.md, "Lifecycle"): refused at the door, ended by the server
REJECTED = _counter("infhip_requests_rejected", "Requests refused before the engine: reason=queue_full, "
                    "queue_wait or prompt_tokens (429), draining (503)", "reason")
TIMEOUTS = _counter("infhip_request_timeouts", "Requests aborted because their deadline passed")
SHUTDOWN_ABORTS = _counter("infhip_request_shutdown_aborts",
                           "Requests still running when the drain timeout ran out, ended by the server")
PREEMPTIONS = _counter("infhip_preemptions", "Sequences preempted (KV dropped, recomputed later)")

# -- the KV cache and the prefix cache
KV_USAGE = _gauge("infhip_kv_cache_usage_ratio", "Fraction of a KV group's GPU pages in use (0..1)", "group")
KV_USED = _gauge("infhip_kv_pages_used", "KV cache pages in use", "group", "memory")
KV_FREE = _gauge("infhip_kv_pages_free", "KV cache pages free", "group", "memory")
PREFIX_QUERIES = _counter("infhip_prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission")
PREFIX_HITS = _counter("infhip_prefix_cache_hits", "Prompt tokens found in the prefix cache (reused, not recomputed)")
PREFIX_EVICTIONS = _counter("infhip_prefix_cache_evictions", "Cached KV pages evicted for new content")
KV_CACHED = _gauge("infhip_kv_pages_cached",
                   "KV pages holding cached prefix content and no request (counted as free)", "group")
HOST_CACHED = _gauge("infhip_host_pages_cached", "Offloaded (host) KV pages holding cached prefix content and no "
                     "request (counted as free)", "group")

