"""The Triton Inference Server model that serves an infhip engine (Python backend).

`infhip-export-triton` copies this file verbatim into a model repository as
``<repo>/<model>/1/model.py``; Triton's Python-backend stub runs it, reading the engine's path
from ``config.pbtxt`` (``parameters.engine_dir``). The same file is the single source of the
model's inputs and outputs (`INPUTS`, `OUTPUTS`), from which the exporter writes config.pbtxt.

Shape of a request (Triton's "generate" conventions, as the TensorRT-LLM and vLLM backends use
them, so ``POST /v2/models/<model>/generate[_stream]`` with ``{"text_input": ..., "max_tokens": ...}``
works): the prompt is ``text_input`` (one string) or ``input_ids`` (token ids); the other inputs
are the `SamplingParams` fields plus ``stream``. Every response carries ``text_output``, the
new ``output_ids`` and ``finish_reason`` ("" until the last one).

One engine thread (`infhip.runtime.server.EngineLoop`, the same one `infhip-serve` runs) owns the
`LLM` and steps all live requests together (continuous batching). In decoupled mode (the
default) `execute` hands each request to a small responder thread and returns at once; the
responder sends the deltas (``stream`` true) or one whole answer through the request's response
sender, the last response flagged ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``. A request Triton
cancels (client gone, timeout) is aborted in the engine, freeing its KV pages. Bad input gets an
error response saying what is wrong; it never reaches the engine.

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

# (name, Triton data type, dims, what it is). Scalars have dims [1]; [-1] is a list.
INPUTS: tuple[tuple[str, str, list[int], str], ...] = (
    ("text_input", "TYPE_STRING", [1], "the prompt text (or give input_ids)"),
    ("input_ids", "TYPE_INT32", [-1], "the prompt as token ids (instead of text_input)"),
    ("max_tokens", "TYPE_INT32", [1], "tokens to generate at most (16)"),
    ("temperature", "TYPE_FP32", [1], "0 = greedy (1.0)"),
    ("top_p", "TYPE_FP32", [1], "nucleus sampling mass in (0, 1] (1.0)"),
    ("top_k", "TYPE_INT32", [1], "keep the k most likely tokens; 0 = off"),
    ("stop", "TYPE_STRING", [-1], "strings that end generation (not included)"),
    ("stop_token_ids", "TYPE_INT32", [-1], "token ids that end generation, besides EOS"),
    ("ignore_eos", "TYPE_BOOL", [1], "keep generating past EOS"),
    ("seed", "TYPE_INT64", [1], "per-request sampling seed"),
    ("stream", "TYPE_BOOL", [1], "one response per delta instead of one whole answer (false)"),
)
OUTPUTS: tuple[tuple[str, str, list[int], str], ...] = (
    ("text_output", "TYPE_STRING", [1], "the new text (the whole completion when not streaming)"),
    ("output_ids", "TYPE_INT32", [-1], "the new token ids"),
    ("finish_reason", "TYPE_STRING", [1], "stop | length | abort on the last response, else empty"),
)

# Triton input -> (SamplingParams field, python type of one element, is a list)
_SAMPLING = {
    "max_tokens": (int, False), "temperature": (float, False), "top_p": (float, False),
    "top_k": (int, False), "stop": (str, True), "stop_token_ids": (int, True),
    "ignore_eos": (bool, False), "seed": (int, False),
}
_POLL_S = 0.1  # how often a responder looks for cancellation while it waits for the engine


class BadInput(ValueError):
    """A request whose inputs cannot become a generation; the message says which and why."""


class _Stop(Exception):
    """The responder gives up on a request: Triton cancelled it (code "CANCELLED"), or the
    model is unloading ("UNAVAILABLE"); code names a pb_utils.TritonError code."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


_EMPTY = object()  # no message from the engine within _POLL_S


def _values(request, name: str, kind: type, is_list: bool):
    """The input `name` of request as python value(s) of `kind`, or None when not given."""
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


