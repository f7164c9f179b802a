"""Per-token fp8 activation quantization fused into RMSNorm and the gated activation (issue 47).

The fused kernels (Triton interpreter on CPU; compiled on a GPU) write the same fp8 bytes and
float32 scales as quantize_act of the plain kernels' output, at odd widths, with zero rows, one
tile and several; both agree with float64 references of the formula to e4m3's rounding; the
float64 quantization rule equals quantize_rows' float32 one; fp8_linear takes the result and
gives the scaled_mm product of the separate path exactly; the model blocks hand it only where
the consumer is an fp8 linear on its scaled_mm path; and a tiny fp8-weight engine (every launch
through the interpreter, as on an sm_90 GPU) computes the same logits and tokens with and
without the fusion.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infhip.plugins import activation as act_mod
from infhip.plugins import fp8_linear as fl
from infhip.plugins.activation import gated_act, gated_act_ref, gated_act_triton
from infhip.plugins.fp8_linear import Fp8Act, fp8_linear, quantize_act_triton, quantize_weight, scaled_mm_linear
from infhip.plugins.fp8_skinny_gemm import fp8_linear_ref, table_config
from infhip.plugins.kv_quant import FP8_DTYPE, FP8_MAX, quantize_rows
from infhip.plugins.rms_norm import rms_norm, rms_norm_ref, rms_norm_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 80), (5, 1000), (33, 80)]  # (rows M, width K or I)
DTYPES = [torch.float32, torch.bfloat16]
TINY = torch.tensor(1e-30, dtype=torch.float32).double()  # quantize_rows' floor, as float32


# ------------------------------------------------------------------------- float64 references

def quantize_rows64(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y [M, K] -> (fp8 [M, K], float32 scale [M]) in float64 math: scale = max(amax, 1e-30) / 448
    rounded once to float32, q = y / scale clamped to +-448, rounded once to e4m3."""
    y64 = y.double()
    scale = (y64.abs().amax(-1).clamp(min=TINY) / FP8_MAX).float()
    q = (y64 / scale.double()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def rms_norm64(x, w, eps, residual=None):
    """float64 RMSNorm of the (rounded) residual stream, rounded to x.dtype -> (y, h)."""
    h = x if residual is None else (x.double() + residual.double()).to(x.dtype)
    h64 = h.double()
    y = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return y, h


def gated_act64(gate_up, kind):
    I = gate_up.shape[-1] // 2
    g, u = gate_up[:, :I].double(), gate_up[:, I:].double()
    a = F.silu(g) if kind == "silu" else 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))
    return a * u


def assert_near_ref64(got: Fp8Act, y64: torch.Tensor, dtype: torch.dtype):
    """got (a kernel's fp8 rows) against the float64 value y64 [M, K]: the scale within the
    output dtype's rounding of amax, each element within e4m3's half step (2^-4 relative; half
    the subnormal step 2^-10 * scale near zero) plus the dtype's rounding (the interpreter
    truncates bf16 casts: a whole bf16 ulp)."""
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -20
    amax = y64.abs().amax(-1)
    scale = got.scale.double()
    assert ((scale * FP8_MAX - amax).abs() <= ulp * amax + 2e-30).all()
    deq = got.q.double() * scale[:, None]
    bound = (2 ** -4 + ulp) * y64.abs() + 2 ** -9 * scale[:, None] + ulp * amax[:, None] * 2 ** -4
    assert ((deq - y64).abs() <= bound).all()


