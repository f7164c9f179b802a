"""Skinny GEMM plugin: the Triton launcher against its torch reference at odd sizes (Triton
interpreter on CPU), every config of CONFIGS, input checks, the dispatcher's rules; on a GPU,
the kernel at Llama-3.1-8B decode shapes against F.linear."""

import pytest
import torch
import torch.nn.functional as F

from infhip.plugins import skinny_gemm as sg
from infhip.plugins.skinny_gemm import (
    CONFIGS, SkinnyConfig, skinny_gemm_ref, skinny_gemm_triton, skinny_linear,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: the interpreter truncates float32 -> bf16 casts (one ulp, ~4e-3 relative)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(m, n, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_config_matches_reference(dtype, m, bias):
    """N=37, K=70: neither a multiple of any block (masked K tail, clamped last N tile)."""
    x, w, b = inputs(m, 37, 70, dtype, bias)
    ref = skinny_gemm_ref(x, w, b)
    assert ref.dtype == dtype and ref.shape == (m, 37)
    tried = 0
    for cfg in CONFIGS:
        if not cfg.applies(m):
            continue
        got = skinny_gemm_triton(x, w, b, cfg)
        assert got.dtype == dtype and got.shape == (m, 37)
        assert rel_err(got, ref) < TOL[dtype], str(cfg)
        tried += 1
    assert tried == len(CONFIGS) if m == 1 else tried == sum(c.dot for c in CONFIGS)


@pytest.mark.parametrize("cfg", [CONFIGS[0], next(c for c in CONFIGS if not c.dot)], ids=str)
def test_even_k_strided_x_and_fp16(cfg):
    """K a multiple of BLOCK_K (unmasked loads), x a strided row view, fp16."""
    k = 2 * cfg.block_k
    x, w, b = inputs(1, 45, k + 8, torch.float16, True, seed=1)
    x = x[:, 3:3 + k]  # row stride k + 8
    w = w[:, :k].contiguous()
    assert x.stride() == (k + 8, 1)
    assert rel_err(skinny_gemm_triton(x, w, b, cfg), skinny_gemm_ref(x, w, b)) < TOL[torch.float16]


def test_reference_is_float32_linear():
    x, w, b = inputs(2, 5, 9, torch.bfloat16, True)
    assert torch.equal(skinny_gemm_ref(x, w, b), (x.float() @ w.float().T + b.float()).to(torch.bfloat16))


def test_launcher_rejects_bad_inputs():
    x, w, _ = inputs(17, 37, 70, torch.float32, False)
    with pytest.raises(AssertionError, match="M=17"):
        skinny_gemm_triton(x, w)
    with pytest.raises(AssertionError, match="w is"):
        skinny_gemm_triton(x[:2], w[:, :69].contiguous())
    with pytest.raises(AssertionError, match="contiguous"):
        skinny_gemm_triton(x[:2], w.T.contiguous().T)
    with pytest.raises(AssertionError, match="dtype"):
        skinny_gemm_triton(x[:2], w.to(torch.bfloat16))
    with pytest.raises(AssertionError, match=r"x must be \[M, K\]"):
        skinny_gemm_triton(x[0], w)
    with pytest.raises(AssertionError, match="bias"):
        skinny_gemm_triton(x[:2], w, torch.zeros(36))
    with pytest.raises(AssertionError, match="needs M == 1"):
        skinny_gemm_triton(x[:3], w, config=SkinnyConfig(16, 64, 4, 2, dot=False))


@pytest.mark.skipif(DEVICE == "cuda", reason="off-CUDA dispatch")
@pytest.mark.parametrize("mode", ["table", "auto", "0", "force"])
def test_dispatcher_off_cuda_is_f_linear(mode, monkeypatch):
    monkeypatch.setenv("INFHIP_SKINNY_GEMM", mode)
    for m, bias in [(1, False), (3, True), (40, False)]:
        x, w, b = inputs(m, 37, 70, torch.bfloat16, bias)
        assert torch.equal(skinny_linear(x, w, b), F.linear(x, w, b))
    assert sg.skinny_gemm_decisions() == {}


def test_choose_rules(monkeypatch):
    """INFHIP_SKINNY_GEMM, capture, and one timing per key (timings faked: no GPU needed)."""
    x, w, _ = inputs(3, 37, 70, torch.bfloat16, False)
    calls = []

    def fake_decide(x, w, bias):
        calls.append(x.shape[0])
        return sg.Decision(CONFIGS[2], {"cublas": 10.0, str(CONFIGS[2]): 8.0})

    monkeypatch.setattr(sg, "_decide", fake_decide)
    monkeypatch.setattr(sg, "_decisions", {})
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setenv("INFHIP_SKINNY_GEMM", "0")
    assert sg.choose(x, w, None) is None
    monkeypatch.setenv("INFHIP_SKINNY_GEMM", "force")
    assert sg.choose(x, w, None) == CONFIGS[0]
    monkeypatch.setenv("INFHIP_SKINNY_GEMM", "bogus")
    with pytest.raises(ValueError, match="INFHIP_SKINNY_GEMM"):
        sg.choose(x, w, None)
    monkeypatch.setenv("INFHIP_SKINNY_GEMM", "auto")
    assert sg.choose(x, w, None) is None and not calls  # undecided while capturing: F.linear, no timing
    capturing[0] = False
    assert sg.choose(x, w, None) == CONFIGS[2] and calls == [3]
    capturing[0] = True  # decided keys are used during capture
    assert sg.choose(x[:1], w, None) is None  # M bucket 1: another key
    assert sg.choose(x[:2], w, None) is None  # M bucket 2: another key
    assert sg.choose(torch.cat([x, x[:1]]), w, None) == CONFIGS[2] and calls == [3]  # M=4: bucket 4
    assert list(sg.skinny_gemm_decisions()) == [(4, 37, 70, torch.bfloat16, False, None)]


def test_default_is_the_fixed_table(monkeypatch):
    """Without INFHIP_SKINNY_GEMM: the fixed rule, no timing (reproducible kernels): the GEMV at
    M = 1 on bf16/fp16 projections up to 8192 wide, the 64-row dot kernel on LM-head-wide
    outputs, cuBLAS for the rest and for float32."""
    monkeypatch.delenv("INFHIP_SKINNY_GEMM", raising=False)
    monkeypatch.setattr(sg, "_decide", lambda *a: pytest.fail("timed in table mode"))
    x1 = torch.zeros(1, 4096, dtype=torch.bfloat16)
    assert sg.choose(x1, torch.zeros(6144, 4096, dtype=torch.bfloat16), None) == sg._GEMV_M1
    assert sg.choose(x1, torch.zeros(28672, 4096, dtype=torch.bfloat16), None) is None  # gate_up
    assert sg.choose(torch.zeros(1, 14336, dtype=torch.bfloat16),
                     torch.zeros(4096, 14336, dtype=torch.bfloat16), None) is None  # down
    assert sg.choose(x1.expand(3, -1), torch.zeros(4096, 4096, dtype=torch.bfloat16), None) is None  # M > 1
    lm_head = torch.zeros(1, 4096, dtype=torch.bfloat16).expand(128256, -1)  # only its shape is read
    assert sg.choose(x1.expand(5, -1), lm_head, None) == sg._LM_HEAD
    assert sg.choose(x1.float(), torch.zeros(6144, 4096), None) is None


def test_pick_needs_min_gain():
    a, b = str(CONFIGS[0]), str(CONFIGS[1])
    assert sg.pick({"cublas": 10.0, a: 9.8, b: 9.9}) is None  # < 3% faster: cuBLAS
    assert sg.pick({"cublas": 10.0, a: 9.6, b: 9.0}) == CONFIGS[1]
    assert sg.pick({"cublas": 10.0}) is None  # every config failed to launch
    assert [sg.m_bucket(m) for m in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]


# ----------------------------------------------------------------------------- GPU, real shapes

LLAMA8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_llama8b_shapes(m, monkeypatch):
    monkeypatch.setenv("INFHIP_SKINNY_GEMM", "auto")  # the timed decisions (default: fixed table)
    for name, (n, k) in LLAMA8B.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ref = F.linear(x, w)
        for cfg in CONFIGS:
            if cfg.applies(m):
                assert rel_err(skinny_gemm_triton(x, w, None, cfg), ref) < 1e-2, f"{name} {cfg}"
        assert rel_err(skinny_linear(x, w), ref) < 1e-2, name  # whichever the dispatcher chose
    assert sum(key[0] == m for key in sg.skinny_gemm_decisions()) >= len(LLAMA8B)


@pytest.mark.gpu
def test_gpu_bias_and_graph_capture(monkeypatch):
    """"auto": an undecided key met while capturing uses F.linear; a decided one replays its kernel."""
    monkeypatch.setenv("INFHIP_SKINNY_GEMM", "auto")
    x = torch.randn(2, 512, device="cuda", dtype=torch.float16)
    w = torch.randn(1000, 512, device="cuda", dtype=torch.float16) / 512 ** 0.5
    b = torch.randn(1000, device="cuda", dtype=torch.float16)
    sg.reset_skinny_gemm_decisions()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w, b)
    assert sg.skinny_gemm_decisions() == {}
    graph.replay()
    assert rel_err(y, F.linear(x, w, b)) < 1e-2
    ref = F.linear(x, w, b)
    assert rel_err(skinny_linear(x, w, b), ref) < 1e-2  # decides now
    assert len(sg.skinny_gemm_decisions()) == 1
    assert rel_err(skinny_gemm_triton(x, w, b, CONFIGS[0]), ref) < 1e-2
