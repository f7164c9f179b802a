"""FP8 weight kernels: the fp8 skinny GEMM and the per-token activation quantization against their
torch references at odd sizes (Triton interpreter on CPU; compiled on a GPU), every config,
launcher checks, and `fp8_linear`'s dispatch (the reference off fp8 GPUs)."""

import pytest
import torch
import torch.nn.functional as F

from infhip.plugins import fp8_linear as fl
from infhip.plugins.fp8_linear import (
    fp8_linear, quantize_act_ref, quantize_act_triton, quantize_weight, scaled_mm_linear,
)
from infhip.plugins.fp8_skinny_gemm import (
    CONFIGS, GEMV_CANDIDATES, MAX_M, Fp8SkinnyConfig, fp8_linear_ref, fp8_skinny_gemm_triton, table_config,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the exact product is float32 (an e4m3 weight is exact in bf16 too); bf16 outputs round once
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def inputs(m, n, k, dtype, bias, seed=0):
    """x [m, k], an fp8 weight [n, k] with per-row scales spanning 4 decades, bias [n]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w_real = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
    w, scale = quantize_weight(w_real)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w.to(DEVICE), scale.to(DEVICE), b


def exact(x, w, scale, b):
    """float32 product of x and the dequantized weight."""
    return F.linear(x.float(), w.float() * scale[:, None], None if b is None else b.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_every_config_matches_reference(dtype, m, bias):
    """N=37, K=70: neither a multiple of any block (masked K tail, clamped last N tile; split-K
    with an empty last split)."""
    x, w, scale, b = inputs(m, 37, 70, dtype, bias)
    ref = exact(x, w, scale, b)
    tried = 0
    for cfg in CONFIGS:
        if not cfg.applies(m):
            continue
        got = fp8_skinny_gemm_triton(x, w, scale, b, cfg)
        assert got.dtype == dtype and got.shape == (m, 37), str(cfg)
        assert rel_err(got, ref) < TOL[dtype], str(cfg)
        tried += 1
    assert tried == (len(CONFIGS) if m == 1 else sum(c.dot for c in CONFIGS))


def test_every_gemv_candidate_matches_reference():
    """The M == 1 sweep's extra configs at N=37, K=70 (masked K tail, clamped last row block)."""
    x, w, scale, b = inputs(1, 37, 70, torch.bfloat16, True)
    ref = exact(x, w, scale, b)
    for cfg in GEMV_CANDIDATES:
        got = fp8_skinny_gemm_triton(x, w, scale, b, cfg)
        assert got.dtype == torch.bfloat16 and got.shape == (1, 37), str(cfg)
        assert rel_err(got, ref) < TOL[torch.bfloat16], str(cfg)


@pytest.mark.parametrize("cfg", [table_config(1, 11, 254), Fp8SkinnyConfig(8, 64, 4, 2, dot=False, split_k=3)],
                         ids=str)
def test_gemv_every_fp8_byte_exact(cfg):
    """Every finite e4m3 byte (subnormals included), each row a different order, x with a row
    scaled to 1e-6 (products far below 2^-126 unless pre-scaled): float32 results equal to the
    float32 product's rounding. On a GPU this is what catches flushed subnormals (the table's
    GEMV, and a split-K one)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # no NaNs
    g = torch.Generator().manual_seed(5)
    w = torch.stack([codes[torch.randperm(len(codes), generator=g)] for _ in range(11)]).view(torch.float8_e4m3fn)
    w[3] = codes[(codes & 0x78) == 0].repeat(16)[:len(codes)].view(torch.float8_e4m3fn)  # subnormals (and zeros) only
    scale = torch.logspace(-4, 2, 11)
    k = w.shape[1]
    for x in (torch.randn(1, k, generator=g), torch.randn(1, k, generator=g) * 1e-6):
        x, wd, sd = x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE)
        got, ref = fp8_skinny_gemm_triton(x, wd, sd, None, cfg), exact(x, wd, sd, None)
        assert ((got - ref).abs() <= 1e-5 * (x.abs() @ (wd.float() * sd[:, None]).abs().t())).all(), str(cfg)
        assert rel_err(got[:, 3], ref[:, 3]) < 1e-5, str(cfg)


@pytest.mark.parametrize("cfg", [Fp8SkinnyConfig(16, 64, 4, 2, split_k=3), Fp8SkinnyConfig(8, 64, 4, 2, dot=False)],
                         ids=str)
def test_even_k_strided_x_and_fp16(cfg):
    """K a multiple of BLOCK_K * SPLIT_K (unmasked loads), x a strided row view, fp16."""
    k = 3 * 64 * cfg.split_k
    x, w, scale, b = inputs(1, 45, k + 8, torch.float16, True, seed=1)
    x = x[:, 3:3 + k]
    w = w[:, :k].contiguous()
    assert x.stride() == (k + 8, 1)
    assert rel_err(fp8_skinny_gemm_triton(x, w, scale, b, cfg), exact(x, w, scale, b)) < TOL[torch.float16]


def test_reference_dequantizes_in_x_dtype():
    x, w, scale, b = inputs(2, 5, 9, torch.bfloat16, True)
    wd = (w.float() * scale[:, None]).to(torch.bfloat16)
    assert torch.equal(fp8_linear_ref(x, w, scale, b), F.linear(x, wd, b))
    x3 = x.reshape(2, 1, 9)
    assert fp8_linear_ref(x3, w, scale, b).shape == (2, 1, 5)


def test_quantize_weight_is_per_channel_e4m3():
    w = torch.randn(300, 33) * torch.logspace(-4, 2, 300)[:, None]
    w[7] = 0.0  # an all-zero row reads back as zeros
    q, scale = quantize_weight(w, rows_per_chunk=64)  # several chunks
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (300,)
    back = q.float() * scale[:, None]
    assert torch.equal(back[7], torch.zeros(33))
    assert torch.allclose(q.float().abs().amax(1)[scale > 1e-20], torch.tensor(448.0))
    # e4m3: 3 mantissa bits, so every element within 2^-4 relative (above the subnormal range)
    big = w.abs() > w.abs().amax(1, keepdim=True) * 2 ** -6
    assert ((back - w).abs() <= 2 ** -4 * w.abs() + 1e-30)[big].all()


@pytest.mark.parametrize("k", [70, fl.MAX_BLOCK_K + 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_act_matches_reference_exactly(k, dtype):
    """One tile and several (K past MAX_BLOCK_K); rows of very different magnitude, a zero row."""
    g = torch.Generator().manual_seed(k)
    x = (torch.randn(5, k, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5e2])[:, None]).to(DEVICE, dtype)
    q, s = quantize_act_triton(x)
    q_ref, s_ref = quantize_act_ref(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())  # as values: the kernel's rounding drops -0's sign


def test_scaled_mm_path_matches_reference():
    """Per-token fp8 activations x per-channel fp8 weights: the fp8 rounding of x on top of the
    reference's (2^-4 per element, averaged over K), and a bf16 output."""
    x, w, scale, b = inputs(40, 48, 96, torch.bfloat16, True, seed=3)
    got = scaled_mm_linear(x, w, scale, b)
    assert got.dtype == torch.bfloat16 and got.shape == (40, 48)
    assert rel_err(got, exact(x, w, scale, b)) < 3e-2


def test_dispatch_off_fp8_devices_is_the_reference(monkeypatch):
    """CPU (and GPUs below sm_89) run the dequantizing reference for any row count."""
    x, w, scale, b = inputs(20, 37, 70, torch.bfloat16, True)
    if DEVICE == "cuda":
        monkeypatch.setattr(fl, "device_has_fp8", lambda device: False)
    for rows in (x[:1], x[:3], x, x.reshape(4, 5, 70)):
        assert torch.equal(fp8_linear(rows, w, scale, b), fp8_linear_ref(rows, w, scale, b))


@pytest.mark.skipif(DEVICE != "cuda", reason="the fp8 paths need an sm_89+ GPU")
@pytest.mark.parametrize("m", [1, 4, 16, 17, 300])
def test_dispatch_on_gpu_matches_reference(m):
    """Llama-3.1-8B's o_proj shape through whatever path the rows take (kernel or scaled_mm)."""
    if not fl.device_has_fp8(torch.device("cuda")):
        pytest.skip("GPU below sm_89")
    x, w, scale, _ = inputs(m, 4096, 4096, torch.bfloat16, False, seed=m)
    got = fp8_linear(x, w, scale)
    tol = TOL[torch.bfloat16] if m <= MAX_M and table_config(m, 4096, 4096) else 3e-2
    assert rel_err(got, exact(x, w, scale, None)) < tol


def test_launcher_rejects_bad_inputs():
    x, w, scale, _ = inputs(17, 37, 70, torch.float32, False)
    with pytest.raises(AssertionError, match="M=17"):
        fp8_skinny_gemm_triton(x, w, scale)
    with pytest.raises(AssertionError, match="w is"):
        fp8_skinny_gemm_triton(x[:2], w[:, :69].contiguous(), scale)
    with pytest.raises(AssertionError, match="float8_e4m3fn"):
        fp8_skinny_gemm_triton(x[:2], w.float(), scale)
    with pytest.raises(AssertionError, match="scale must be float32"):
        fp8_skinny_gemm_triton(x[:2], w, scale[:36])
    with pytest.raises(AssertionError, match="contiguous"):
        fp8_skinny_gemm_triton(x[:2], w.T.contiguous().T, scale)
    with pytest.raises(AssertionError, match="needs M == 1"):
        fp8_skinny_gemm_triton(x[:2], w, scale, config=Fp8SkinnyConfig(8, 64, 4, 2, dot=False))
    with pytest.raises(AssertionError, match="bias"):
        fp8_skinny_gemm_triton(x[:2], w, scale, torch.zeros(36, device=DEVICE))
    with pytest.raises(AssertionError, match="contiguous rows"):
        quantize_act_triton(x.T)
