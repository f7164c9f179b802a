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

Metrics: `TritonMetrics` (runtime/serving/triton/metrics.py, imported with infhip) reports
infhip-serve's ``/metrics`` families through Triton's custom-metrics API, on Triton's metrics port.

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
    """LLM, SamplingParams, EngineLoop and the metrics module (runtime/serving/triton/metrics.py). The stub's interpreter may not see the environment
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
        from infhip.runtime.serving.triton import metrics
    except ImportError as e:
        raise ImportError(f"infhip is not importable in Triton's Python backend ({e}); install it in the "
                          "Python environment the stub runs, or set PYTHONPATH for tritonserver") from e
    return LLM, SamplingParams, EngineLoop, metrics


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
        LLM, self._sampling_params, EngineLoop, metrics = _import_infhip(params.get("python_site_dirs", ""))
        kwargs = {}
        if params.get("device"):
            kwargs["device"] = params["device"]
        if params.get("max_num_seqs"):
            kwargs["max_num_seqs"] = int(params["max_num_seqs"])
        self._llm = LLM(params["engine_dir"], **kwargs)
        self.loop = EngineLoop(self._llm).start()  # all the model reaches of the engine
        self.metrics = metrics.TritonMetrics(self.loop, {"model": args["model_name"], "version": args["model_version"]})
        self._clock = metrics.Clock
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
        self._llm.close()  # a tensor-parallel engine's worker processes (a no-op otherwise)

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
            submitted = self._clock()
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

    def _answer(self, watch: "_Watch", clock, send, stream: bool) -> str:
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

    def _deltas(self, watch: "_Watch", clock):
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
