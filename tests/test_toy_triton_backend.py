"""A backend with a Triton kernel, KV offload and the compile matrix, added as files plus its
registration: the toy "sink_window_triton" (tests/_toy_triton_{method,kernel,backend}.py). Its
kernel matches its torch reference under the interpreter at odd shapes, host pages included; an
engine built with its preset generates the same tokens through the kernel and through the
reference, with its pages offloaded to the host or not; the builder's AOT enumeration and the
compile matrix take its kernel (and the offload's page copies) from its method's declaration, and
its variants compile for sm_90. No file outside its own names it (docs/design/adding.md counts)."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from infhip import LLM, SamplingParams
from infhip.plugins.paged_kv import PagedKV
from tests._offload import count_moves, offload_pages
from tests._repo_files import repo_files
from tests._toy_triton_backend import register, unregister
from tests._toy_triton_kernel import sink_window_ref, sink_window_triton

KERNEL = "tests._toy_triton_kernel:_sink_window_kernel"
PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((37, 21))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def toy():
    register()
    yield
    unregister()


@pytest.fixture(scope="module")
def engine(tiny_engine, toy):
    """The tiny Llama (2 layers) with every full-attention layer on the toy, pages moving from 16
    tokens on when loaded with kv_offload_bytes."""
    return tiny_engine("llama", hf=dict(num_hidden_layers=2), max_seq_len=128, max_batch_size=4,
                       preset="sink-window-triton", sink_window_triton_overrides=dict(sink=3, window=11, offload_from=16))


@pytest.mark.parametrize("offload", [False, True])
def test_the_kernel_matches_its_reference(offload):
    """Odd shapes: 6 query heads over 2 kv heads, head dim 24, pages of 8, sink 3, window 11;
    with offload every 2nd page lives in the host twin and its GPU copy is NaN."""
    g = torch.Generator().manual_seed(0)
    T, Hq, Hkv, D, ps, pages = 5, 6, 2, 24, 8, 12
    k = torch.randn(pages, ps, Hkv, D, generator=g)
    v = torch.randn(pages, ps, Hkv, D, generator=g)
    tables = torch.tensor([[1, 3, 5, 7, 9], [2, 4, 6, 8, 10]], dtype=torch.int32)
    host = None
    if offload:
        host, tables = offload_pages(k, v, tables, every=2)
    kv = PagedKV(k, v, host=host)
    q = torch.randn(T, Hq, D, generator=g)
    seq = torch.tensor([0, 0, 1, 1, 1])
    pos = torch.tensor([0, 33, 2, 17, 39])
    got = sink_window_triton(q, kv, tables, seq, pos, 3, 11, D ** -0.5)
    want = sink_window_ref(q, kv, tables, seq, pos, 3, 11, D ** -0.5)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_and_reference_generate_alike_offloaded_or_not(engine, monkeypatch):
    """Each run's tokens equal the reference path's without offload; with kv_offload_bytes pages
    move to the host (the kernel reads them there) and nothing changes."""
    import infhip.runtime.offload.policy as offload_policy
    import tests._toy_triton_kernel as kernel

    monkeypatch.setattr(offload_policy, "OFFLOAD_BATCH_TOKENS", 16)  # tiny contexts: move pages one at a time

    def run(**kw):
        llm = LLM(engine, max_num_batched_tokens=32, **kw)
        moved = count_moves(llm)
        return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)], moved

    plain, _ = run()
    offloaded, moved = run(kv_offload_bytes=1 << 20)
    monkeypatch.setattr(kernel, "triton_on", lambda *tensors: False)
    reference, _ = run()
    assert plain == reference == offloaded
    assert moved, "no page moved to the host"


def test_aot_and_the_compile_matrix_take_it_from_its_declaration(engine):
    """enumerate_variants finds its kernel (host twin or not) and the page copies; the compile
    matrix builds its preset on every model and compiles its variants for sm_90 (through TTGIR)."""
    from infhip.builder.kernels import enumerate_variants
    from infhip.builder.matrix_compile import compile_all, representatives
    from infhip.builder.matrix_configs import TARGETS, configurations
    from infhip.builder.matrix_launches import union_variants
    from infhip.config import EngineConfig

    variants = enumerate_variants(EngineConfig.load(engine), TARGETS["sm_90"])
    ours = [v for v in variants if v.kernel == KERNEL]
    assert {dict(v.constants)["OFFLOAD"] for v in ours} == {"False", "True"}
    assert any(v.name == "_copy_pages_kernel" for v in variants)

    target = TARGETS["sm_90"]
    configs = {n: kw for n, kw in configurations(target, ("smollm2-135m",)).items() if "sink-window-triton" in n}
    assert "smollm2-135m sink-window-triton kv=bfloat16 w=bf16" in configs
    picked = {n: configs[n] for n in ("smollm2-135m sink-window-triton kv=bfloat16 w=bf16",
                                      "smollm2-135m sink-window-triton kv=bfloat16 1M")}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # in this process: the toy is registered here
        seen = union_variants(target, picked, pool=pool)
    chosen = [v for v in representatives(seen) if v.kernel == KERNEL]
    assert chosen and compile_all(chosen, target, jobs=1, stage="ttgir") == {}


def test_no_file_outside_its_own_names_it():
    own = {"tests/_toy_triton_method.py", "tests/_toy_triton_kernel.py", "tests/_toy_triton_backend.py",
           "tests/test_toy_triton_backend.py", "docs/design/adding.md"}
    naming = {p for p in repo_files() if p.endswith((".py", ".md", ".toml", ".sh", ".txt"))
              and "sink_window_triton" in open(p, encoding="utf-8", errors="ignore").read()}
    assert naming <= own, naming - own
