"""infhip-export-triton: the config.pbtxt it writes (parsed back), atomic replacement and one-line
errors, and the exported model.py run in-process against a fake `triton_python_backend_utils`
driving a real tiny engine: answers equal LLM.generate (alone, streamed, three at once); unknown
fields, wrong types and bad values get INVALID_ARG responses; cancellation, unloading and a
request the engine fails alone get error responses; the custom metrics count what happened.
The real tritonserver runs the same model in tests/test_triton_server.py."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import threading
import time
import types

import numpy as np
import pytest

from infhip import LLM, SamplingParams
from infhip.builder.errors import BuildError
from infhip.builder.export_triton import export_triton_repo, main
from infhip.builder.triton_model import INPUTS, OUTPUTS, PARAMETERS
from tests._tiny import build_tiny_api_engine

GREEDY = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
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
def engine(tmp_path_factory):
    return build_tiny_api_engine(tmp_path_factory.mktemp("triton"))


@pytest.fixture(scope="module")
def reference(engine):
    return LLM(engine)


def test_config_pbtxt(engine, tmp_path):
    out = export_triton_repo(engine, tmp_path / "repo", model_name="tiny")
    assert out == tmp_path / "repo" / "tiny" and (out / "1" / "model.py").is_file()
    cfg = parse_pbtxt((out / "config.pbtxt").read_text())
    assert cfg["name"] == ["tiny"] and cfg["backend"] == ["python"] and cfg["max_batch_size"] == [0]
    assert cfg["model_transaction_policy"] == [{"decoupled": [True]}]
    assert cfg["instance_group"] == [{"count": [1], "kind": ["KIND_MODEL"]}]
    inputs = {t["name"][0]: (t["data_type"][0], t["dims"], t["optional"][0]) for t in cfg["input"]}
    assert inputs == {"text_input": ("TYPE_STRING", [1], True), "input_ids": ("TYPE_INT32", [-1], True),
                      "stop": ("TYPE_STRING", [-1], True), "stop_token_ids": ("TYPE_INT32", [-1], True)}
    # the scalar fields are request parameters, which config.pbtxt lists in comments
    text = (out / "config.pbtxt").read_text()
    assert [re.search(rf"^#   {name} \((\w+)\)", text, re.M).group(1) for name, *_ in PARAMETERS] == \
        ["int", "number", "number", "int", "bool", "int", "bool"]
    outputs = {t["name"][0]: (t["data_type"][0], t["dims"]) for t in cfg["output"]}
    assert outputs == {name: (dtype, dims) for name, dtype, dims, _ in OUTPUTS}
    assert outputs["text_output"] == ("TYPE_STRING", [1]) and outputs["finish_reason"][0] == "TYPE_STRING"
    params = {p["key"][0]: p["value"][0]["string_value"][0] for p in cfg["parameters"]}
    assert params["engine_dir"] == str(engine.absolute()) and params["max_num_seqs"] == "4"
    assert "device" not in params
    # the engine stays where it is; the model file is this package's template
    assert not (out / "1" / "rank0.safetensors").exists()
    from infhip.builder import triton_model
    assert (out / "1" / "model.py").read_text() == open(triton_model.__file__).read()

    cfg = parse_pbtxt((export_triton_repo(engine, tmp_path / "repo", model_name="tiny2", decoupled=False,
                                          max_batch_size=2, device="cpu") / "config.pbtxt").read_text())
    params = {p["key"][0]: p["value"][0]["string_value"][0] for p in cfg["parameters"]}
    assert cfg["model_transaction_policy"] == [{"decoupled": [False]}]
    assert params["max_num_seqs"] == "2" and params["device"] == "cpu"


def test_default_name_and_quoting(engine, tmp_path):
    odd = tmp_path / 'we"ird\\dir'
    odd.mkdir()
    (odd / "eng").symlink_to(engine, target_is_directory=True)
    out = export_triton_repo(odd / "eng", tmp_path / "repo")
    assert out.name == "eng"  # default: the engine folder's name
    params = {p["key"][0]: p["value"][0]["string_value"][0]
              for p in parse_pbtxt((out / "config.pbtxt").read_text())["parameters"]}
    assert params["engine_dir"] == str(odd / "eng")  # absolute, the link kept


def test_force_and_atomicity(engine, tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    out = export_triton_repo(engine, repo, model_name="m")
    (out / "marker").write_text("old")
    with pytest.raises(BuildError, match="already exists; pass --force"):
        export_triton_repo(engine, repo, model_name="m")
    assert (out / "marker").read_text() == "old"

    # a failure while writing leaves the old model untouched and no temporary folder behind
    import infhip.builder.export_triton as ex

    def broken_copy(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(ex.shutil, "copyfile", broken_copy)
    with pytest.raises(OSError, match="disk full"):
        export_triton_repo(engine, repo, model_name="m", force=True)
    monkeypatch.undo()
    assert (out / "marker").read_text() == "old"
    assert sorted(p.name for p in repo.iterdir()) == ["m"]

    export_triton_repo(engine, repo, model_name="m", force=True)
    assert not (out / "marker").exists() and (out / "config.pbtxt").is_file()
    assert sorted(p.name for p in repo.iterdir()) == ["m"]

    (repo / "notamodel").mkdir()
    (repo / "notamodel" / "data.txt").write_text("keep me")
    with pytest.raises(BuildError, match="not a Triton model folder"):
        export_triton_repo(engine, repo, model_name="notamodel", force=True)
    assert (repo / "notamodel" / "data.txt").read_text() == "keep me"


@pytest.mark.parametrize("kwargs, match", [
    (dict(model_name="bad/name"), "not a valid Triton model name"),
    (dict(model_name=".hidden"), "not a valid Triton model name"),
    (dict(model_name=""), "not a valid Triton model name"),
    (dict(max_batch_size=5), r"in \[1, 4\]"),
    (dict(max_batch_size=0), r"in \[1, 4\]"),
    (dict(device="tpu"), "device must be cpu or cuda"),
])
def test_bad_arguments(engine, tmp_path, kwargs, match):
    with pytest.raises(BuildError, match=match):
        export_triton_repo(engine, tmp_path / "repo", **kwargs)
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())


def test_cli(engine, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert main(["--engine", str(engine), "--repo", str(repo), "--model-name", "m"]) == 0
    assert f"tritonserver --model-repository {repo}" in capsys.readouterr().out
    assert main(["--engine", str(engine), "--repo", str(repo), "--model-name", "m"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("infhip-export-triton: error:") and "--force" in err
    assert main(["--engine", str(tmp_path / "nothing"), "--repo", str(repo)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not an infhip engine" in err and "infhip-build" in err
    (tmp_path / "file").write_text("")
    assert main(["--engine", str(engine), "--repo", str(tmp_path / "file")]) == 1
    assert "is not a directory" in capsys.readouterr().err


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


@pytest.fixture(scope="module")
def pb():
    mp = pytest.MonkeyPatch()
    module = fake_pb_utils()
    mp.setitem(sys.modules, "triton_python_backend_utils", module)
    yield module
    mp.undo()


def load_model(engine, repo, name, decoupled=True):
    """Export, then initialize the exported model.py as Triton would (config as JSON)."""
    out = export_triton_repo(engine, repo, model_name=name, decoupled=decoupled)
    spec = importlib.util.spec_from_file_location(f"triton_model_{name}", out / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": model_config_json(parse_pbtxt((out / "config.pbtxt").read_text())),
                      "model_name": name, "model_version": "1"})
    return model


@pytest.fixture(scope="module")
def model(pb, engine, tmp_path_factory):
    m = load_model(engine, tmp_path_factory.mktemp("repo"), "tiny")
    yield m
    m.finalize()


def test_whole_answer_equals_generate(model, reference):
    want = reference.generate(["hello world"], SamplingParams(**GREEDY))[0]
    req = FakeRequest(text_input="hello world", **GREEDY)
    assert model.execute([req]) is None  # decoupled: answered through the sender
    [(resp, flags)] = wait(req)
    assert flags == FINAL
    assert outputs(resp) == {"text": want.text, "ids": want.token_ids, "reason": "length"}
    # a prompt given as token ids gives the same completion
    req = FakeRequest(input_ids=want.prompt_token_ids, **GREEDY)
    model.execute([req])
    assert outputs(wait(req)[0][0])["ids"] == want.token_ids


def test_stream_deltas_add_up(model, reference):
    want = reference.generate(["abc"], SamplingParams(**GREEDY))[0]
    req = FakeRequest(text_input="abc", stream=True, **GREEDY)
    model.execute([req])
    sent = wait(req)
    assert len(sent) > 1 and [f for _, f in sent] == [0] * (len(sent) - 1) + [FINAL]
    deltas = [outputs(r) for r, _ in sent]
    assert "".join(d["text"] for d in deltas) == want.text
    assert [t for d in deltas for t in d["ids"]] == want.token_ids
    assert [d["reason"] for d in deltas] == [""] * (len(deltas) - 1) + ["length"]


def test_concurrent_requests(model, reference):
    prompts = ["hello world", "The quick brown fox", "abc"]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 7, 20)]
    want = reference.generate(prompts, params)
    reqs = [FakeRequest(text_input=p, max_tokens=sp.max_tokens, temperature=0.0, ignore_eos=True)
            for p, sp in zip(prompts, params)]
    model.execute(reqs[:2])
    model.execute(reqs[2:])  # a later execute joins the running batch
    for req, w in zip(reqs, want):
        [(resp, flags)] = wait(req)
        assert flags == FINAL and outputs(resp) == {"text": w.text, "ids": w.token_ids, "reason": "length"}


def test_sampling_inputs_reach_the_engine(model, reference):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=7, stop=["zz"],
                            stop_token_ids=[3])
    want = reference.generate(["hello"], params)[0]
    # Triton's reserved parameters (here one tritonclient sets) are not the model's business
    req = FakeRequest(text_input="hello", max_tokens=8, temperature=0.8, top_p=0.9, top_k=20, seed=7,
                      stop=["zz"], stop_token_ids=[3], triton_enable_empty_final_response=True)
    model.execute([req])
    got = outputs(wait(req)[0][0])
    assert got["ids"] == want.token_ids and got["reason"] == want.finish_reason


@pytest.mark.parametrize("inputs, message", [
    (dict(text_input="hi", max_token=4), "unknown input(s) max_token; accepted: ignore_eos, input_ids, "
                                         "max_tokens, seed, stop, stop_token_ids, stream, temperature, "
                                         "text_input, top_k, top_p"),
    (dict(text_input="hi", temprature=0, beam_width=2), "unknown input(s) beam_width, temprature;"),
    (dict(text_input="hi", max_tokens="4"), "max_tokens must be an int >= 1, got '4'"),
    (dict(text_input="hi", temperature="hot"), "temperature must be a finite number"),
    (dict(text_input="hi", ignore_eos=1), "ignore_eos must be a bool, got 1"),
    (dict(text_input="hi", stream="yes"), 'stream must be true or false, got "yes"'),
    (dict(text_input="hi", top_p=1.5), "top_p must be in (0, 1]"),
    (dict(max_tokens=4), "exactly one of text_input"),
    (dict(text_input="hi", input_ids=[5, 6]), "exactly one of text_input"),
    (dict(input_ids=[5, 999999]), "prompt token ids must be in [0, 300)"),
    (dict(text_input="hi", max_tokens=0), "max_tokens must be an int >= 1"),
])
def test_bad_request_gets_invalid_arg(model, pb, inputs, message):
    req = FakeRequest(**inputs)
    model.execute([req])
    [(resp, flags)] = wait(req)
    assert flags == FINAL and resp.has_error() and message in resp.error().message()
    assert resp.error().code() == pb.TritonError.INVALID_ARG  # HTTP 400, not 500
    assert not model.loop.llm._requests  # it never stayed in the engine


def slow_steps(model, seconds):
    step = model.loop.llm.step

    def slow():
        time.sleep(seconds)
        return step()
    model.loop.llm.step = slow
    return step


def test_cancelled_request_is_aborted(model, pb):
    aborts = fake_metric(pb, "infhip_request_aborts_total")
    step = slow_steps(model, 0.02)  # 100 tokens take > 2 s; the cancel check runs every 0.1 s
    try:
        def cancel_after_first(sender):
            req.cancelled = True
        req = FakeRequest(on_send=cancel_after_first, text_input="hello", stream=True, max_tokens=100,
                          temperature=0.0, ignore_eos=True)
        model.execute([req])
        sent = wait(req)
        resp, flags = sent[-1]
        assert flags == FINAL and resp.has_error() and "cancelled" in resp.error().message()
        assert resp.error().code() == pb.TritonError.CANCELLED
        assert 1 <= sum(len(outputs(r)["ids"]) for r, _ in sent[:-1]) < 100
        deadline = time.monotonic() + 10
        while model.loop.llm._requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not model.loop.llm._requests  # aborted in the engine: its KV pages are free
        until(lambda: fake_metric(pb, "infhip_request_aborts_total") == aborts + 1)
    finally:
        model.loop.llm.step = step


def test_request_failed_alone(model, pb, reference):
    """A request the engine fails alone (its last delta carries `error`) gets an INTERNAL error;
    the others go on."""
    errors = fake_metric(pb, "infhip_request_errors_total", scope="request")
    delta = model.loop.llm._delta

    def failing_delta(req):
        d = delta(req)
        if d is not None and req.prompt == "fail me" and d.token_ids:
            d.finish_reason, d.error = "error", "out of pages"
        return d
    model.loop.llm._delta = failing_delta
    try:
        want = reference.generate(["hello world"], SamplingParams(**GREEDY))[0]
        bad, good = FakeRequest(text_input="fail me", **GREEDY), FakeRequest(text_input="hello world", **GREEDY)
        model.execute([bad, good])
        [(resp, flags)] = wait(bad)
        assert flags == FINAL and resp.has_error() and resp.error().code() == pb.TritonError.INTERNAL
        assert "the engine failed this request: out of pages" in resp.error().message()
        assert outputs(wait(good)[0][0])["ids"] == want.token_ids
    finally:
        model.loop.llm._delta = delta
    until(lambda: not model.loop.llm._requests)  # the failed one is forgotten too
    until(lambda: fake_metric(pb, "infhip_request_errors_total", scope="request") == errors + 1)


def test_metrics_count_what_happened(model, pb, reference):
    prompts, max_tokens = ["hello world", "The quick brown fox"], [6, 9]
    want = reference.generate(prompts, [SamplingParams(**{**GREEDY, "max_tokens": n}) for n in max_tokens])
    names = ["infhip_prompt_tokens_total", "infhip_generation_tokens_total", "infhip_time_to_first_token_seconds",
             "infhip_inter_token_latency_seconds"]
    before = {n: fake_metric(pb, n) for n in names}
    length = fake_metric(pb, "infhip_requests_finished_total", finish_reason="length")
    reqs = [FakeRequest(text_input=p, stream=i == 0, **{**GREEDY, "max_tokens": n})
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    model.execute(reqs)
    for req in reqs:
        wait(req)
    expected = {"infhip_prompt_tokens_total": sum(len(w.prompt_token_ids) for w in want),
                "infhip_generation_tokens_total": sum(max_tokens),
                "infhip_time_to_first_token_seconds": 2,  # one observation per request
                "infhip_inter_token_latency_seconds": sum(max_tokens) - 2}  # one per later token
    until(lambda: {n: fake_metric(pb, n) - before[n] for n in names} == expected)
    assert fake_metric(pb, "infhip_requests_finished_total", finish_reason="length") == length + 2
    until(lambda: fake_metric(pb, "infhip_requests_running") == fake_metric(pb, "infhip_kv_pages_used") == 0)
    kv = model.loop.llm.runner.kv
    assert fake_metric(pb, "infhip_kv_pages_free", group="global", memory="gpu") == kv.groups["global"].num_pages - 1
    [family] = [pb.MetricFamily.families["infhip_requests_waiting"]]
    assert {"model": "tiny", "version": "1"} in [m.labels for m in family.metrics]


def test_not_decoupled_and_finalize(pb, engine, reference, tmp_path):
    m = load_model(engine, tmp_path / "repo", "whole", decoupled=False)
    try:
        want = reference.generate(["hello world", "abc"], SamplingParams(**GREEDY))
        reqs = [FakeRequest(text_input=p, **GREEDY) for p in ("hello world", "abc")]
        reqs.append(FakeRequest(text_input="abc", stream=True, **GREEDY))
        responses = m.execute(reqs)
        assert [outputs(r)["ids"] for r in responses[:2]] == [w.token_ids for w in want]
        assert responses[2].has_error() and "decoupled" in responses[2].error().message()
    finally:
        m.finalize()

    m = load_model(engine, tmp_path / "repo2", "unload")
    slow_steps(m, 0.05)
    req = FakeRequest(text_input="hello", max_tokens=100, temperature=0.0, ignore_eos=True)
    m.execute([req])
    time.sleep(0.2)
    m.finalize()  # a request still running learns that the model went away
    [(resp, flags)] = wait(req, timeout=10)
    assert flags == FINAL and resp.has_error() and "unloaded" in resp.error().message()