def parse_request(request, sampling_params_cls):
    """(prompt text, prompt token ids, SamplingParams, stream) of a Triton request; BadInput
    says what is wrong (exactly one of text_input / input_ids, values SamplingParams accepts)."""
    text = _values(request, "text_input", str, False)
    ids = _values(request, "input_ids", int, True)
    if (text is None) == (ids is None):
        raise BadInput("give exactly one of text_input (the prompt text) or input_ids (its token ids)")
    if ids is not None and not ids:
        raise BadInput("input_ids is empty; give at least one token id")
    fields = {}
    for name, (kind, is_list) in _SAMPLING.items():
        value = _values(request, name, kind, is_list)
        if value is not None:
            fields[name] = value
    stream = _values(request, "stream", bool, False)
    try:
        params = sampling_params_cls(**fields)
    except (TypeError, ValueError) as e:
        raise BadInput(str(e)) from None
    return text, ids, params, bool(stream)


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
        from infhip.runtime.server import EngineLoop
    except ImportError as e:
        raise ImportError(f"infhip is not importable in Triton's Python backend ({e}); install it in the "
                          "Python environment the stub runs, or set PYTHONPATH for tritonserver") from e
    return LLM, SamplingParams, EngineLoop


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
        self.loop = EngineLoop(LLM(params["engine_dir"], **kwargs)).start()
        self._closing = threading.Event()
        self._final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

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

    def finalize(self) -> None:
        """Stop the engine thread; requests still running get an error response."""
        self._closing.set()
        self.loop.close()

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
        outbox = None
        try:
            text, ids, params, stream = parse_request(request, self._sampling_params)
            if stream and not can_stream:
                raise BadInput("stream=true needs the decoupled model (export without --no-decoupled)")
            outbox = self.loop.submit(text, ids, params)
            watch = _Watch(request, outbox)
            first = self._next(watch)
            if isinstance(first, Exception):  # the engine refused it (prompt too long, bad token id)
                outbox = None
                raise BadInput(str(first)) if isinstance(first, ValueError) else first
            pieces, tokens, reason = [], [], None
            while (delta := self._next(watch)) is not None:
                if isinstance(delta, Exception):
                    outbox = None
                    raise RuntimeError(f"the engine failed: {delta}")
                if stream:
                    send(_response(delta.text, delta.token_ids, delta.finish_reason), delta.finish_reason is not None)
                    if delta.finish_reason is not None:
                        return
                else:
                    pieces.append(delta.text)
                    tokens += delta.token_ids
                    reason = delta.finish_reason or reason
            send(_response("".join(pieces), tokens, reason), True)
        except _Stop as e:
            self._fail(send, str(e), e.code)
        except BadInput as e:
            self._fail(send, str(e))
        except Exception as e:  # noqa: BLE001 - the client learns why; Triton keeps serving
            if outbox is not None:
                self.loop.cancel(outbox)
            self._fail(send, f"{type(e).__name__}: {e}")

    def _next(self, watch: "_Watch"):
        """The next message the engine thread put for this request; _Stop (after aborting the
        request in the engine) when Triton cancelled it or the model is unloading, which is
        looked at every _POLL_S, whether messages flow or not."""
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
                if _is_cancelled(watch.request):
                    self.loop.cancel(watch.outbox)
                    raise _Stop("the request was cancelled", "CANCELLED")
            if item is not _EMPTY:
                return item

    def _fail(self, send, message: str, code_name: str | None = None) -> None:
        code = getattr(pb_utils.TritonError, code_name, None) if code_name else None
        error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
        try:
            send(pb_utils.InferenceResponse(output_tensors=[], error=error), True)
        except Exception:  # noqa: BLE001 - the client is gone; nobody is left to tell
            pass


class _Watch:
    """One request's queue of engine messages and when its cancellation was last looked at."""

    def __init__(self, request, outbox: queue.Queue):
        self.request, self.outbox = request, outbox
        self.checked_at = time.monotonic()


def _is_cancelled(request) -> bool:
    is_cancelled = getattr(request, "is_cancelled", None)  # Triton >= 23.10
    return bool(is_cancelled()) if is_cancelled is not None else False


def _response(text: str, token_ids: list[int], finish_reason: str | None):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array(token_ids, dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([(finish_reason or "").encode()], dtype=np.object_)),
    ])
