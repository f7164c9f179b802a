"""`GET /metrics`: Prometheus text from one server's own `CollectorRegistry`.

`ServerMetrics` is the `EngineObserver` of the server's `EngineLoop`: every call comes from the
engine thread, so per-request timing needs no lock; prometheus_client's metrics lock themselves
for the scrape, which runs on the HTTP side. Names and meanings: docs/serving.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infhip.runtime.attention import backends
from infhip.runtime.sequence import SequenceStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


@dataclass
class _Timing:
    req: object  # the EngineCore's Request (runtime/requests.py)
    submitted: float  # monotonic time of EngineLoop.submit
    scheduled: float | None = None  # when the step that first gave it KV pages began (~ the sample before it)
    first_token: float | None = None
    last_token: float | None = None  # of the last delta with tokens; None before the first
    num_tokens: int = 0


class ServerMetrics:
    def __init__(self, llm):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.running = Gauge("infhip_requests_running", "Requests holding KV pages (scheduled)", registry=r)
        self.waiting = Gauge("infhip_requests_waiting", "Requests queued, new or preempted", registry=r)
        self.ttft = Histogram("infhip_time_to_first_token_seconds",
                              "From the hand-in to the engine (body read, prompt tokenized) to the first token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("infhip_inter_token_latency_seconds",
                             "Time between tokens of a request (a delta of k tokens counts k times its gap / k)",
                             buckets=_ITL_BUCKETS, registry=r)
        self.prompt_tokens = Counter("infhip_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("infhip_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("infhip_requests_finished", "Requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.aborts = Counter("infhip_request_aborts", "Requests aborted because their client left",
                              registry=r)
        self.errors = Counter("infhip_request_errors",
                              "Requests failed by the engine: alone (scope=request) or with a whole step (scope=engine)",
                              ["scope"], registry=r)
        # The request-level latencies the serving world reads (vLLM's e2e / queue / prefill /
        # decode / time-per-output-token), observed when a request ends.
        self.e2e = Histogram("infhip_e2e_request_latency_seconds",
                             "From the hand-in to the engine to the request's end (finished or aborted)",
                             buckets=_REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("infhip_request_queue_time_seconds",
                                    "From the hand-in to the step that first gave the request KV pages",
                                    buckets=_REQUEST_BUCKETS, registry=r)
        self.prefill_time = Histogram("infhip_request_prefill_time_seconds",
                                      "From that first step to the first token", buckets=_REQUEST_BUCKETS, registry=r)
        self.decode_time = Histogram("infhip_request_decode_time_seconds",
                                     "From the first token to the last", buckets=_REQUEST_BUCKETS, registry=r)
        self.tpot = Histogram("infhip_time_per_output_token_seconds",
                              "A request's decode time / (its output tokens - 1), requests of 2+ tokens",
                              buckets=_ITL_BUCKETS, registry=r)
        self.success = Counter("infhip_request_success", "Requests that ended by themselves, by finish reason "
                               "(stop, length)", ["finish_reason"], registry=r)
        self.kv_usage = Gauge("infhip_kv_cache_usage_ratio", "Fraction of a KV group's GPU pages in use (0..1)",
                              ["group"], registry=r)
        # Lifecycle (docs/serving.md, "Lifecycle"): requests refused at the door, and ended by the server.
        self.rejected = Counter("infhip_requests_rejected",
                                "Requests refused before the engine: reason=queue_full, queue_wait or "
                                "prompt_tokens (429), draining (503)", ["reason"], registry=r)
        self.timeouts = Counter("infhip_request_timeouts", "Requests aborted because their deadline passed",
                                registry=r)
        self.shutdown_aborts = Counter("infhip_request_shutdown_aborts",
                                       "Requests still running when the drain timeout ran out, ended by the server",
                                       registry=r)
        self.preemptions = Counter("infhip_preemptions", "Sequences preempted (KV dropped, recomputed later)",
                                   registry=r)
        self.kv_used = Gauge("infhip_kv_pages_used", "KV cache pages in use", ["group", "memory"], registry=r)
        self.kv_free = Gauge("infhip_kv_pages_free", "KV cache pages free", ["group", "memory"], registry=r)
        self.prefix_queries = Counter("infhip_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache at admission", registry=r)
        self.prefix_hits = Counter("infhip_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache (reused, not recomputed)", registry=r)
        self.prefix_evictions = Counter("infhip_prefix_cache_evictions",
                                        "Cached KV pages evicted for new content", registry=r)
        self.kv_cached = Gauge("infhip_kv_pages_cached",
                               "KV pages holding cached prefix content and no request (counted as free)",
                               ["group"], registry=r)
        self.host_cached = Gauge("infhip_host_pages_cached",
                                 "Offloaded (host) KV pages holding cached prefix content and no request "
                                 "(counted as free)", ["group"], registry=r)
        self._preemptions_seen = 0
        self._last_sample = time.monotonic()
        for reason in ("stop", "length"):
            self.success.labels(finish_reason=reason)
        for reason in ("queue_full", "queue_wait", "prompt_tokens", "draining"):
            self.rejected.labels(reason=reason)
        self._prefix_seen = (0, 0, 0)
        self._timing: dict[int, _Timing] = {}  # seq_id -> timing of a live request
        self.meter = None  # admission.WorkMeter: the engine's measured throughput (set by the server)
        config = llm.engine.config
        plan = config.plan
        # the attention backends' own counters of finished requests (runtime/attention/backend.py)
        self.backend_counters = [(Counter(rc.name, rc.help, registry=r), rc.counts)
                                 for cls in backends() if cls.knobs_of(config) is not None
                                 for rc in cls.request_counters(config)]
        self._token_drop = plan.token_drop is not None
        # the drop histories are the transform's (runtime/token_drop_transform.py drop_history)
        self._drops = llm.runner.transforms.get("token_drop") if self._token_drop else None
        if self._token_drop:
            self.drop_requests = Counter("infhip_token_drop_requests",
                                         "Finished requests whose prefill dropped tokens (UniPrefill)", registry=r)
            self.dropped_kv = Counter("infhip_token_drop_skipped_kv",
                                      "Token-layer KV entries not written because the token was dropped "
                                      "(sum over layers of the request's drop history, at finish)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # -- EngineObserver (engine thread) ---------------------------------------------------------
    def accepted(self, req, submitted: float) -> None:
        self._timing[req.seq.seq_id] = _Timing(req, submitted)
        self.prompt_tokens.inc(req.seq.num_prompt_tokens)

    def delta(self, req, delta) -> None:
        n = len(delta.token_ids)
        timing = self._timing.get(req.seq.seq_id)
        if n and timing is not None:
            now = time.monotonic()
            if timing.last_token is None:
                if self.meter is not None:  # the prefill is done: its tokens were work
                    self.meter.add(req.seq.num_prompt_tokens - (delta.num_cached_tokens or 0))
                self.ttft.observe(now - timing.submitted)
                self._scheduled(timing)
                timing.first_token = now
            else:
                for _ in range(n):
                    self.itl.observe((now - timing.last_token) / n)
            timing.last_token = now
            timing.num_tokens += n
        self.generation_tokens.inc(n)
        if self.meter is not None:
            self.meter.add(n)
        if delta.finish_reason == "error":
            self.errors.labels(scope="request").inc()

    def gone(self, req, aborted: bool, cause: str = "client") -> None:
        timing = self._timing.pop(req.seq.seq_id, None)
        seq = req.seq
        if aborted:
            {"client": self.aborts, "deadline": self.timeouts, "shutdown": self.shutdown_aborts}[cause].inc()
        reason = seq.finish_reason or "abort"
        self.finished.labels(finish_reason=reason).inc()
        if reason in ("stop", "length"):
            self.success.labels(finish_reason=reason).inc()
        if timing is not None:
            self._request_times(timing)
        for counter, counts in self.backend_counters:
            if counts(seq):
                counter.inc()
        history = self._drops.drop_history(seq.seq_id) if self._drops is not None else None
        if history and any(history):
            self.drop_requests.inc()
            self.dropped_kv.inc(sum(history))

    def _scheduled(self, timing: _Timing) -> None:
        """Note when the request first got KV pages (once): the step that did it began right
        after the previous sample."""
        if timing.scheduled is None:
            timing.scheduled = max(timing.submitted, self._last_sample)
            self.queue_time.observe(timing.scheduled - timing.submitted)

    def _request_times(self, t: _Timing) -> None:
        """The request-level histograms of a request that ended."""
        now = time.monotonic()
        self.e2e.observe(now - t.submitted)
        if t.first_token is not None:
            self.prefill_time.observe(t.first_token - t.scheduled)
            self.decode_time.observe(t.last_token - t.first_token)
            if t.num_tokens > 1:
                self.tpot.observe((t.last_token - t.first_token) / (t.num_tokens - 1))

    def step_failed(self, num_requests: int) -> None:
        self.errors.labels(scope="engine").inc(num_requests)
        self._timing.clear()

    def sample(self, llm) -> None:
        """Gauges after a loop turn: queue lengths, KV pages per group (GPU and host pools)."""
        sched, kv = llm.scheduler, llm.runner.kv
        for timing in self._timing.values():
            if timing.scheduled is None and timing.req.seq.status is not SequenceStatus.WAITING:
                self._scheduled(timing)
        self._last_sample = time.monotonic()
        if self.meter is not None:
            self.meter.turn_done()
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.preemptions.inc(sched.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = sched.num_preemptions
        now = (kv.prefix_cache_queries, kv.prefix_cache_hits, kv.prefix_cache_evictions)
        for counter, n, seen in zip((self.prefix_queries, self.prefix_hits, self.prefix_evictions), now,
                                    self._prefix_seen):
            counter.inc(n - seen)
        self._prefix_seen = now
        for group, spec in kv.groups.items():
            free = kv.num_free_pages(group)
            self.kv_free.labels(group=group, memory="gpu").set(free)
            self.kv_used.labels(group=group, memory="gpu").set(spec.num_pages - 1 - free)  # page 0 is the null page
            self.kv_usage.labels(group=group).set((spec.num_pages - 1 - free) / (spec.num_pages - 1))
            self.kv_cached.labels(group=group).set(kv.num_cached_pages(group))
            if spec.offload is not None:
                host_free = kv.num_free_host_pages(group)
                self.kv_free.labels(group=group, memory="host").set(host_free)
                self.kv_used.labels(group=group, memory="host").set(spec.offload.host_pages - host_free)
                self.host_cached.labels(group=group).set(kv.num_cached_host_pages(group))
