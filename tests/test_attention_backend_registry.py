"""A third attention backend, registered once and edited nowhere else (tests/_toy_backend.py:
"sink_window", the sink and the last W tokens): the runner attaches it to the layers it claims,
plans, uploads and runs it eagerly (checked against dense attention restricted to those keys),
replays it in CUDA graphs (GPU), and the builder's AOT enumeration consults its launch space."""

from __future__ import annotations

import pytest
import torch

from infhip import LLM, SamplingParams
from infhip.plugins.dense_attention import dense_attention_ref
from infhip.runtime.attention import backends, register, unregister
from tests._graph_sim import simulate_graphs
from tests._tiny import build_tiny_api_engine
from tests._toy_backend import SinkWindowBackend, SinkWindowKnobs

PROMPTS = [[(5 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((40, 17, 70))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return build_tiny_api_engine(tmp_path_factory.mktemp("toy"))


@pytest.fixture
def toy():
    """The one registration (and its knobs: layer 1, 4 sink tokens, the last 8)."""
    SinkWindowBackend.KNOBS = SinkWindowKnobs(layers=(1,), sink=4, window=8)
    register(SinkWindowBackend)
    yield SinkWindowBackend
    unregister(SinkWindowBackend.name)
    SinkWindowBackend.KNOBS = None


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


def test_registered_backend_runs_eagerly_on_its_layers(engine, toy, monkeypatch):
    assert toy in backends()
    seen, real = [], toy.run

    def checked(self, layer, q, k, v, ctx, meta):
        out = real(self, layer, q, k, v, ctx, meta)  # q is rotated in place, K/V written
        err = (out.float() - reference(layer, q, ctx, meta, self.knobs)).abs().max().item()
        full = SinkWindowKnobs(self.knobs.layers, sink=0, window=1 << 20)  # every key: dense attention
        off = (out.float() - reference(layer, q, ctx, meta, full)).abs().max().item()
        seen.append((layer.layer_index, q.shape[0], err, off))
        return out

    monkeypatch.setattr(toy, "run", checked)
    llm = LLM(engine)
    # attached: the engine's read-out shows the toy's own (AttentionBackend.debug_view) by name
    assert llm.debug_view()["backends"] == {"sink_window": {"layers": [1], "sink": 4, "window": 8}}
    claimed = [layer.self_attn.layer_index for layer in llm.engine.model.layers
               if isinstance(layer.self_attn.backend, toy)]
    assert claimed == [1]
    tokens(llm)
    assert {layer for layer, _, _, _ in seen} == {1}, "only the claimed layer runs it"
    assert any(rows > 1 for _, rows, _, _ in seen) and any(rows == 3 for _, rows, _, _ in seen)  # prefill and decode
    assert max(err for _, _, err, _ in seen) < 1e-4
    assert min(off for _, _, _, off in seen) > 1e-3, "and it is not dense attention (every step has long rows)"


def test_a_window_covering_the_context_equals_dense(engine, toy, monkeypatch):
    """sink + window covering every position: the toy's attention is dense attention (its
    outputs equal the dense reference over every key; greedy tokens of the tiny random model
    are too close to ties to compare)."""
    toy.KNOBS = SinkWindowKnobs(layers=(0, 1), sink=4, window=128)
    full = SinkWindowKnobs((0, 1), sink=0, window=1 << 20)
    errs, real = [], toy.run

    def checked(self, layer, q, k, v, ctx, meta):
        out = real(self, layer, q, k, v, ctx, meta)
        errs.append((out.float() - reference(layer, q, ctx, meta, full)).abs().max().item())
        return out

    monkeypatch.setattr(toy, "run", checked)
    tokens(LLM(engine))
    assert errs and max(errs) < 1e-4


def test_a_step_without_the_backends_meta_runs_its_layers_densely(engine, toy, monkeypatch):
    """plan -> None (no row of the step is the backend's; so too a graph whose key leaves the
    backend out, e.g. the dense graph captured at load): its layers run the dense backend, and
    the engine gives the tokens of an engine without the toy."""
    unregister(toy.name)
    dense = tokens(LLM(engine, enforce_eager=True))
    register(toy)
    ran = []
    monkeypatch.setattr(toy, "plan", lambda self, step, seqs: None)
    monkeypatch.setattr(toy, "run", lambda self, *a: ran.append(1))
    assert tokens(LLM(engine, enforce_eager=True)) == dense
    assert not ran


def test_aot_enumeration_consults_its_launch_space(engine, toy, monkeypatch):
    """The toy has no Triton kernel (torch only): the builder still asks its launch_space, with
    the engine's space, as it asks InfiniteHiP's (which launches its plugins' aot_launches)."""
    from infhip.builder.kernels import enumerate_variants
    from infhip.config import EngineConfig
    from infhip.plugins.aot import Target

    asked = []
    monkeypatch.setattr(toy, "launch_space", classmethod(lambda cls, space: asked.append(space)))
    config = EngineConfig.load(engine)
    variants = enumerate_variants(config, Target())
    assert len(asked) == 1 and asked[0].plan == config.plan and variants


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
    from infhip.builder.build import build_engine
    from tests._tiny import write_tiny_hf_checkpoint

    write_tiny_hf_checkpoint(tmp_path / "hf", "llama", tokenizer=True)
    gpu = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "engine", dtype="bfloat16",
                       device="cuda", max_seq_len=128, max_batch_size=4, progress=False)
    eager = tokens(LLM(gpu, enforce_eager=True))
    llm = LLM(gpu)
    assert tokens(llm) == eager
    graphs = llm.debug_view()["graphs"]
    assert any(g["backends"].get("sink_window") == "all" for g in graphs["captured"]) and graphs["report"]["on_request"] == 0
