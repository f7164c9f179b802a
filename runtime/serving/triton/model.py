"""The Triton Inference Server model that serves an infhip engine (Python backend).

`infhip-export-triton` copies this file verbatim into a model repository as
``<repo>/<model>/1/model.py``; Triton's Python-backend stub runs it, reading the engine's path
from ``config.pbtxt`` (``parameters.engine_dir``). The same file is the single source of the
model's interface (`INPUTS`, `PARAMETERS`, `OUTPUTS`), from which the exporter writes config.pbtxt.

Shape of a request (Triton's "generate" conventions, so ``POST /v2/models/<model>/generate[_stream]``
with ``{"text_input": ..., "max_tokens": ...}`` works):

- the prompt and the list-valued fields are input tensors: ``text_input`` (one string) or
  ``input_ids`` (token ids), ``stop``, ``stop_token_ids``;
- the scalar fields (``max_tokens``, ``temperature``, ... and ``stream``) are request
  parameters. The generate endpoint turns every JSON field that is not an input into a request
  parameter without looking at its type, so the model checks every type itself and answers a
  wrong one with a 400 naming the field (as tensors, Triton's JSON parser would answer a
  string ``max_tokens`` with a 500). gRPC and ``/infer`` clients pass them as the request's
  ``parameters``. An unknown parameter (a misspelt field) is an error naming it and listing the
  accepted ones, never silently ignored; Triton itself rejects an undeclared input tensor.

Every response carries ``text_output``, the new ``output_ids`` and ``finish_reason`` ("" until
the last one).

One engine thread (`infhip.runtime.engine_loop.EngineLoop`, the same one `infhip-serve` runs) owns the
`EngineCore` and steps all live requests together (continuous batching). In decoupled mode (the
default) `execute` hands each request to a small responder thread and returns at once; the
responder sends the deltas (``stream`` true) or one whole answer through the request's response
sender, the last response flagged ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``. A request Triton
cancels (``request.is_cancelled()``: a gRPC client cancelling, an HTTP stream whose client left)
is aborted in the engine, freeing its KV pages. Error codes: bad input INVALID_ARG (HTTP 400),
cancelled CANCELLED, model unloading UNAVAILABLE (503), the engine failing INTERNAL (500).

Drain (docs/serving_triton.md, "Stopping"): on SIGTERM tritonserver itself stops taking new
requests and waits up to ``--exit-timeout-secs`` for running ones; it has no way to tell a model
that the wait is over. So the launcher (runtime/serving/triton/launch.py), once its drain timeout has
passed, writes the file `END_MARKER` into the model's directory; a watcher thread here sees it
within _POLL_S and ends every running request: a streaming one with a last response whose
finish_reason is "abort" (flagged final), a whole one with UNAVAILABLE. Triton then finds
nothing running and unloads the model in order.

Metrics: `_Metrics` reports infhip-serve's ``/metrics`` families through Triton's custom-metrics
API, on Triton's metrics port.

``triton_python_backend_utils`` exists only inside Triton's stub (or a test's fake), so it is
imported in `TritonPythonModel.initialize`, not at import time.
"""

from __future__ import annotations

import json
import os
import queue
import site
import threading
import time
from collections import Counter

import numpy as np

pb_utils = None  # triton_python_backend_utils, bound by TritonPythonModel.initialize

# Input tensors: (name, Triton data type, dims, what it is). [1] is one value, [-1] a list.
INPUTS: tuple[tuple[str, str, list[int], str], ...] = (
    ("text_input", "TYPE_STRING", [1], "the prompt text (or give input_ids)"),
    ("input_ids", "TYPE_INT32", [-1], "the prompt as token ids (instead of text_input)"),
    ("stop", "TYPE_STRING", [-1], "strings that end generation (not included)"),
    ("stop_token_ids", "TYPE_INT32", [-1], "token ids that end generation, besides EOS"),
)
# Request parameters: (name, JSON type, what it is). All but stream are SamplingParams fields,
# which checks their types and values.
PARAMETERS: tuple[tuple[str, str, str], ...] = (
    ("max_tokens", "int", "tokens to generate at most (16)"),
    ("temperature", "number", "0 = greedy (1.0)"),
    ("top_p", "number", "nucleus sampling mass in (0, 1] (1.0)"),
    ("top_k", "int", "keep the k most likely tokens; 0 = off"),
    ("ignore_eos", "bool", "keep generating past EOS (false)"),
    ("seed", "int", "per-request sampling seed"),
    ("stream", "bool", "one response per delta instead of one whole answer (false)"),
)
OUTPUTS: tuple[tuple[str, str, list[int], str], ...] = (
    ("text_output", "TYPE_STRING", [1], "the new text (the whole completion when not streaming)"),
    ("output_ids", "TYPE_INT32", [-1], "the new token ids"),
    ("finish_reason", "TYPE_STRING", [1], "stop | length | abort on the last response, else empty"),
)

