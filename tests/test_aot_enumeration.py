"""The builder's kernel enumeration for realistic engines (no checkpoint, no GPU; a few seconds).

For Llama-3.1-8B (bf16, and with an fp8 KV cache) and Gemma-3-12B as ``infhip-build`` would plan
them for an H200 (sm_90, 128K tokens, 16 sequences, 32K-token steps), ``enumerate_variants``
returns a bounded set that is the same from run to run, and what it holds is what the GPU
launches (compiled dots in the queries' dtype, fp8 caches dequantized, ...). And every Triton
kernel that some plugin launches (``kernel[grid](...)`` in a plugin's source; device helpers are
never launched) is enumerated for at least one plan: a kernel nobody enumerates would compile
while serving. tests/test_aot_coverage.py checks the other direction on tiny engines: what the
runtime really launches is enumerated.
"""

from __future__ import annotations

import collections
import importlib
import inspect
import re

import pytest

from infhip.builder.matrix_configs import engine_config
from infhip.builder.kernels import enumerate_variants, plugin_modules
from infhip.plugins.aot import Target

# The plugins whose aot_launches this suite holds to a count (the dense family).
DENSE_FAMILY = ("rms_norm", "activation", "rope", "skinny_gemm", "fp8_skinny_gemm", "fp8_linear", "dense_attention",
                "kv_quant")
# Modules whose aot_launches are written on another branch (aot-sparse): until it lands, a module
# of these that has no aot_launches yet is an expected failure; once it has one, it is checked.
PENDING = frozenset(m for m in plugin_modules() if m.removeprefix("infhip.plugins.") not in DENSE_FAMILY)


PLANS = {
    "llama8b-bf16": dict(model="llama-3.1-8b"),
    "llama8b-fp8kv": dict(model="llama-3.1-8b", kv_dtype="fp8"),
    "gemma3-12b": dict(model="gemma-3-12b"),
    # for the every-kernel check: the other plugins' plans
    "llama8b-3k": dict(model="llama-3.1-8b", preset="3k"),
    # past the trained window: dynamic RoPE, the key bank and raw keys
    "llama8b-3k-flash-fp8kv": dict(model="llama-3.1-8b", preset="3k-flash", kv_dtype="fp8", max_seq_len=1048576),
    "llama8b-token-drop": dict(model="llama-3.1-8b", transforms=["token_drop"]),
    "gemma3-12b-3k-token-drop": dict(model="gemma-3-12b", preset="3k", transforms=["token_drop"]),
    # fp8 weights (plugins/fp8_skinny_gemm.py, plugins/fp8_linear.py)
    "llama8b-fp8w": dict(model="llama-3.1-8b", weight_dtype="fp8", kv_dtype="fp8"),
    "gemma3-12b-fp8w-lm-head": dict(model="gemma-3-12b", weight_dtype="fp8", quantize_lm_head=True),
    # the linear/full hybrid: the delta rule, the causal conv and the fused MoE (plugins/gated_delta*.py,
    # plugins/causal_conv.py, plugins/moe.py), with token drop carried through its linear layers
    "qwen3-next-token-drop": dict(model="qwen3-next-80b-a3b", transforms=["token_drop"]),
}


def _module_of(variant) -> str:
    return variant.kernel.split(":")[0].removeprefix("infhip.plugins.")


@pytest.fixture(scope="module")
def enumerated():
    """plan name -> set of variants."""
    target = Target()
    return {name: set(enumerate_variants(engine_config(**kw), target)) for name, kw in PLANS.items()}


def _dense(variants) -> list:
    return [v for v in variants if _module_of(v) in DENSE_FAMILY]


@pytest.mark.parametrize("name", ["llama8b-bf16", "llama8b-fp8kv", "gemma3-12b"])
def test_dense_family_bounded_and_deterministic(enumerated, name):
    variants = enumerated[name]
    again = set(enumerate_variants(engine_config(**PLANS[name]), Target()))
    assert sorted(v.key for v in again) == sorted(v.key for v in variants), "enumeration is not deterministic"
    dense = _dense(variants)
    counts = collections.Counter(v.name for v in dense)
    print(f"\n{name}: {len(variants)} variants in all, {len(dense)} dense-family: {dict(sorted(counts.items()))}")
    assert 0 < len(dense) <= 48, f"{len(dense)} dense-family variants: the enumeration is not bounded"
    # every dense-family kernel of a bf16 engine is there; the norm has its residual and plain forms
    assert set(counts) == {"_rms_norm_kernel", "_gated_act_kernel", "_rope_kv_kernel", "_skinny_gemm_kernel",
                           "_decode_split_kernel", "_decode_merge_kernel"}
    consts = [dict(v.constants) for v in dense]
    # compiled for the GPU: dots in the queries' dtype, never the interpreter's float32 upcast
    assert all(c.get("DOT_F32", "False") == "False" for c in consts)
    assert all(c.get("DOT_PRECISION", "'tf32'") == "'tf32'" for c in consts)
    assert all(c.get("QUANT", "False") == "False" for c in consts)  # fused fp8 outputs: fp8 weights only
    scaled = "True" if PLANS[name].get("kv_dtype") == "fp8" else "False"
    assert {c["KV_SCALED"] for v, c in zip(dense, consts) if "KV_SCALED" in c} == {scaled}
    kinds = {c["KIND"] for v, c in zip(dense, consts) if v.name == "_gated_act_kernel"}
    assert kinds == ({"1"} if name.startswith("gemma") else {"0"})
    # one split variant per split count, and a merge for each count > 1
    splits = {c["NUM_SPLITS"] for v, c in zip(dense, consts) if v.name == "_decode_split_kernel"}
    merges = {c["NUM_SPLITS"] for v, c in zip(dense, consts) if v.name == "_decode_merge_kernel"}
    assert merges == splits - {"1"}
    # the block-table width and length pointer are not specialized (they vary with the step)
    for v in dense:
        if v.name == "_decode_split_kernel":
            assert "max_pages" not in dict(v.constants) and "max_pages" not in dict(v.attrs)
            assert "tt.divisibility" not in dict(v.attrs).get("context_lens_ptr", "")


