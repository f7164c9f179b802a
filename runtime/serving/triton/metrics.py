"""infhip-serve's ``/metrics`` families for the Triton model (runtime/serving/triton/model.py),
through Triton's custom metrics (``pb_utils.MetricFamily``). Imported by the model once infhip is
importable in Triton's stub; ``triton_python_backend_utils`` exists only there (or a test's fake).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

_FLUSH_S = 0.25  # how often the metrics reach Triton (each metric update is a call to the server)
# The buckets of infhip-serve's histograms (seconds).
_TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5]
_REQUEST_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800]


class Clock:
    """One request's token timing, kept by its responder thread."""

    def __init__(self):
        self.submitted = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None  # when the last delta with tokens came; None before the first
        self.num_tokens = 0


class _Pending:
    """What the responders recorded since the last flush."""

    def __init__(self):
        self.prompt_tokens = self.generation_tokens = self.aborts = 0
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.e2e: list[float] = []
        self.decode: list[float] = []
        self.tpot: list[float] = []
        self.finished: Counter = Counter()  # finish_reason -> requests
        self.errors: Counter = Counter()  # scope -> requests


class TritonMetrics:
    """infhip-serve's /metrics through Triton's custom metrics (``pb_utils.MetricFamily``):
    the same family names, meanings and histogram buckets, each metric labelled with the
    Triton model and version. Responder threads record under a lock; one thread hands the
    records to Triton every _FLUSH_S and samples the engine's queue and KV gauges (every Triton
    metric call is a round trip to the server process, kept off the responders' path)."""

    def __init__(self, llm, labels: dict[str, str]):
        self._llm, self._labels = llm, labels
        self._families: dict[str, object] = {}
        self._metrics: dict[tuple, object] = {}  # (family, label values) -> Metric
        self._lock = threading.Lock()
        self._pending = _Pending()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="infhip-triton-metrics", daemon=True)
        self._thread.start()

    # -- recording (responder threads) ---------------------------------------------------------
    def accepted(self, prompt_tokens: int) -> None:
        with self._lock:
            self._pending.prompt_tokens += prompt_tokens

    def tokens(self, clock: Clock, n: int) -> None:
        """A delta of n tokens: the first token's latency, or n gaps of (time since the last
        delta) / n."""
        if not n:
            return
        now = time.monotonic()
        with self._lock:
            self._pending.generation_tokens += n
            if clock.last_token is None:
                self._pending.ttft.append(now - clock.submitted)
                clock.first_token = now
            else:
                self._pending.itl += [(now - clock.last_token) / n] * n
        clock.last_token = now
        clock.num_tokens += n

    def ended(self, clock: Clock) -> None:
        """A request's end (however it ended): its e2e latency, decode time and time per output token."""
        now = time.monotonic()
        with self._lock:
            self._pending.e2e.append(now - clock.submitted)
            if clock.first_token is not None:
                self._pending.decode.append(clock.last_token - clock.first_token)
                if clock.num_tokens > 1:
                    self._pending.tpot.append((clock.last_token - clock.first_token) / (clock.num_tokens - 1))

    def finished(self, reason: str, aborted: bool = False, error_scope: str | None = None) -> None:
        """An accepted request ended: finish_reason stop | length | abort | error; aborted when
        its client left; error_scope when the engine failed it."""
        with self._lock:
            self._pending.finished[reason] += 1
            self._pending.aborts += aborted
            if error_scope is not None:
                self._pending.errors[error_scope] += 1

    def close(self) -> None:
        """Flush what is left, then drop the metrics (each before its family, as Triton asks)."""
        self._stop.set()
        self._thread.join()
        self._metrics.clear()
        self._families.clear()

    # -- reporting (the metrics thread) ----------------------------------------------------------
    def _metric(self, family: str, kind: str, what: str, buckets: list[float] | None = None, **labels):
        key = (family, tuple(sorted(labels.items())))
        if key not in self._metrics:
            if family not in self._families:
                import triton_python_backend_utils as pb_utils  # only in Triton's stub (or a test's fake)

                F = pb_utils.MetricFamily
                self._families[family] = F(name=family, description=what, kind=getattr(F, kind))
            self._metrics[key] = self._families[family].Metric(labels={**self._labels, **labels}, buckets=buckets)
        return self._metrics[key]

    def _counter(self, family: str, what: str, value: int, **labels) -> None:
        metric = self._metric(family, "COUNTER", what, **labels)  # created at 0 even before its first event
        if value:
            metric.increment(value)

    def _flush(self) -> None:
        with self._lock:
            p, self._pending = self._pending, _Pending()
        self._counter("infhip_prompt_tokens_total", "Prompt tokens of accepted requests", p.prompt_tokens)
        self._counter("infhip_generation_tokens_total", "Tokens generated", p.generation_tokens)
        self._counter("infhip_request_aborts_total", "Requests aborted because their client left", p.aborts)
        for reason, n in p.finished.items():
            self._counter("infhip_requests_finished_total", "Requests that ended, by finish reason", n,
                          finish_reason=reason)
            if reason in ("stop", "length"):
                self._counter("infhip_request_success_total", "Requests that ended by themselves, by finish reason",
                              n, finish_reason=reason)
        for scope, n in p.errors.items():
            self._counter("infhip_request_errors_total", "Requests failed by the engine: alone (scope=request) "
                          "or with a whole step (scope=engine)", n, scope=scope)
        ttft = self._metric("infhip_time_to_first_token_seconds", "HISTOGRAM",
                            "From the hand-in to the engine to the first token", _TTFT_BUCKETS)
        for v in p.ttft:
            ttft.observe(v)
        itl = self._metric("infhip_inter_token_latency_seconds", "HISTOGRAM",
                           "Time between tokens of a request (a delta of k tokens counts k times its gap / k)",
                           _ITL_BUCKETS)
        for v in p.itl:
            itl.observe(v)
        for family, what, values, buckets in (
                ("infhip_e2e_request_latency_seconds", "From the hand-in to the engine to the request's end",
                 p.e2e, _REQUEST_BUCKETS),
                ("infhip_request_decode_time_seconds", "From the first token to the last", p.decode, _REQUEST_BUCKETS),
                ("infhip_time_per_output_token_seconds",
                 "A request's decode time / (its output tokens - 1), requests of 2+ tokens", p.tpot, _ITL_BUCKETS)):
            metric = self._metric(family, "HISTOGRAM", what, buckets)
            for v in values:
                metric.observe(v)
        self._sample_engine()

    def _sample_engine(self) -> None:
        """Gauges read from the engine thread's objects without a lock: list lengths, which
        may be one step old."""
        sched, kv = self._llm.scheduler, self._llm.runner.kv
        self._metric("infhip_requests_running", "GAUGE", "Requests holding KV pages (scheduled)").set(sched.num_running)
        self._metric("infhip_requests_waiting", "GAUGE", "Requests queued, new or preempted").set(sched.num_waiting)
        for group, spec in kv.groups.items():
            pools = [("gpu", spec.num_pages - 1, kv.num_free_pages(group))]  # page 0 is the null page
            if spec.offload is not None:
                pools.append(("host", spec.offload.host_pages, kv.num_free_host_pages(group)))
            for memory, total, free in pools:
                self._metric("infhip_kv_pages_used", "GAUGE", "KV cache pages in use",
                             group=group, memory=memory).set(total - free)
                self._metric("infhip_kv_pages_free", "GAUGE", "KV cache pages free",
                             group=group, memory=memory).set(free)
            total, free = pools[0][1:]
            self._metric("infhip_kv_cache_usage_ratio", "GAUGE", "Fraction of a KV group's GPU pages in use (0..1)",
                         group=group).set((total - free) / total)

    def _run(self) -> None:
        while not self._stop.wait(_FLUSH_S):
            self._flush()
        self._flush()
