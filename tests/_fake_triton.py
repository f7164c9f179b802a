"""Helpers of the infhip-export-triton tests (test_export_triton*.py): config.pbtxt parsed back,
the tiny engine and its LLM.generate reference (module fixtures), and a fake
`triton_python_backend_utils` with requests, senders and metrics to drive the exported model.py
in-process."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import types

import numpy as np
import pytest

from infhip import LLM
from infhip.runtime.serving.triton.model import INPUTS
from tests._tiny import API_ENGINE

FINAL = 1


# -- config.pbtxt, parsed back ------------------------------------------------------------------
_TOKEN = re.compile(r'\s+|#[^\n]*|"((?:[^"\\]|\\.)*)"|([{}\[\]:,])|([^\s{}\[\]:,"#]+)')


def parse_pbtxt(text: str) -> dict:
    """Protobuf text format -> {field: [values]} (messages are dicts, atoms int/bool/str)."""
    tokens, end = [], 0
    for m in _TOKEN.finditer(text):
        assert m.start() == end, f"unparsable config.pbtxt at {text[end:end + 30]!r}"
        end = m.end()
        if m.group(1) is not None:
            tokens.append(("str", re.sub(r"\\(.)", r"\1", m.group(1))))
        elif m.group(2):
            tokens.append(("p", m.group(2)))
        elif m.group(3):
            tokens.append(("atom", m.group(3)))
    assert end == len(text)
    pos = 0

    def value():
        nonlocal pos
        kind, tok = tokens[pos]
        pos += 1
        if (kind, tok) == ("p", "{"):
            return message("}")
        if (kind, tok) == ("p", "["):
            items = []
            while tokens[pos] != ("p", "]"):
                items.append(value())
                if tokens[pos] == ("p", ","):
                    pos += 1
            pos += 1
            return items
        if kind == "str":
            return tok
        if tok in ("true", "false"):
            return tok == "true"
        return int(tok) if re.fullmatch(r"-?\d+", tok) else tok

    def message(close):
        nonlocal pos
        fields: dict = {}
        while pos < len(tokens) and tokens[pos] != ("p", close):
            kind, name = tokens[pos]
            assert kind == "atom", f"expected a field name, got {name!r}"
            pos += 1
            if tokens[pos] == ("p", ":"):
                pos += 1
            v = value()
            fields.setdefault(name, []).extend(v if isinstance(v, list) else [v])
        pos += 1
        return fields

    return message(None)


def model_config_json(parsed: dict) -> str:
    """The JSON Triton hands to initialize(args["model_config"]) for a parsed config.pbtxt."""
    return json.dumps({
        "name": parsed["name"][0], "backend": parsed["backend"][0],
        "model_transaction_policy": {"decoupled": parsed["model_transaction_policy"][0]["decoupled"][0]},
        "parameters": {p["key"][0]: {"string_value": p["value"][0]["string_value"][0]} for p in parsed["parameters"]},
    })


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)


@pytest.fixture(scope="module")
def reference(engine):
    return LLM(engine)


# -- the model, in-process, against a fake triton_python_backend_utils --------------------------
def fake_pb_utils() -> types.ModuleType:
    """The part of Triton's triton_python_backend_utils that model.py uses."""
    pb = types.ModuleType("triton_python_backend_utils")

    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, np.asarray(array)

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class TritonError(Exception):
        UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, CANCELLED = 0, 1, 2, 3, 5, 8

        def __init__(self, message, code=1):
            super().__init__(message)
            self._message, self._code = message, code

        def message(self):
            return self._message

        def code(self):
            return self._code

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self._tensors, self._error = list(output_tensors), error

        def output_tensors(self):
            return self._tensors

        def has_error(self):
            return self._error is not None

        def error(self):
            return self._error

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
        families: dict = {}  # name -> family, of every model loaded in the test

        def __init__(self, name, description, kind):
            assert name not in self.families or self.families[name].kind == kind
            self.name, self.kind, self.metrics = name, kind, []
            self.families[name] = self

        def Metric(self, labels=None, buckets=None):  # noqa: N802 - Triton's name
            assert (buckets is not None) == (self.kind == self.HISTOGRAM)
            metric = Metric(self.kind, dict(labels or {}))
            self.metrics.append(metric)
            return metric

    class Metric:
        def __init__(self, kind, labels):
            self.kind, self.labels, self.observed, self._value = kind, labels, [], 0.0

        def increment(self, v):
            assert self.kind == "counter" and v >= 0
            self._value += v

        def set(self, v):
            assert self.kind == "gauge"
            self._value = v

        def observe(self, v):
            assert self.kind == "histogram"
            self.observed.append(v)

        def value(self):
            return self._value

    pb.Tensor, pb.TritonError, pb.InferenceResponse = Tensor, TritonError, InferenceResponse
    pb.MetricFamily = MetricFamily
    pb.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    return pb


class FakeSender:
    def __init__(self, on_send=None):
        self.sent: list = []  # (response, flags)
        self.done = threading.Event()
        self._on_send = on_send

    def send(self, response=None, flags=0):
        assert not self.done.is_set(), "a response after the final one"
        self.sent.append((response, flags))
        if self._on_send is not None:
            self._on_send(self)
        if flags & FINAL:
            self.done.set()


class FakeRequest:
    """A Triton request: the config's inputs as numpy arrays of their types, everything else a
    request parameter (a JSON value), as the generate endpoint makes them."""

    _TYPES = {name: dtype for name, dtype, *_ in INPUTS}

    def __init__(self, on_send=None, **fields):
        self.inputs, self._parameters = {}, {}
        for name, v in fields.items():
            if name not in self._TYPES:
                self._parameters[name] = v
                continue
            values = v if isinstance(v, list) else [v]
            array = (np.array([s.encode() for s in values], dtype=np.object_) if self._TYPES[name] == "TYPE_STRING"
                     else np.array(values, dtype=np.int32))
            self.inputs[name] = fake_pb_tensor(name, array)
        self.sender = FakeSender(on_send)
        self.cancelled = False

    def parameters(self):
        return json.dumps(self._parameters)

    def get_response_sender(self):
        return self.sender

    def is_cancelled(self):
        return self.cancelled


def fake_pb_tensor(name, array):
    return sys.modules["triton_python_backend_utils"].Tensor(name, array)


def outputs(response) -> dict:
    assert not response.has_error(), response.error().message()
    out = {t.name(): t.as_numpy() for t in response.output_tensors()}
    return {"text": out["text_output"][0].decode(), "ids": out["output_ids"].tolist(),
            "reason": out["finish_reason"][0].decode()}


def wait(request, timeout=60.0):
    assert request.sender.done.wait(timeout), "no final response"
    return request.sender.sent


def until(condition, timeout_s=10.0):
    """Wait for condition() (the model hands its metrics over every 0.25 s)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


def fake_metric(pb, name, model="tiny", **labels) -> float:
    """A counter's or gauge's value, or a histogram's number of observations, summed over the
    metrics of model whose labels include labels."""
    family = pb.MetricFamily.families.get(name)
    want = {"model": model, **labels}.items()
    return sum(len(m.observed) if m.kind == "histogram" else m.value() for m in (family.metrics if family else [])
               if want <= m.labels.items())