@pytest.mark.parametrize("name", ["llama8b-fp8w", "gemma3-12b-fp8w-lm-head"])
def test_fp8_weight_kernels_bounded_and_replace_bf16_ones(enumerated, name):
    """An fp8-weight engine enumerates the fp8 skinny kernel (decode rows) and the activation
    quantization of torch._scaled_mm (prefill rows) per fp8 layer width, and no bf16 skinny GEMM
    for the layers it stores in fp8 (the LM head keeps one unless quantized)."""
    variants = enumerated[name]
    again = set(enumerate_variants(engine_config(**PLANS[name]), Target()))
    assert sorted(v.key for v in again) == sorted(v.key for v in variants), "enumeration is not deterministic"
    counts = collections.Counter(v.name for v in variants if _module_of(v) in ("fp8_skinny_gemm", "fp8_linear",
                                                                            "skinny_gemm"))
    print(f"\n{name}: {dict(sorted(counts.items()))}")
    assert counts["_fp8_skinny_kernel"] >= 1 and counts["_quantize_act_kernel"] >= 1
    assert sum(counts.values()) <= 24, f"{counts}: the fp8 enumeration is not bounded"
    lm_head = PLANS[name].get("quantize_lm_head", False)
    assert (counts["_skinny_gemm_kernel"] == 0) == lm_head
    # the fused fp8 outputs of the norms (plain and residual forms) and of the activation
    # (plugins/fp8_linear.py Fp8Act): one-pass variants (a row in registers at these widths)
    fused = [dict(v.constants) | {"name": v.name} for v in variants if dict(v.constants).get("QUANT") == "True"]
    assert sorted((c["name"], c["HAS_RESIDUAL"]) for c in fused if c["name"] == "_rms_norm_kernel") == [
        ("_rms_norm_kernel", "False"), ("_rms_norm_kernel", "True")]
    act = [c for c in fused if c["name"] == "_gated_act_kernel"]
    assert len(act) == 1 and act[0]["ONE_TILE"] == "True" and act[0]["KIND"] == ("1" if "gemma" in name else "0")
    for v in variants:
        if dict(v.constants).get("QUANT") == "True":
            assert dict(v.signature)["q_ptr"] == "*fp8e4nv" and dict(v.signature)["q_scale_ptr"] == "*fp32"
    for v in variants:
        c = dict(v.constants)
        if v.name == "_fp8_skinny_kernel":  # compiled for the GPU: bf16 dots, no interpreter upcast
            assert c["DOT_F32"] == "False" and c["DOT_PRECISION"] == "'tf32'"
            assert "M" not in c and "M" not in dict(v.attrs)  # one binary for every row count
        if v.name == "_skinny_gemm_kernel":  # only the LM head's shape (N = vocab) is left in bf16
            assert dict(v.signature)["w_ptr"] == "*bf16"


def test_fp8_weight_kernels_need_an_fp8_target():
    """Below sm_89 an fp8 engine runs the dequantizing reference: nothing fp8 is compiled (Triton
    has no fp8e4nv there), and no bf16 skinny GEMM for the fp8 layers either."""
    config = engine_config("llama-3.1-8b", weight_dtype="fp8", target="sm_80")
    variants = enumerate_variants(config, Target("sm_80", 108))
    names = {v.name for v in variants}
    assert not names & {"_fp8_skinny_kernel", "_quantize_act_kernel"}
    assert "_rms_norm_kernel" in names
    # nor the fused fp8 outputs of the norm and the activation
    assert all(dict(v.constants).get("QUANT", "False") == "False" for v in variants)


def _launched_kernels() -> dict[str, list[str]]:
    """module -> names of its @triton.jit functions that some plugin module launches
    (``name[grid](...)`` in its source, possibly another module's, as sparse attention launches
    dense attention's merge kernel)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    modules = {m: importlib.import_module(m) for m in plugin_modules()}
    sources = "\n".join(inspect.getsource(mod) for mod in modules.values())
    out = {}
    for m, mod in modules.items():
        kernels = [name for name, obj in vars(mod).items()
                   if isinstance(obj, (JITFunction, InterpretedFunction))
                   and getattr(obj.fn, "__module__", None) == mod.__name__]
        out[m] = sorted(k for k in kernels if re.search(rf"\b{re.escape(k)}\[", sources))
    return out


@pytest.mark.parametrize("module", plugin_modules())
def test_every_launched_kernel_is_enumerated(enumerated, module):
    launched = _launched_kernels()[module]
    mod = importlib.import_module(module)
    if launched and module in PENDING and not hasattr(mod, "aot_launches"):
        pytest.xfail(f"plugins/{module}: aot_launches is written on the aot-sparse branch")
    if launched:
        assert hasattr(mod, "aot_launches"), f"plugins/{module} launches {launched} but has no aot_launches"
    names = {v.name for variants in enumerated.values() for v in variants
             if _module_of(v) == module.removeprefix("infhip.plugins.")}
    missing = sorted(set(launched) - names)
    assert not missing, f"plugins/{module}: {missing} launched but enumerated for none of {sorted(PLANS)}"
