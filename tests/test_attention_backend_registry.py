"""A third attention backend added by files only (tests/_toy_method.py, its plan method: knobs
and a preset; tests/_toy_backend.py, its runtime side: "sink_window", the sink and the last W
tokens): built into an engine with its own preset and knobs, saved and loaded (its knobs changed
per load), served over HTTP; the runner attaches it to the layers its plan names, plans, uploads
and runs it eagerly (checked against dense attention restricted to those keys), replays it in
CUDA graphs (GPU), and the builder's AOT enumeration asks its method's plugin modules."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

from infhip import LLM, SamplingParams
from infhip.builder.build import build_engine
from infhip.config import EngineConfig, EngineFormatError
from infhip.plugins.dense_attention import dense_attention_ref
from infhip.runtime.attention import backends
from tests._graph_sim import simulate_graphs
from tests._serving import post, running_server
from tests._tiny import build_tiny_api_engine
from tests._toy_backend import SinkWindowBackend, register_toy, unregister_toy
from tests._toy_method import SinkWindow, SinkWindowKnobs

PROMPTS = [[(5 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((40, 17, 70))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
KNOBS = {"layers": [1], "sink": 4, "window": 8}  # layer 1, 4 sink tokens, the last 8


@pytest.fixture(scope="module")
def toy():
    """The toy's two registrations (its plan method, its backend), undone after the module."""
    register_toy()
    yield SinkWindowBackend
    unregister_toy()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """The tiny Llama's dense engine (float32, CPU)."""
    return build_tiny_api_engine(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def engine(dense, toy):
    """The same weights built with the toy's preset and knobs."""
    return build_engine(checkpoint=dense.parent / "hf", output_dir=dense.parent / "toy", dtype="float32",
                        device="cpu", max_seq_len=128, max_batch_size=4, progress=False, preset="sink-window",
                        sink_window_overrides=KNOBS)


def tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def reference(layer, q, ctx, meta, knobs) -> torch.Tensor:
    """Dense attention of each row of q (rotated) over exactly the keys the toy keeps, read from
    the layer's cache through the step's host lists (float64, plugins/dense_attention.py)."""
    kv, ps = layer.kv, layer.kv.k.shape[1]
    tables = ctx.groups[layer.kv_group].block_tables.tolist()
    rows = []
    for t, (b, p) in enumerate(zip(meta.seq_of_row.tolist(), ctx.positions.tolist())):
        keep = [j for j in range(p + 1) if j < knobs.sink or j > p - knobs.window]
        slots = torch.tensor([tables[b][j // ps] * ps + j % ps for j in keep])
        keys = kv.k.reshape(-1, *kv.k.shape[2:])[slots]
        vals = kv.v.reshape(-1, *kv.v.shape[2:])[slots]
        rows.append(dense_attention_ref(q[t:t + 1], keys, vals, torch.tensor([p]), torch.tensor(keep), layer.scale))
    return torch.cat(rows)


def test_the_engine_stores_the_toys_plan_and_refuses_to_load_without_it(engine, toy):
    d = json.loads((engine / "config.json").read_text())
    assert d["plan"]["preset"] == "sink-window" and d["plan"]["knobs"] == {"sink_window": KNOBS}
    assert [lp["backend"] for lp in d["plan"]["layers"]] == ["dense", "sink_window"] + ["dense"] * (len(d["plan"]["layers"]) - 2)
    assert EngineConfig.load(engine).plan.knobs_of("sink_window") == SinkWindowKnobs((1,), 4, 8)
    unregister_toy()
    try:
        with pytest.raises(EngineFormatError, match="sink_window.*not registered.*import the module"):
            EngineConfig.load(engine)
    finally:
        register_toy()


def test_registered_backend_runs_eagerly_on_its_layers(engine, toy, monkeypatch):
    assert toy in backends()
    seen, real = [], toy.run

    def checked(self, layer, q, k, v, ctx, meta):
        out = real(self, layer, q, k, v, ctx, meta)  # q is rotated in place, K/V written
        err = (out.float() - reference(layer, q, ctx, meta, self.knobs)).abs().max().item()
        full = SinkWindowKnobs(sink=0, window=1 << 20)  # every key: dense attention
        off = (out.float() - reference(layer, q, ctx, meta, full)).abs().max().item()
        seen.append((layer.layer_index, q.shape[0], err, off))
        return out

    monkeypatch.setattr(toy, "run", checked)
    llm = LLM(engine)
    # attached: the engine's read-out shows the toy's own (AttentionBackend.debug_view) by name
    assert llm.debug_view()["backends"] == {"sink_window": {"sink": 4, "window": 8}}
    claimed = [layer.self_attn.layer_index for layer in llm.engine.model.layers
               if isinstance(layer.self_attn.backend, toy)]
    assert claimed == [1]
    tokens(llm)
    assert {layer for layer, _, _, _ in seen} == {1}, "only the claimed layer runs it"
    assert any(rows > 1 for _, rows, _, _ in seen) and any(rows == 3 for _, rows, _, _ in seen)  # prefill and decode
    assert max(err for _, _, err, _ in seen) < 1e-4
    assert min(off for _, _, _, off in seen) > 1e-3, "and it is not dense attention (every step has long rows)"


def test_a_window_covering_the_context_equals_dense(engine, toy, monkeypatch):
    """sink + window covering every position (a load's override of its knobs): the toy's
    attention is dense attention (its outputs equal the dense reference over every key; greedy
    tokens of the tiny random model are too close to ties to compare)."""
    full = SinkWindowKnobs(sink=0, window=1 << 20)
    errs, real = [], toy.run

    def checked(self, layer, q, k, v, ctx, meta):
        out = real(self, layer, q, k, v, ctx, meta)
        errs.append((out.float() - reference(layer, q, ctx, meta, full)).abs().max().item())
        return out

    monkeypatch.setattr(toy, "run", checked)
    llm = LLM(engine, sink_window_overrides={"window": 128})
    assert llm.debug_view()["backends"] == {"sink_window": {"sink": 4, "window": 128}}
    tokens(llm)
    assert errs and max(errs) < 1e-4
    with pytest.raises(ValueError, match="layers needs a rebuild"):
        LLM(engine, sink_window_overrides={"layers": [0]})


def test_a_step_without_the_backends_meta_runs_its_layers_densely(engine, dense, toy, monkeypatch):
    """plan -> None (no row of the step is the backend's; so too a graph whose key leaves the
    backend out, e.g. the dense graph captured at load): its layers run the dense backend, and
    the engine gives the tokens of the dense engine of the same weights."""
    dense = tokens(LLM(dense, enforce_eager=True))
    ran = []
    monkeypatch.setattr(toy, "plan", lambda self, step, seqs: None)
    monkeypatch.setattr(toy, "run", lambda self, *a: ran.append(1))
    assert tokens(LLM(engine, enforce_eager=True)) == dense
    assert not ran


def test_aot_enumeration_asks_its_methods_plugin_modules(engine, toy, monkeypatch):
    """The toy has no Triton kernel (torch only); a method that lists a plugin module gets its
    aot_launches asked with the engine's space, as InfiniteHiP's plugins are."""
    from infhip.builder.kernels import enumerate_variants
    from infhip.plugins.aot import Target

    asked = []
    fake = types.ModuleType("infhip.plugins.toy_kernels")
    fake.aot_launches = asked.append
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(SinkWindow, "plugin_modules", ("infhip.plugins.toy_kernels",))
    config = EngineConfig.load(engine)
    variants = enumerate_variants(config, Target())
    assert len(asked) == 1 and asked[0].plan == config.plan and variants


def test_served_over_http(engine, toy):
    """infhip-serve serves the toy's engine: a completion equals LLM.generate's tokens."""
    llm = LLM(engine)
    want = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=GREEDY)[0].token_ids
    with running_server(llm) as server:
        status, body = post(server, {"model": "infhip", "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0,
                                     "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    choice = json.loads(body)["choices"][0]
    assert choice["token_ids"] == want


def test_graph_inputs_read_eagerly_equal_eager_steps(engine, toy, monkeypatch):
    """The CUDA-graph path without CUDA (tests/_graph_sim.py): every pure decode step staged for
    a graph of the toy's key and run on the context that graph would capture gives the eager
    steps' tokens, and every key was planned at load."""
    eager = tokens(LLM(engine))
    llm = LLM(engine)
    keys, planned = simulate_graphs(llm, monkeypatch)
    assert tokens(llm) == eager
    assert keys and all(key.of("sink_window") == "all" and key in planned for key in keys)


@pytest.mark.gpu
def test_registered_backend_replays_in_cuda_graphs(tmp_path, toy):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests._tiny import write_tiny_hf_checkpoint

    write_tiny_hf_checkpoint(tmp_path / "hf", "llama", tokenizer=True)
    gpu = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "engine", dtype="bfloat16",
                       device="cuda", max_seq_len=128, max_batch_size=4, progress=False, preset="sink-window",
                       sink_window_overrides=KNOBS)
    eager = tokens(LLM(gpu, enforce_eager=True))
    llm = LLM(gpu)
    assert tokens(llm) == eager
    graphs = llm.debug_view()["graphs"]
    assert any(g["backends"].get("sink_window") == "all" for g in graphs["captured"]) and graphs["report"]["on_request"] == 0