END_MARKER = "infhip-end-requests"  # written by the launcher into the model's directory: end what runs
_ACCEPTED = sorted([name for name, *_ in INPUTS] + [name for name, *_ in PARAMETERS])
_POLL_S = 0.1  # how often a responder looks for cancellation while it waits for the engine
_FLUSH_S = 0.25  # how often the metrics reach Triton (each metric update is a call to the server)
# The buckets of infhip-serve's histograms (seconds).
_TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5]
_REQUEST_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800]


class BadInput(ValueError):
    """A request whose inputs cannot become a generation; the message says which and why."""


class _Stop(Exception):
    """The responder gives up on a request: Triton cancelled it (code "CANCELLED"), or the
    model is unloading ("UNAVAILABLE"); code names a pb_utils.TritonError code."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class _Failed(Exception):
    """The engine failed the request: alone (scope "request": its last delta carries an error)
    or with the whole step (scope "engine": every live request got the exception)."""

    def __init__(self, message: str, scope: str):
        super().__init__(message)
        self.scope = scope


_EMPTY = object()  # no message from the engine within _POLL_S


# -- a request's inputs -------------------------------------------------------------------------
def _tensor_values(request, name: str, kind: type, is_list: bool):
    """The input tensor `name` of request as python value(s) of `kind`, or None when not given.
    Triton has already checked its data type against config.pbtxt."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    flat = np.asarray(tensor.as_numpy()).reshape(-1)
    if kind is str:
        try:
            items = [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in flat]
        except UnicodeDecodeError:
            raise BadInput(f"input {name} is not UTF-8 text") from None
    else:
        items = [kind(x.item()) for x in flat]
    if is_list:
        return items
    if len(items) != 1:
        raise BadInput(f"input {name} must hold one value, got {len(items)}")
    return items[0]


def _parameters(request) -> dict:
    """The request's parameters ({name: JSON value}) without Triton's reserved ``triton_*``
    ones; BadInput names any this model does not know."""
    given = {k: v for k, v in json.loads(request.parameters() or "{}").items() if not k.startswith("triton_")}
    known = {name for name, *_ in PARAMETERS}
    unknown = sorted(set(given) - known)
    if unknown:
        raise BadInput(f"unknown input(s) {', '.join(unknown)}; accepted: {', '.join(_ACCEPTED)}")
    return given


def parse_request(request, sampling_params_cls):
    """(prompt text, prompt token ids, SamplingParams, stream) of a Triton request; BadInput
    says what is wrong (an unknown field, exactly one of text_input / input_ids, a value of the
    wrong type or out of range)."""
    fields = _parameters(request)
    stream = fields.pop("stream", False)
    if not isinstance(stream, bool):
        raise BadInput(f"stream must be true or false, got {json.dumps(stream)}")
    text = _tensor_values(request, "text_input", str, False)
    ids = _tensor_values(request, "input_ids", int, True)
    if (text is None) == (ids is None):
        raise BadInput("give exactly one of text_input (the prompt text) or input_ids (its token ids)")
    if ids is not None and not ids:
        raise BadInput("input_ids is empty; give at least one token id")
    for name, kind in (("stop", str), ("stop_token_ids", int)):
        values = _tensor_values(request, name, kind, True)
        if values is not None:
            fields[name] = values
    try:
        params = sampling_params_cls(**fields)
    except (TypeError, ValueError) as e:
        raise BadInput(str(e)) from None
    return text, ids, params, stream


