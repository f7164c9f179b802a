"""infhip-serve's ``/metrics`` families for the Triton model (runtime/serving/triton/model.py),
through Triton's custom metrics (``pb_utils.MetricFamily``): the definitions (names, help, labels,
buckets) are runtime/serving/metric_defs.py's, which infhip-serve's make theirs from too. Imported
by the model once infhip is importable in Triton's stub; ``triton_python_backend_utils`` exists
only there (or a test's fake).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from infhip.runtime.serving import metric_defs as M
from infhip.runtime.serving.metric_defs import MetricDef

_FLUSH_S = 0.25  # how often the metrics reach Triton (each metric update is a call to the server)


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

    def __init__(self, loop, labels: dict[str, str]):
        """loop: the model's EngineLoop, whose stats() the gauges read."""
        self._loop, self._labels = loop, labels
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
    def _metric(self, d: MetricDef, **labels):
        """The Triton metric of definition ``d`` (metric_defs.py) with these label values."""
        family = d.family
        key = (family, tuple(sorted(labels.items())))
        if key not in self._metrics:
            if family not in self._families:
                import triton_python_backend_utils as pb_utils  # only in Triton's stub (or a test's fake)

                F = pb_utils.MetricFamily
                self._families[family] = F(name=family, description=d.help, kind=getattr(F, d.kind.upper()))
            buckets = list(d.buckets) if d.buckets is not None else None
            self._metrics[key] = self._families[family].Metric(labels={**self._labels, **labels}, buckets=buckets)
        return self._metrics[key]

    def _counter(self, d: MetricDef, value: int, **labels) -> None:
        metric = self._metric(d, **labels)  # created at 0 even before its first event
        if value:
            metric.increment(value)

    def _flush(self) -> None:
        with self._lock:
            p, self._pending = self._pending, _Pending()
        self._counter(M.PROMPT_TOKENS, p.prompt_tokens)
        self._counter(M.GENERATION_TOKENS, p.generation_tokens)
        self._counter(M.REQUEST_ABORTS, p.aborts)
        for reason, n in p.finished.items():
            self._counter(M.REQUESTS_FINISHED, n, finish_reason=reason)
            if reason in ("stop", "length"):
                self._counter(M.REQUEST_SUCCESS, n, finish_reason=reason)
        for scope, n in p.errors.items():
            self._counter(M.REQUEST_ERRORS, n, scope=scope)
        for d, values in ((M.TTFT, p.ttft), (M.ITL, p.itl), (M.E2E, p.e2e), (M.DECODE_TIME, p.decode),
                          (M.TPOT, p.tpot)):
            metric = self._metric(d)
            for v in values:
                metric.observe(v)
        self._sample_engine()

    def _sample_engine(self) -> None:
        """Gauges of the engine's stats after its last turn (EngineLoop.stats: any thread)."""
        stats = self._loop.stats()
        self._metric(M.REQUESTS_RUNNING).set(stats.num_running)
        self._metric(M.REQUESTS_WAITING).set(stats.num_waiting)
        for group, free in stats.kv_pages_free.items():
            pools = [("gpu", stats.kv_pages_used[group] + free, free)]
            if group in stats.host_pages_free:
                host_free = stats.host_pages_free[group]
                pools.append(("host", stats.host_pages_used[group] + host_free, host_free))
            for memory, total, free in pools:
                self._metric(M.KV_USED, group=group, memory=memory).set(total - free)
                self._metric(M.KV_FREE, group=group, memory=memory).set(free)
            total, free = pools[0][1:]
            self._metric(M.KV_USAGE, group=group).set((total - free) / total)

    def _run(self) -> None:
        while not self._stop.wait(_FLUSH_S):
            self._flush()
        self._flush()
