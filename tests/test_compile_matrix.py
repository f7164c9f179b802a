"""builder/compile_matrix.py (with builder/matrix_*.py), CI's GPU compile check: the covering subset it compiles holds every
constexpr value and every pair of code-path settings of the variants it stands for; the presets
it leaves out launch exactly the variants of the one that stands for them; a kernel that does not
compile for a target is reported by name, variant and Triton version (through TTGIR and to cubin).
The matrix itself runs in tests/run.sh, once per Triton."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from infhip.builder import matrix_compile as mc
from infhip.builder import matrix_configs as mcfg
from infhip.builder import matrix_launches as ml
from infhip.builder.kernels import enumerate_variants
from infhip.plugins.aot import record


@triton.jit
def _good_kernel(x_ptr, N, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(x_ptr + cols, tl.load(x_ptr + cols, mask=cols < N) * 2, mask=cols < N)


@triton.jit
def _bad_kernel(x_ptr, N, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)  # BLOCK = 3 is no power of two: the frontend refuses it
    tl.store(x_ptr + cols, tl.load(x_ptr + cols, mask=cols < N), mask=cols < N)


def _variants(kernel, blocks):
    x = torch.empty(64, dtype=torch.bfloat16, device="meta")
    with record(mcfg.TARGETS["sm_90"], launch=False) as rec:
        for block in blocks:
            kernel[(1,)](x, 64, BLOCK=block)
    return sorted(rec.variants, key=lambda v: v.key)


@pytest.mark.parametrize("stage", ["ttgir", "cubin"])
def test_a_kernel_that_does_not_compile_is_named(stage):
    pytest.importorskip("triton.backends.nvidia.compiler")
    good, bad = _variants(_good_kernel, [16])[0], _variants(_bad_kernel, [3])[0]
    errors = mc.compile_all([good, bad], mcfg.TARGETS["sm_90"], jobs=1, stage=stage)
    assert set(errors) == {bad.key}, errors
    assert "power of 2" in errors[bad.key] or "power of two" in errors[bad.key], errors[bad.key]
    assert "_bad_kernel" in bad.describe() and "BLOCK=3" in bad.describe()


def test_the_refresh_presets_launch_what_3k_launches():
    """3k-fast and 3k-flash change refresh intervals only, so the matrix enumerates 3k for them
    (InfiniteHiP's ``matrix_presets``; the matrix's presets come from the registered methods)."""
    from infhip.methods import method

    ih = method("infinitehip")
    assert set(ih.presets) - set(ih.matrix_presets) == {"3k-fast", "3k-flash"}
    assert mcfg.presets() == ("dense", "3k", "5k")
    target = mcfg.TARGETS["sm_90"]
    got = {p: {v.key for v in enumerate_variants(mcfg.engine_config("smollm2-135m", preset=p, kv_dtype="fp8",
                                                                  max_seq_len=1 << 20), target)}
           for p in ("3k", "3k-fast", "3k-flash")}
    assert got["3k"] and got["3k-fast"] == got["3k"] == got["3k-flash"]


def test_representatives_cover_every_value_and_every_pair_of_settings():
    target = mcfg.TARGETS["sm_89"]
    configs = {k: kw for k, kw in mcfg.configurations(target, ("smollm2-135m",)).items()
               if "tp=" not in k and "w=fp8-lm-head" not in k}
    seen = ml.union_variants(target, configs, jobs=1)
    chosen = mc.representatives(seen)
    assert len(chosen) < len(seen) / 2, (len(chosen), len(seen))  # it is a reduction
    for kernel in {v.kernel for v in seen}:
        group = [v for v in seen if v.kernel == kernel]
        picked = [v for v in chosen if v.kernel == kernel]
        assert {c for v in group for c in v.constants} == {c for v in picked for c in v.constants}, kernel
        values = {}
        for v in group:
            for n, x in v.constants:
                values.setdefault(n, set()).add(x)
        sizes = {n for n, vals in values.items() if mc._is_size(n, vals)}

        def pairs(v):
            path = sorted([c for c in v.constants if c[0] not in sizes]
                          + [s for s in v.signature if s[1].startswith("*")] + [("options", repr(v.options))])
            return set(itertools.combinations(path, 2))

        assert set().union(*map(pairs, group)) == set().union(*map(pairs, picked)), kernel


def test_no_fp8_cache_configurations_on_sm80():
    assert not [k for k in mcfg.configurations(mcfg.TARGETS["sm_80"], ("llama-3.1-8b",)) if "kv=fp8" in k]
    assert [k for k in mcfg.configurations(mcfg.TARGETS["sm_89"], ("llama-3.1-8b",)) if "kv=fp8" in k]


def test_memoized_and_replayed_enumerations_equal_the_plain_one(tmp_path, capsys):
    """The matrix binds a launch once per process (the memo) and, in a later run with the same
    sources, binds the launches the first run recorded instead of running the plugins again (the
    replay): both give exactly the plain enumeration's variants and first configurations. A
    record whose launches a fresh enumeration contradicts is not used."""
    import json

    target = mcfg.TARGETS["sm_89"]
    configs = {k: kw for k, kw in mcfg.configurations(target, ("smollm2-135m",)).items()
               if k.endswith(("dense kv=bfloat16 w=fp8", "3k kv=fp8 1M"))}
    assert len(configs) == 2, configs
    with mc.worker_pool(1) as pool:
        plain = ml.union_variants(target, configs, 1, pool, memo=False)
        memo = ml.union_variants(target, configs, 1, pool, launch_cache=tmp_path)  # records
        [path] = tmp_path.iterdir()
        replays = []
        original = ml._replayed
        ml._replayed = lambda *a: replays.append(original(*a)) or replays[-1]
        try:
            replayed = ml.union_variants(target, configs, 1, pool, launch_cache=tmp_path)
            record = json.loads(path.read_text())
            for name, keys in record["launches"].items():  # a record that lies: no RMSNorm launches
                record["launches"][name] = [k for k in keys if "rms_norm" not in k[0]]
            path.write_text(json.dumps(record))
            redone = ml.union_variants(target, configs, 1, pool, launch_cache=tmp_path)
        finally:
            ml._replayed = original
    assert plain and any("rms_norm" in v.kernel for v in plain)
    assert memo == plain
    assert replayed == plain
    assert redone == plain
    assert replays[0] == plain and replays[1] is None, "the replay did not run, or trusted the lying record"
    assert "enumerating every configuration again" in capsys.readouterr().out