def assert_same_fp8(a: Fp8Act, q: torch.Tensor, s: torch.Tensor):
    """Same bytes (signed zeros included) and the same float32 scales."""
    assert a.q.dtype == FP8_DTYPE and a.q.shape == q.shape and a.q.is_contiguous()
    assert torch.equal(a.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(a.scale, s)


def inputs(m, k, dtype, seed, spread=3.0):
    """x [m, k] with row magnitudes over 4 decades and row 0 (of m > 1) all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None] * spread
    if m > 1:
        x[0] = 0
    return x.to(DEVICE, dtype)


def test_float64_rule_is_quantize_rows():
    """The float64 reference rule and quantize_rows' float32 one give the same bytes and scales
    (division rounded once, innocuous double rounding), zero rows and outliers included."""
    x = inputs(33, 1000, torch.float32, seed=0)
    x[3, 7] = 3e4  # an outlier row
    q64, s64 = quantize_rows64(x.cpu())
    q32, s32 = quantize_rows(x.cpu())
    assert torch.equal(s64, s32) and torch.equal(q64.view(torch.uint8), q32.view(torch.uint8))
    assert s32[0] == TINY.float() / FP8_MAX and (q32[0].float() == 0).all()


# ------------------------------------------------------------------------------------ rms_norm

@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fused_equals_separate_quantize_act(m, k, dtype, with_residual):
    x = inputs(m, k, dtype, seed=m * k)
    w = torch.randn(k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    res = inputs(m, k, dtype, seed=m * k + 1) * 0.5 if with_residual else None
    if res is not None:
        res[0] = -x[0]  # a zero row of the new stream (x's row 0 is zero too)
    fused = rms_norm_triton(x, w, 1e-6, res, quantize=True)
    plain = rms_norm_triton(x, w, 1e-6, res)
    if with_residual:
        assert torch.equal(fused[1], plain[1])  # the residual stream is untouched by the fusion
        (fused, h), plain = fused, plain[0]
    assert isinstance(fused, Fp8Act) and fused.dtype == dtype and fused.shape == (m, k)
    assert_same_fp8(fused, *quantize_act_triton(plain))
    if m > 1:  # the zero row: zeros and the floor scale (read back as zeros)
        assert (fused.q[0].float() == 0).all() and fused.scale[0] == TINY.float() / FP8_MAX
    # float64 norm of the stream as the kernel rounded it (the interpreter truncates bf16 casts;
    # the stream itself is checked against the reference in test_plugins_norm_act_rope)
    y64, _ = rms_norm64((x if res is None else h).cpu(), w.cpu(), 1e-6)
    assert_near_ref64(Fp8Act(fused.q.cpu(), fused.scale.cpu(), dtype), y64, dtype)
    # the torch reference's fused form is quantize_act's reference of its plain output
    ref = rms_norm_ref(x, w, 1e-6, res, quantize=True)
    ref = ref[0] if with_residual else ref
    plain_ref = rms_norm_ref(x, w, 1e-6, res)
    assert_same_fp8(ref, *quantize_rows(plain_ref[0] if with_residual else plain_ref))


def test_rms_norm_fused_rejects_per_head_rows():
    q = torch.randn(3, 2, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="fp8 output is for"):
        rms_norm_triton(q, torch.ones(16, device=DEVICE), 1e-6, quantize=True)


# ------------------------------------------------------------------------------- gated_act

@pytest.mark.parametrize("m,i", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_gated_act_fused_equals_separate_quantize_act(m, i, dtype, kind):
    gate_up = inputs(m, 2 * i, dtype, seed=m + i, spread=1.0)
    fused = gated_act_triton(gate_up, kind, quantize=True)
    plain = gated_act_triton(gate_up, kind)
    assert isinstance(fused, Fp8Act) and fused.dtype == dtype and fused.shape == (m, i)
    assert_same_fp8(fused, *quantize_act_triton(plain))
    if m > 1:
        assert (fused.q[0].float() == 0).all() and fused.scale[0] == TINY.float() / FP8_MAX
    assert_near_ref64(Fp8Act(fused.q.cpu(), fused.scale.cpu(), dtype), gated_act64(gate_up.cpu(), kind), dtype)
    assert_same_fp8(gated_act_ref(gate_up, kind, quantize=True), *quantize_rows(gated_act_ref(gate_up, kind)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_act_fused_in_tiles(monkeypatch, dtype):
    """Rows wider than MAX_ROW_BLOCK: two passes over ROW_TILE tiles (shrunk here so that a
    1000-wide row takes 4 tiles, the last one partial) give the same bytes."""
    monkeypatch.setattr(act_mod, "MAX_ROW_BLOCK", 512)
    monkeypatch.setattr(act_mod, "ROW_TILE", 256)
    assert act_mod._fused_launch(1000)[:2] == (256, False)
    gate_up = inputs(5, 2000, dtype, seed=7, spread=1.0)
    gate_up[2, 999] = 40.0  # the row's amax in the last, partial tile
    fused = gated_act_triton(gate_up, "silu", quantize=True)
    assert_same_fp8(fused, *quantize_act_triton(gated_act_triton(gate_up, "silu")))
    assert_near_ref64(Fp8Act(fused.q.cpu(), fused.scale.cpu(), dtype), gated_act64(gate_up.cpu(), "silu"), dtype)


def test_gated_act_fused_launch_shapes():
    """Llama-8B's I = 14336 stays in registers (one pass); Llama-70B's 28672 takes the tiles."""
    assert act_mod._fused_launch(14336) == (16384, True, 16)
    assert act_mod._fused_launch(1536) == (2048, True, 8)
    assert act_mod._fused_launch(28672) == (act_mod.ROW_TILE, False, 8)


def test_zero_rows_launch_nothing():
    for out in (rms_norm_triton(torch.empty(0, 80, device=DEVICE), torch.ones(80, device=DEVICE), 1e-6, quantize=True),
                gated_act_triton(torch.empty(0, 160, device=DEVICE), "silu", quantize=True)):
        assert out.shape == (0, 80) and out.scale.shape == (0,)


# ------------------------------------------------------------------------------- fp8_linear

def weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, scale = quantize_weight(torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None])
    return w.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_linear_takes_fused_rows_bit_identically(monkeypatch, dtype):
    """On the scaled_mm path (forced on, as on an sm_89+ GPU) a fused Fp8Act gives exactly the
    separate path's product; off it (CPU, GPUs below sm_89) the reference of its dequantized rows."""
    x = inputs(33, 80, dtype, seed=3)
    w_norm = torch.randn(80, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    w, scale = weight(48, 80)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    fused = rms_norm_triton(x, w_norm, 1e-6, quantize=True)
    plain = rms_norm_triton(x, w_norm, 1e-6)
    monkeypatch.setattr(fl, "_fast_device", lambda device: True)
    got = fp8_linear(fused, w, scale, bias)
    assert got.dtype == dtype and got.shape == (33, 48)
    assert torch.equal(got, scaled_mm_linear(plain, w, scale, bias))
    assert torch.equal(got, fp8_linear(plain, w, scale, bias))
    monkeypatch.setattr(fl, "_fast_device", lambda device: False)
    assert torch.equal(fp8_linear(fused, w, scale, bias), fp8_linear_ref(fused.dequantize(), w, scale, bias))


def test_takes_fp8_act_follows_the_dispatch(monkeypatch):
    """Only the rows fp8_linear sends to torch._scaled_mm: not decode rows the skinny kernel
    takes, not zero rows, not off fp8 devices, not widths scaled_mm refuses."""
    w, _ = weight(4096, 4096)  # Llama-8B's o_proj shape: the skinny table covers M <= 16
    x = lambda m, k=4096: torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    assert not fl.takes_fp8_act(x(300), w)  # CPU / meta: the reference
    monkeypatch.setattr(fl, "_fast_device", lambda device: True)
    assert table_config(4, 4096, 4096) is not None
    assert not fl.takes_fp8_act(x(4), w) and not fl.takes_fp8_act(x(0), w)
    assert fl.takes_fp8_act(x(17), w) and fl.takes_fp8_act(x(300), w)
    assert not fl.takes_fp8_act(torch.empty(300, 4096, dtype=torch.int8, device="meta"), w)
    w_odd, _ = weight(40, 72)
    assert not fl.takes_fp8_act(x(300, 72), w_odd)  # N = 40: not a multiple of 16


def test_dispatch_off_the_gpu_never_quantizes():
    """CPU runs (no forcing): the norm and the activation return their plain rows."""
    x = torch.randn(40, 80)
    assert torch.equal(rms_norm(x, torch.ones(80), 1e-6), rms_norm_ref(x, torch.ones(80), 1e-6))
    assert isinstance(gated_act(torch.randn(40, 160), "silu"), torch.Tensor)


# ------------------------------------------------------------------------------ the model

def test_bf16_blocks_never_quantize(monkeypatch):
    """A bf16 engine's consumers are SkinnyLinear: the producers keep their rows, whatever the device."""
    from infhip.runtime.models.common import Fp8Linear, linear, quantizes_input

    monkeypatch.setattr(fl, "_fast_device", lambda device: True)
    x = torch.empty(300, 64, dtype=torch.bfloat16)
    assert not quantizes_input(linear(64, 128), x)
    fp8 = Fp8Linear(64, 128)
    fp8.weight = torch.nn.Parameter(torch.empty(128, 64, dtype=FP8_DTYPE), requires_grad=False)
    assert quantizes_input(fp8, x) and not quantizes_input(fp8, x[:1])


def _run(engine, prompts, params):
    """(last-token logits of the first prompt's prefill, greedy tokens)."""
    from infhip import LLM
    from tests.test_runtime_vs_hf import last_logits

    llm = LLM(engine, max_num_batched_tokens=64)
    logits = last_logits(llm, prompts[0])
    return logits, [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fp8_engine_same_tokens_with_and_without_fusion(tiny_engine, monkeypatch, arch):
    """As on an sm_89+ GPU (the fp8 paths forced on; the norm, the activation and quantize_act
    interpreted, attention on its reference to save CPU time): prefill chunks of 20+ rows take
    scaled_mm with fused fp8 rows from the norms and the activation, decode rows the skinny
    kernel with plain rows; the logits are bit-identical to the separate quantize_act's, hence
    the tokens. (tests/test_aot_coverage.py runs every kernel, the fused ones included.)"""
    import infhip.plugins.rms_norm as norm_mod
    import infhip.runtime.models.common as common
    from infhip import SamplingParams
    from tests.test_aot_coverage import G3, L2, PROMPTS

    hf = L2 if arch == "llama" else G3
    engine = tiny_engine(arch, hf=hf, weight_dtype="fp8", max_seq_len=200, max_batch_size=4)
    # Gemma-3's tiny model interprets ~3x slower: one prompt, fewer tokens
    prompts = [PROMPTS[0][:45], PROMPTS[1][:20]] if arch == "llama" else [PROMPTS[0][:40]]
    params = SamplingParams(max_tokens=4 if arch == "llama" else 2, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(fl, "_fast_device", lambda device: True)
    fused_rows = []
    for mod, name in ((norm_mod, "rms_norm_triton"), (act_mod, "gated_act_triton")):
        monkeypatch.setattr(mod, "use_triton", lambda *t: True)
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda x, *a, _real=real, _name=name, **kw: (
            fused_rows.append((_name, x.shape[0])) if a[-1] is True else None) or _real(x, *a, **kw))
    fused = _run(engine, prompts, params)
    assert {n for n, _ in fused_rows} == {"rms_norm_triton", "gated_act_triton"}
    assert min(rows for _, rows in fused_rows) > 16  # never decode rows (the skinny kernel's)
    monkeypatch.setattr(common, "FUSE_FP8_ACT", False)
    fused_rows.clear()
    separate = _run(engine, prompts, params)
    assert fused_rows == []
    assert torch.equal(fused[0], separate[0])
    assert fused[1] == separate[1]
