"""RMSNorm, gated activation and RoPE plugins: Triton launchers against their torch
references (Triton interpreter on CPU, compiled kernels on a GPU), and RoPE against
Hugging Face's own Llama rotary embedding."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from infhip.plugins.activation import gated_act, gated_act_ref, gated_act_triton
from infhip.plugins.kv_quant import FP8_DTYPE, dequantize_rows, quantize_rows
from infhip.plugins.paged_kv import PagedKV
from infhip.plugins.rms_norm import rms_norm, rms_norm_ref, rms_norm_triton
from infhip.plugins.rope import (
    apply_rope_, apply_rope_ref_, rope_and_write_kv, rope_kv_triton, write_kv, write_kv_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_cast_equal(got: torch.Tensor, ref: torch.Tensor):
    """Bit-exact after a dtype cast on GPU; the interpreter truncates float32 -> bf16
    casts instead of rounding to nearest, so there it is one bf16 ulp at most."""
    if DEVICE == "cuda" or got.dtype != torch.bfloat16:
        assert torch.equal(got, ref)
    else:
        assert ((got.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()


def randn(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


# ----------------------------------------------------------------------------- rms_norm

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_2d(dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = randn(7, 33, dtype=dtype, gen=g) * 3
    w = randn(33, gen=g)
    res = randn(7, 33, dtype=dtype, gen=g) if with_residual else None
    got = rms_norm_triton(x, w, 1e-6, res)
    ref = rms_norm_ref(x, w, 1e-6, res)
    if with_residual:
        # the new residual stream is bit-exact on GPU (the interpreter truncates bf16 casts)
        assert torch.equal(got[1], ref[1]) if DEVICE == "cuda" else rel_err(got[1], ref[1]) < TOL[dtype]
        assert torch.equal(ref[1], (x.float() + res.float()).to(dtype))
        got, ref = got[0], ref[0]
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_err(got, ref) < TOL[dtype]
    # the reference is the formula of the spec
    h = x if res is None else (x.float() + res.float()).to(dtype)
    formula = (h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(dtype)
    assert rel_err(ref, formula) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_strided_view(dtype):
    """[T, H, D] q-norm on a view into a fused qkv row (row stride > H * D)."""
    g = torch.Generator().manual_seed(1)
    T, H, D = 5, 3, 16
    qkv = randn(T, (H + 2) * D + 8, dtype=dtype, gen=g)
    q = qkv[:, : H * D].view(T, H, D)
    w = randn(D, gen=g)
    got = rms_norm(q, w, 1e-5) if DEVICE == "cuda" else rms_norm_triton(q, w, 1e-5)
    ref = rms_norm_ref(q, w, 1e-5)
    assert got.shape == (T, H, D)
    assert rel_err(got, ref) < TOL[dtype]
    # per-head rows are normalised independently
    row = rms_norm_ref(q[2, 1][None], w, 1e-5)[0]
    assert rel_err(ref[2, 1], row) < 1e-6


def test_rms_norm_dispatch_cpu_uses_reference():
    x = torch.randn(4, 20)
    w = torch.randn(20)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


# ----------------------------------------------------------------------------- gated_act

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_gated_act(dtype, kind):
    g = torch.Generator().manual_seed(2)
    I = 37
    gate_up = randn(7, 2 * I, dtype=dtype, gen=g) * 4  # wide range: exercises both tails
    got = gated_act_triton(gate_up, kind)
    ref = gated_act_ref(gate_up, kind)
    assert got.shape == (7, I) and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    act = torch.nn.functional.silu if kind == "silu" else (
        lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
    formula = (act(gate_up[:, :I].float()) * gate_up[:, I:].float()).to(dtype)
    assert rel_err(ref, formula) < 1e-6
    assert torch.isfinite(gated_act_triton(gate_up * 100, kind)).all()  # saturating tails
    if DEVICE == "cpu":
        assert torch.equal(gated_act(gate_up, kind), ref)


# ----------------------------------------------------------------------------- rope

ROPE_PARAMS = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 2048},
}


def hf_rotary(Hq, Hkv, D, kind):
    max_pos = 131072 if kind == "llama3" else 8192
    cfg = LlamaConfig(hidden_size=Hq * D, num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=D,
                      rope_parameters=ROPE_PARAMS[kind], max_position_embeddings=max_pos)
    return LlamaRotaryEmbedding(cfg)


def fused_qkv(T, Hq, Hkv, D, dtype, gen):
    """q, k, v as strided views into one [T, (Hq + 2 Hkv) D] projection output."""
    qkv = randn(T, (Hq + 2 * Hkv) * D, dtype=dtype, gen=gen)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    k = qkv[:, Hq * D: (Hq + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    return qkv, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_rope_matches_transformers(dtype, kind):
    g = torch.Generator().manual_seed(3)
    T, Hq, Hkv, D = 7, 6, 2, 16
    rot = hf_rotary(Hq, Hkv, D, kind)
    positions = torch.tensor([0, 1, 5, 37, 4095, 70000, 131071], device=DEVICE)
    qkv, q, k, v = fused_qkv(T, Hq, Hkv, D, dtype, g)
    q0, k0, v0 = q.clone(), k.clone(), v.clone()

    # HF: cos/sin in float32 from the module, applied in float32, rounded at the end
    cos, sin = rot(q0.float().cpu(), positions[None].cpu())
    hq, hk = apply_rotary_pos_emb(q0.float().transpose(0, 1)[None].cpu(), k0.float().transpose(0, 1)[None].cpu(),
                                  cos, sin)
    hf_q, hf_k = hq[0].transpose(0, 1).to(dtype), hk[0].transpose(0, 1).to(dtype)

    inv_freq = rot.inv_freq.to(DEVICE)
    rope_kv_triton(q, k, None, positions, inv_freq, rot.attention_scaling, None, None, apply_rope=True)
    assert torch.equal(v, v0), "v part of the fused projection must be untouched"
    assert rel_err(q, hf_q.to(DEVICE)) < TOL[dtype] and rel_err(k, hf_k.to(DEVICE)) < TOL[dtype]

    rq, rk = q0.clone(), k0.clone()
    apply_rope_ref_(rq, rk, positions, inv_freq, rot.attention_scaling)
    assert rel_err(q, rq) < TOL[dtype] and rel_err(k, rk) < TOL[dtype]
    if dtype == torch.float32:  # the reference is HF up to float32 rounding
        assert rel_err(rq, hf_q.to(DEVICE)) < 1e-6


def make_cache(num_pages, page_size, Hkv, D, dtype, gen):
    """Random (never zero) cache contents, so skipped writes are detectable."""
    return randn(num_pages, page_size, Hkv, D, dtype=dtype, gen=gen), \
        randn(num_pages, page_size, Hkv, D, dtype=dtype, gen=gen)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("D", [16, 24])  # 24: half = 12, not a power of two
def test_rope_and_write_kv(dtype, cache_dtype, slot_dtype, D):
    g = torch.Generator().manual_seed(4)
    T, Hq, Hkv, page_size, num_pages = 7, 3, 3, 4, 6
    rot = hf_rotary(Hq, Hkv, D, "llama3")
    inv_freq, scaling = rot.inv_freq.to(DEVICE), rot.attention_scaling
    positions = torch.tensor([3, 4, 5, 6, 0, 1, 9], dtype=torch.int32, device=DEVICE)
    # slot < 0: padding token, must not be written
    slots = torch.tensor([13, 14, -1, 15, 4, -1, 22], dtype=slot_dtype, device=DEVICE)
    _, q, k, v = fused_qkv(T, Hq, Hkv, D, dtype, g)
    kc, vc = make_cache(num_pages, page_size, Hkv, D, cache_dtype, g)
    rq, rk, rkc, rvc = q.clone(), k.clone(), kc.clone(), vc.clone()

    rope_kv_triton(q, k, v, positions, inv_freq, scaling, PagedKV(kc, vc), slots, apply_rope=True)
    apply_rope_ref_(rq, rk, positions, inv_freq, scaling)
    write_kv_ref(rk, v, rkc, rvc, slots)

    tol = max(TOL[dtype], TOL[cache_dtype])
    assert rel_err(q, rq) < TOL[dtype] and rel_err(k, rk) < TOL[dtype]
    assert rel_err(kc, rkc) < tol
    assert_cast_equal(vc, rvc)
    written = torch.zeros(num_pages * page_size, dtype=torch.bool)
    written[[13, 14, 15, 4, 22]] = True
    flat_k, flat_ref = kc.flatten(0, 1).cpu(), rkc.flatten(0, 1).cpu()
    assert torch.equal(flat_k[~written], flat_ref[~written])  # untouched slots keep their content
    assert rel_err(flat_k[14], k[1].to(cache_dtype).cpu()) < tol  # slot 14 -> page 3, row 2

    if DEVICE == "cpu":  # public dispatch = the references on CPU
        q2, k2, kc2, vc2 = q.clone(), k.clone(), kc.clone(), vc.clone()
        rope_and_write_kv(q2, k2, v, positions, inv_freq, scaling, PagedKV(kc2, vc2), slots)
        apply_rope_(q2, k2, positions, inv_freq, scaling)
        assert torch.isfinite(q2).all() and torch.isfinite(kc2).all()


@pytest.mark.parametrize("page_size", [4, 16])
def test_write_kv(page_size):
    g = torch.Generator().manual_seed(5)
    T, Hkv, D = 5, 2, 16
    k, v = randn(T, Hkv, D, gen=g), randn(T, Hkv, D, gen=g)
    kc, vc = make_cache(4, page_size, Hkv, D, torch.bfloat16, g)
    rkc, rvc = kc.clone(), vc.clone()
    slots = torch.tensor([page_size + 1, -1, 3 * page_size, page_size - 1, 2 * page_size + 2], device=DEVICE)
    rope_kv_triton(None, k, v, None, None, 1.0, PagedKV(kc, vc), slots, apply_rope=False)
    write_kv_ref(k, v, rkc, rvc, slots)
    assert_cast_equal(kc, rkc)
    assert_cast_equal(vc, rvc)
    if DEVICE == "cpu":
        kc, vc = rkc.clone(), rvc.clone()
        write_kv(k, v, PagedKV(kc, vc), slots)
        assert torch.equal(kc, rkc) and torch.equal(vc, rvc)


# ----------------------------------------------------------------------------- fp8 KV cache

def assert_fp8_within_one_step(got: torch.Tensor, ref: torch.Tensor):
    """fp8 values equal up to one e4m3 step (2^-3 relative, 2^-9 subnormal): the kernel divides
    by the scale with the device's division, which may round a tie differently from torch's."""
    g, r = got.float(), ref.float()
    assert ((g - r).abs() <= r.abs() * 2.0 ** -3 + 2.0 ** -9).all()


def random_fp8_cache(num_pages, page_size, Hkv, D, gen):
    """A random fp8 cache with random scales (never the values a write produces)."""
    cache = torch.randn(num_pages, page_size, Hkv, D, generator=gen).to(FP8_DTYPE).to(DEVICE)
    scale = (0.5 + torch.rand(num_pages, page_size, Hkv, generator=gen)).to(DEVICE)
    return cache, scale


FP8_WRITE_CASES = [
    # Hq, Hkv, D, page_size
    (6, 2, 32, 4),
    (6, 2, 40, 16),  # half = 20: masked lanes inside each half
    (3, 3, 32, 16),  # 3 kv heads padded to 4 (masked head rows)
]


@pytest.mark.parametrize("Hq,Hkv,D,page_size", FP8_WRITE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("apply_rope", [True, False])
def test_write_kv_fp8(Hq, Hkv, D, page_size, dtype, apply_rope):
    """An fp8 cache gets kv_quant.quantize_rows of the (rotated) k and of v, and the row scales;
    padding tokens and every other slot keep their bytes and scales."""
    g = torch.Generator().manual_seed(6)
    T, num_pages = 7, 5
    rot = hf_rotary(Hq, Hkv, D, "llama3")
    inv_freq, scaling = rot.inv_freq.to(DEVICE), rot.attention_scaling
    positions = torch.tensor([3, 4, 5, 6, 0, 1, 9], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([page_size + 1, -1, 3 * page_size, page_size - 1, 2 * page_size + 2, -1,
                          4 * page_size + 3], device=DEVICE)
    _, q, k, v = fused_qkv(T, Hq, Hkv, D, dtype, g)
    with torch.no_grad():  # rows of very different sizes, one all-zero row (the 1e-30 floor)
        k.mul_(torch.logspace(-2, 2, T, device=DEVICE)[:, None, None].to(dtype))
        v.mul_(torch.logspace(2, -2, T, device=DEVICE)[:, None, None].to(dtype))
        k[3, 0] = 0.0
    q0, k0 = q.clone(), k.clone()
    kc, ks = random_fp8_cache(num_pages, page_size, Hkv, D, g)
    vc, vs = random_fp8_cache(num_pages, page_size, Hkv, D, g)
    kc0, ks0, vc0, vs0 = kc.clone(), ks.clone(), vc.clone(), vs.clone()

    rope_kv_triton(q if apply_rope else None, k, v, positions if apply_rope else None,
                   inv_freq if apply_rope else None, scaling, PagedKV(kc, vc, ks, vs), slots, apply_rope=apply_rope)

    # the stored key row is the kernel's own rotated k (k was rotated in place), quantized
    keep = slots >= 0
    page, row = slots[keep] // page_size, slots[keep] % page_size
    qk, sk = quantize_rows(k[keep])
    qv, sv = quantize_rows(v[keep])
    assert torch.allclose(ks[page, row], sk, rtol=1e-6, atol=0) and torch.allclose(vs[page, row], sv, rtol=1e-6, atol=0)
    assert_fp8_within_one_step(kc[page, row], qk)
    assert_fp8_within_one_step(vc[page, row], qv)
    zero = slots[3].item()  # token 3's kv head 0 was all zeros: zeros back, the floor scale
    assert torch.equal(kc[zero // page_size, zero % page_size, 0].float(), torch.zeros(D, device=DEVICE))
    assert ks[zero // page_size, zero % page_size, 0].item() == pytest.approx(1e-30 / 448.0)
    back = dequantize_rows(kc[page, row], ks[page, row], torch.float32)
    assert torch.allclose(back, k[keep].float(), rtol=2 ** -3, atol=float(sk.max()) * 2 ** -9)
    # untouched slots keep their bytes and scales
    written = torch.zeros(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    written[slots[keep]] = True
    for cache, cache0 in ((kc, kc0), (vc, vc0)):
        flat, flat0 = cache.flatten(0, 1).view(torch.uint8), cache0.flatten(0, 1).view(torch.uint8)
        assert torch.equal(flat[~written], flat0[~written])
    for sc, sc0 in ((ks, ks0), (vs, vs0)):
        assert torch.equal(sc.flatten(0, 1)[~written], sc0.flatten(0, 1)[~written])

    # the torch reference writes exactly quantize_rows, and agrees with the kernel to one step
    rkc, rks, rvc, rvs = kc0.clone(), ks0.clone(), vc0.clone(), vs0.clone()
    write_kv_ref(k, v, rkc, rvc, slots, k_scale=rks, v_scale=rvs)
    assert torch.equal(rkc[page, row].view(torch.uint8), qk.view(torch.uint8)) and torch.equal(rks[page, row], sk)
    assert torch.equal(rvc[page, row].view(torch.uint8), qv.view(torch.uint8)) and torch.equal(rvs[page, row], sv)
    assert_fp8_within_one_step(kc, rkc)
    assert_fp8_within_one_step(vc, rvc)
    assert torch.equal(ks, rks) and torch.equal(vs, rvs)

    if DEVICE == "cpu":  # the public dispatch (the references on CPU) takes the scales too
        pkc, pks, pvc, pvs = kc0.clone(), ks0.clone(), vc0.clone(), vs0.clone()
        if apply_rope:
            q2, k2 = q0.clone(), k0.clone()
            rope_and_write_kv(q2, k2, v, positions, inv_freq, scaling, PagedKV(pkc, pvc, pks, pvs), slots)
        else:
            k2 = k0
            write_kv(k2, v, PagedKV(pkc, pvc, pks, pvs), slots)
        qk2, sk2 = quantize_rows(k2[keep])
        assert torch.equal(pkc[page, row].view(torch.uint8), qk2.view(torch.uint8)) and torch.equal(pks[page, row], sk2)
        assert torch.equal(pvc[page, row].view(torch.uint8), qv.view(torch.uint8))


def test_write_kv_fp8_validates_scales():
    g = torch.Generator().manual_seed(7)
    k, v = randn(2, 2, 16, gen=g), randn(2, 2, 16, gen=g)
    kc, ks = random_fp8_cache(3, 4, 2, 16, g)
    vc, vs = random_fp8_cache(3, 4, 2, 16, g)
    slots = torch.tensor([1, 5], device=DEVICE)
    with pytest.raises(AssertionError, match="needs its k_scale"):
        rope_kv_triton(None, k, v, None, None, 1.0, PagedKV(kc, vc), slots, apply_rope=False)
    with pytest.raises(AssertionError, match="scales are for fp8"):
        plain = torch.zeros(3, 4, 2, 16, device=DEVICE)
        write_kv_ref(k, v, plain, plain.clone(), slots, k_scale=ks, v_scale=vs)
