"""`GET /metrics`: Prometheus text from one server's own `CollectorRegistry`.

`ServerMetrics` is the `EngineObserver` of the server's `EngineLoop`: every call comes from the
engine thread, so per-request timing needs no lock; prometheus_client's metrics lock themselves
for the scrape, which runs on the HTTP side. Names and meanings: docs/serving.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from infhip.runtime.serving import metric_defs as M
from infhip.runtime.serving.metric_defs import MetricDef
from infhip.runtime.sequence import SequenceStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _make(d: MetricDef, registry: CollectorRegistry):
    """The prometheus_client metric of definition ``d`` (metric_defs.py), in ``registry``."""
    if d.kind == "histogram":
        return Histogram(d.name, d.help, buckets=d.buckets, registry=registry)
    return {"counter": Counter, "gauge": Gauge}[d.kind](d.name, d.help, list(d.labels), registry=registry)


@dataclass
class _Timing:
    req: object  # the EngineCore's Request (runtime/requests.py)
    submitted: float  # monotonic time of EngineLoop.submit
    scheduled: float | None = None  # when the step that first gave it KV pages began (~ the sample before it)
    first_token: float | None = None
    last_token: float | None = None  # of the last delta with tokens; None before the first
    num_tokens: int = 0


class ServerMetrics:
    def __init__(self, info):
        """info: the engine's EngineInfo (EngineLoop.info): its methods' request counters."""
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.running, self.waiting = _make(M.REQUESTS_RUNNING, r), _make(M.REQUESTS_WAITING, r)
        self.ttft, self.itl = _make(M.TTFT, r), _make(M.ITL, r)
        self.prompt_tokens, self.generation_tokens = _make(M.PROMPT_TOKENS, r), _make(M.GENERATION_TOKENS, r)
        self.finished, self.aborts = _make(M.REQUESTS_FINISHED, r), _make(M.REQUEST_ABORTS, r)
        self.errors = _make(M.REQUEST_ERRORS, r)
        self.e2e, self.queue_time = _make(M.E2E, r), _make(M.QUEUE_TIME, r)
        self.prefill_time, self.decode_time = _make(M.PREFILL_TIME, r), _make(M.DECODE_TIME, r)
        self.tpot = _make(M.TPOT, r)
        self.success, self.kv_usage = _make(M.REQUEST_SUCCESS, r), _make(M.KV_USAGE, r)
        self.rejected, self.timeouts = _make(M.REJECTED, r), _make(M.TIMEOUTS, r)
        self.shutdown_aborts, self.preemptions = _make(M.SHUTDOWN_ABORTS, r), _make(M.PREEMPTIONS, r)
        self.kv_used, self.kv_free = _make(M.KV_USED, r), _make(M.KV_FREE, r)
        self.prefix_queries, self.prefix_hits = _make(M.PREFIX_QUERIES, r), _make(M.PREFIX_HITS, r)
        self.prefix_evictions = _make(M.PREFIX_EVICTIONS, r)
        self.kv_cached, self.host_cached = _make(M.KV_CACHED, r), _make(M.HOST_CACHED, r)
        self._preemptions_seen = 0
        self._last_sample = time.monotonic()
        for reason in ("stop", "length"):
            self.success.labels(finish_reason=reason)
        for reason in ("queue_full", "queue_wait", "prompt_tokens", "draining"):
            self.rejected.labels(reason=reason)
        self._prefix_seen = (0, 0, 0)
        self._timing: dict[int, _Timing] = {}  # seq_id -> timing of a live request
        self.meter = None  # admission.WorkMeter: the engine's measured throughput (set by the server)
        # the attention backends' and the step transforms' own counters of finished requests, of
        # those the engine loaded with (runtime/attention/backend.py RequestCounter)
        self.method_counters = [(Counter(rc.name, rc.help, registry=r), rc.counts) for rc in info.request_counters]

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
        for counter, counts in self.method_counters:
            amount = counts(seq)
            if amount:
                counter.inc(float(amount))

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

    def sample(self, stats) -> None:
        """Gauges after a loop turn (stats: its EngineStats): queue lengths, KV pages per group
        (GPU and host pools)."""
        for timing in self._timing.values():
            if timing.scheduled is None and timing.req.seq.status is not SequenceStatus.WAITING:
                self._scheduled(timing)
        self._last_sample = time.monotonic()
        if self.meter is not None:
            self.meter.turn_done()
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.preemptions.inc(stats.num_preemptions - self._preemptions_seen)
        self._preemptions_seen = stats.num_preemptions
        now = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.prefix_cache_evictions)
        for counter, n, seen in zip((self.prefix_queries, self.prefix_hits, self.prefix_evictions), now,
                                    self._prefix_seen):
            counter.inc(n - seen)
        self._prefix_seen = now
        for group, free in stats.kv_pages_free.items():
            used = stats.kv_pages_used[group]
            self.kv_free.labels(group=group, memory="gpu").set(free)
            self.kv_used.labels(group=group, memory="gpu").set(used)
            self.kv_usage.labels(group=group).set(used / (used + free))
            self.kv_cached.labels(group=group).set(stats.kv_pages_cached.get(group, 0))
        for group, host_free in stats.host_pages_free.items():
            self.kv_free.labels(group=group, memory="host").set(host_free)
            self.kv_used.labels(group=group, memory="host").set(stats.host_pages_used[group])
            self.host_cached.labels(group=group).set(stats.host_pages_cached.get(group, 0))