def _import_infhip(site_dirs: str):
    """LLM, SamplingParams and EngineLoop. The stub's interpreter may not see the environment
    infhip was installed in; then the exporter's site-packages (parameters.python_site_dirs)
    are added, .pth files included (an editable install needs them)."""
    try:
        import infhip  # noqa: F401
    except ImportError:
        for d in filter(None, site_dirs.split(os.pathsep)):
            if os.path.isdir(d):
                site.addsitedir(d)
    try:
        from infhip.runtime.llm import LLM
        from infhip.runtime.sampling_params import SamplingParams
        from infhip.runtime.engine_loop import EngineLoop
    except ImportError as e:
        raise ImportError(f"infhip is not importable in Triton's Python backend ({e}); install it in the "
                          "Python environment the stub runs, or set PYTHONPATH for tritonserver") from e
    return LLM, SamplingParams, EngineLoop


# -- metrics ------------------------------------------------------------------------------------
class _Clock:
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


class _Metrics:
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

    def tokens(self, clock: _Clock, n: int) -> None:
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

    def ended(self, clock: _Clock) -> None:
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


# -- the model ----------------------------------------------------------------------------------
class TritonPythonModel:
    """Triton's Python-backend entry points: initialize, execute, finalize."""

    def initialize(self, args: dict) -> None:
        global pb_utils
        import triton_python_backend_utils as pb_utils  # noqa: F811 - only Triton's stub has it

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        if "engine_dir" not in params:
            raise ValueError("config.pbtxt has no parameters.engine_dir; re-export with infhip-export-triton")
        LLM, self._sampling_params, EngineLoop = _import_infhip(params.get("python_site_dirs", ""))
        kwargs = {}
        if params.get("device"):
            kwargs["device"] = params["device"]
        if params.get("max_num_seqs"):
            kwargs["max_num_seqs"] = int(params["max_num_seqs"])
        llm = LLM(params["engine_dir"], **kwargs)
        self.loop = EngineLoop(llm.core).start()
        self.metrics = _Metrics(llm, {"model": args["model_name"], "version": args["model_version"]})
        self._closing = threading.Event()
        self._ending = threading.Event()  # the launcher's drain ran out: every request ends now
        self._final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._end_marker = None
        if args.get("model_repository"):  # the model's directory (Triton always gives it)
            self._end_marker = os.path.join(args["model_repository"], END_MARKER)
            if os.path.exists(self._end_marker):  # left by an earlier drain
                os.remove(self._end_marker)
            threading.Thread(target=self._watch_end_marker, name="infhip-triton-drain", daemon=True).start()

    def execute(self, requests: list) -> list | None:
        """Decoupled: start a responder per request and return None (they answer through the
        response senders). Otherwise wait for every request and return one response each."""
        if self.decoupled:
            for request in requests:
                threading.Thread(target=self._serve, args=(request, self._sender(request), True), daemon=True,
                                 name="infhip-triton-request").start()
            return None
        responses: list = [None] * len(requests)

        def collect(i: int):
            def send(resp, final: bool) -> None:
                responses[i] = resp
            return send

        threads = [threading.Thread(target=self._serve, args=(r, collect(i), False), daemon=True)
                   for i, r in enumerate(requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return responses

    def _watch_end_marker(self) -> None:
        """End every running request (and any that still arrives) once END_MARKER exists."""
        while not self._closing.wait(_POLL_S):
            if os.path.exists(self._end_marker):
                self._ending.set()
                self.loop.end_all()

    def finalize(self) -> None:
        """Stop the engine thread; requests still running get an UNAVAILABLE error."""
        self._closing.set()
        self.loop.close()
        self.metrics.close()
        self.loop.core.close()  # a tensor-parallel engine's worker processes (a no-op otherwise)

    # -- one request ------------------------------------------------------------------------------
    def _sender(self, request):
        """send(response, final) over the request's decoupled response sender."""
        sender = request.get_response_sender()

        def send(response, final: bool) -> None:
            sender.send(response, flags=self._final if final else 0)
        return send

    def _serve(self, request, send, can_stream: bool) -> None:
        """Generate for one request, answering through send(response, final) exactly once with
        final=True; never raises (everything wrong becomes an error response)."""
        outbox = clock = None  # clock: set once the engine accepted the request
        try:
            text, ids, params, stream = parse_request(request, self._sampling_params)
            if stream and not can_stream:
                raise BadInput("stream=true needs the decoupled model (export without --no-decoupled)")
            submitted = _Clock()
            outbox = self.loop.submit(text, ids, params)
            watch = _Watch(request, outbox)
            accepted = self._next(watch)
            if isinstance(accepted, Exception):  # the engine refused it (prompt too long, bad token id)
                raise BadInput(str(accepted)) if isinstance(accepted, ValueError) else accepted
            self.metrics.accepted(accepted.prompt_tokens)
            clock = submitted
            self.metrics.finished(self._answer(watch, clock, send, stream))
            self.metrics.ended(clock)
            return
        except BadInput as e:
            self._fail(send, str(e), "INVALID_ARG")
        except _Stop as e:
            self.metrics.finished("abort", aborted=e.code == "CANCELLED")
            self._fail(send, str(e), e.code)
        except _Failed as e:
            self.metrics.finished("error", error_scope=e.scope)
            self._fail(send, str(e), "INTERNAL")
        except Exception as e:  # noqa: BLE001 - the client learns why; Triton keeps serving
            self._fail(send, f"{type(e).__name__}: {e}", "INTERNAL")
        if clock is not None:
            self.metrics.ended(clock)
        if outbox is not None:  # not answered in full: the engine must forget it (a no-op if it did)
            self.loop.cancel(outbox)

    def _answer(self, watch: "_Watch", clock: _Clock, send, stream: bool) -> str:
        """Send the request's deltas (stream) or its whole completion; return its finish reason."""
        pieces, tokens = [], []
        for delta in self._deltas(watch, clock):
            if stream:
                send(_response(delta.text, delta.token_ids, delta.finish_reason), delta.finish_reason is not None)
            else:
                pieces.append(delta.text)
                tokens += delta.token_ids
            if delta.finish_reason is not None:
                if not stream:
                    if delta.finish_reason == "abort" and self._ending.is_set():
                        raise _Stop("the server is shutting down and ended the request; send it again "
                                    "to another replica", "UNAVAILABLE")
                    send(_response("".join(pieces), tokens, delta.finish_reason), True)
                return delta.finish_reason
        raise RuntimeError("the engine ended the request without a finish reason")

    def _deltas(self, watch: "_Watch", clock: _Clock):
        """The request's StreamDeltas up to its last (finish_reason set); _Failed when the
        engine failed it."""
        while (delta := self._next(watch)) is not None:
            if isinstance(delta, Exception):  # a step failed: every live request gets the exception
                raise _Failed(f"the engine failed: {delta}", "engine")
            self.metrics.tokens(clock, len(delta.token_ids))
            error = getattr(delta, "error", None)  # a failure of this request alone
            if error:
                raise _Failed(f"the engine failed this request: {error}", "request")
            yield delta

    def _next(self, watch: "_Watch"):
        """The next message the engine thread put for this request; _Stop when Triton cancelled
        it or the model is unloading, which is looked at every _POLL_S, whether messages flow
        or not."""
        while True:
            try:
                item = watch.outbox.get(timeout=_POLL_S)
            except queue.Empty:
                item = _EMPTY
            now = time.monotonic()
            if now - watch.checked_at >= _POLL_S:
                watch.checked_at = now
                if self._closing.is_set():
                    raise _Stop("the model is being unloaded; retry once it is loaded again", "UNAVAILABLE")
                if watch.request.is_cancelled():  # Triton >= 23.10
                    raise _Stop("the request was cancelled", "CANCELLED")
            if item is not _EMPTY:
                return item

    def _fail(self, send, message: str, code_name: str) -> None:
        error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code_name))
        try:
            send(pb_utils.InferenceResponse(output_tensors=[], error=error), True)
        except Exception:  # noqa: BLE001 - the client is gone; nobody is left to tell
            pass


class _Watch:
    """One request's queue of engine messages and when its cancellation was last looked at."""

    def __init__(self, request, outbox: queue.Queue):
        self.request, self.outbox = request, outbox
        self.checked_at = time.monotonic()


def _response(text: str, token_ids: list[int], finish_reason: str | None):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array(token_ids, dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([(finish_reason or "").encode()], dtype=np.object_)),
    ])
