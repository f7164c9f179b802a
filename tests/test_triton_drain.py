"""The Triton model's end of a drain, in-process against the fake `triton_python_backend_utils`
(tests/_fake_triton.py) on the tiny engine: once the launcher writes END_MARKER into the model's
directory (runtime/serving/triton/launch.py `end_requests`), a running streaming request ends with a last
response whose finish_reason is "abort" (flagged final, its tokens a prefix of the full answer),
a running whole request with UNAVAILABLE, and the engine is idle. The real tritonserver's drain
(SIGTERM to examples/triton_serve.py): tests/test_triton_launcher.py."""

from __future__ import annotations

import importlib.util
import sys
import time

import pytest

from infhip import SamplingParams
from infhip.runtime.serving.triton.export import export_triton_repo
from infhip.runtime.serving.triton.launch import end_requests
from tests._fake_triton import (FINAL, FakeRequest, engine, fake_pb_utils, model_config_json,  # noqa: F401
                                outputs, parse_pbtxt, reference, wait)

LONG = dict(max_tokens=100, temperature=0.0, ignore_eos=True)


@pytest.fixture
def pb():
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils())
    yield sys.modules["triton_python_backend_utils"]
    mp.undo()


def load(model_dir, name: str):
    """The exported model.py in model_dir, initialized as Triton does it (model_repository included)."""
    spec = importlib.util.spec_from_file_location(f"triton_drain_{name}", model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": model_config_json(parse_pbtxt((model_dir / "config.pbtxt").read_text())),
                      "model_name": name, "model_version": "1", "model_repository": str(model_dir)})
    return model, module


def test_end_marker_ends_running_requests(pb, engine, reference, tmp_path):
    repo = tmp_path / "repo"
    model_dir = export_triton_repo(engine, repo, model_name="tiny")
    model, module = load(model_dir, "tiny")
    try:
        step = model.loop.core.step
        model.loop.core.step = lambda: time.sleep(0.03) or step()  # 100 tokens take > 3 s
        streamed = FakeRequest(text_input="hello", stream=True, **LONG)
        whole = FakeRequest(text_input="hello", **LONG)
        model.execute([streamed, whole])
        deadline = time.monotonic() + 30
        while not streamed.sender.sent and time.monotonic() < deadline:
            time.sleep(0.01)
        assert streamed.sender.sent  # generating
        end_requests(repo)
        assert (repo / "tiny" / module.END_MARKER).exists()
        sent = wait(streamed, 10)
        last, flags = sent[-1]
        assert flags == FINAL and outputs(last)["reason"] == "abort"
        ids = [t for r, _ in sent for t in outputs(r)["ids"]]
        full = reference.generate(["hello"], SamplingParams(**LONG))[0].token_ids
        assert 0 < len(ids) < 100 and ids == full[:len(ids)]
        [(resp, flags)] = wait(whole, 10)
        assert flags == FINAL and resp.has_error() and "shutting down" in resp.error().message()
        assert resp.error().code() == pb.TritonError.UNAVAILABLE
        deadline = time.monotonic() + 5
        while model.loop.core.num_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not model.loop.core.num_requests  # the engine is idle: both were aborted there
    finally:
        model.finalize()
    # a model loaded again over the same folder removes the old marker and serves
    assert (model_dir / module.END_MARKER).exists()
    model, module = load(model_dir, "tiny")
    try:
        assert not (repo / "tiny" / module.END_MARKER).exists()
        req = FakeRequest(text_input="hello", max_tokens=3, temperature=0.0, ignore_eos=True)
        model.execute([req])
        [(resp, _)] = wait(req)
        assert outputs(resp)["reason"] == "length"
    finally:
        model.finalize()
