"""The InfiniteHiP kernels compile for an H100/H200 (sm_90) without a GPU.

The interpreter runs what the compiler rejects (non-constexpr globals, loop-carried type
changes), so every variant the launchers can pick is compiled to a cubin through triton.compile
with a GPU target. The tests run this file as a script in a subprocess with TRITON_INTERPRET=0
(the test process itself imported the kernels interpreted); skipped where the NVIDIA backend
cannot compile. The test compiles the CI set (:func:`variants`) in two processes, about a minute
on 2 cores; ``all`` every combination.

FP8 KV caches (plugins/kv_quant.py): every kernel that reads the paged cache compiles with an
fp8e4nv cache, float32 row scales and bf16 queries too (KV_SCALED).

    python tests/test_infinitehip_compile.py pruning 1     # one variant by hand
    python tests/test_infinitehip_compile.py pruning 1 fp8
    python tests/test_infinitehip_compile.py attention 3 4 bank fp8

KV offloading (plugins/kv_offload.py): the key readers also compile with host pages (OFFLOAD, int64
host deltas), plain and fp8.

    python tests/test_infinitehip_compile.py pruning 1 fp8 offload
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PRUNING = [0, 1, 2]  # rope styles: none, relative, chunk_indexed
ATTENTION = [(0, 1, False), (0, 4, False), (3, 1, False), (3, 4, False), (3, 4, True)]  # (rope style
# none | streaming, num_splits, rotated key bank)
FP8 = "*fp8e4nv"  # torch.float8_e4m3fn
# host pool offsets in elements (kv_offload.offload_deltas): int64, pinned memory is far from the GPU's
_HOST_DELTAS = dict(k_host_delta="i64", ks_host_delta="i64")


def _compile(fn, pointers, constexprs, num_warps=4):
    import triton
    from triton.backends.compiler import GPUTarget

    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))


def _cache_ptrs(fp8: bool, *names: str) -> dict:
    """The cache pointers (and their scale pointers: float32, or the cache itself as the
    launchers pass when unscaled) of a bf16 or fp8 cache."""
    ptrs = {}
    for name in names:
        ptrs[f"{name}_cache_ptr"] = FP8 if fp8 else "*bf16"
        ptrs[f"{name}_scale_ptr"] = "*fp32" if fp8 else "*bf16"
    return ptrs


def _compile_pruning(rope_style: int, fp8: bool = False, offload: bool = False):
    import infhip.plugins.infinitehip.pruning as pruning

    ptrs = {n: "*i32" for n in ("block_tables_ptr", "q_start_ptr", "q_lens_ptr", "ends_ptr", "cand_ptr",
                                "cand_lens_ptr", "reps_ptr")}
    ptrs.update(q_ptr="*bf16", raw_ptr="*bf16", raw_base_ptr="*i64", inv_freq_ptr="*fp32", scores_ptr="*fp32",
                **_cache_ptrs(fp8, "k"), **_HOST_DELTAS)
    # raw keys only with a dynamic style (and never with OFFLOAD: they are read without page tables)
    for raw in ((False, True) if rope_style and not offload else (False,)):
        # the transposed score tiles (keys_as_rows) with the prefill path's raw RELATIVE keys
        for rows in ((False, True) if raw and rope_style == 1 else (False,)):
            ce = dict(PAGE_SIZE=16, BLOCK_Q=256, BLOCK_C=16, TILES=4, BLOCK_D=128, CAND_IMPLICIT=rope_style == 0,
                      STORE_REPS=True, ROPE_STYLE=rope_style, RAW_KEYS=raw, DOT_F32=False, DOT_PRECISION="tf32",
                      KEY_ROTATION=0 if rope_style == 0 or (raw and rope_style == 1) else 2 if raw else 1,
                      KEYS_AS_ROWS=rows, KV_SCALED=fp8 and not raw,  # raw keys come dequantized (bf16)
                      OFFLOAD=offload)
            _compile(pruning._select_rep_kernel, ptrs, ce, num_warps=8)
    if fp8 or offload:  # top-k reads no keys
        return None
    ptrs = {n: "*i32" for n in ("cand_ptr", "cand_lens_ptr", "ends_ptr", "kept_ptr", "out_ptr", "out_lens_ptr")}
    ptrs.update(scores_ptr="*fp32")
    return _compile(pruning._topk_expand_kernel, ptrs, dict(CAND_IMPLICIT=rope_style == 0,
                    LENS_FROM_ENDS=rope_style == 0, BLOCK_ALL=4096, BLOCK=1024), num_warps=8)


def _compile_raw_keys(fp8: bool, offload: bool = False):
    import infhip.plugins.infinitehip.raw_keys as raw_keys

    ptrs = dict(table_ptr="*i32", inv_freq_ptr="*fp32", out_ptr="*bf16", **_cache_ptrs(fp8, "k"), **_HOST_DELTAS)
    _compile(raw_keys._unrotate_kernel, ptrs, dict(PAGE_SIZE=16, BLOCK_T=64, BLOCK_D=128, KV_SCALED=fp8,
                                                   OFFLOAD=offload))


def _compile_attention(rope_style: int, num_splits: int, bank: bool = False, fp8: bool = False,
                       offload: bool = False):
    import infhip.plugins.infinitehip.key_bank as key_bank
    import infhip.plugins.infinitehip.sparse_attention as sparse_attention

    ptrs = {n: "*i32" for n in ("block_tables_ptr", "q_start_ptr", "q_lens_ptr", "ends_ptr", "sel_ptr")}
    ptrs["bank_rows_ptr"] = "*i64"  # the runtime passes its int64 mask-cache slots
    banks = dict(bank_ptr="*bf16", value_bank_ptr="*bf16")
    ptrs.update(q_ptr="*bf16", out_ptr="*bf16", inv_freq_ptr="*fp32", part_out_ptr="*fp32",
                part_lse_ptr="*fp32", scale_log2="fp32", **banks, **_cache_ptrs(fp8, "k", "v"), **_HOST_DELTAS,
                v_host_delta="i64", vs_host_delta="i64")
    # the runtime keeps a value bank beside the key bank when it offloads (runtime/attention/infinitehip/)
    ce = dict(PAGE_SIZE=16, BLOCK_Q=64, BLOCK_N=64, BLOCK_D=128, NUM_SPLITS=num_splits, SEL_BLOCK=1024,
              DECODE=num_splits > 1, ROPE_STYLE=rope_style, ROPE_GROUP=8, BANK=bank, DOT_F32=False,
              PREFETCH=rope_style == 3,  # the prefetching loop with every key path
              DOT_PRECISION="tf32", KV_SCALED=fp8, OFFLOAD=offload, VALUE_BANK=bank and offload)
    _compile(sparse_attention._sparse_attn_kernel, ptrs, ce)
    if bank:  # the bank writer, copying values too when offloading
        ptrs = {n: "*i32" for n in ("block_tables_ptr", "ends_ptr", "sel_ptr")}
        ptrs["bank_rows_ptr"] = "*i64"
        ptrs.update(inv_freq_ptr="*fp32", **banks, **_cache_ptrs(fp8, "k", "v"), **_HOST_DELTAS,
                    v_host_delta="i64", vs_host_delta="i64")
        _compile(key_bank._write_bank_kernel, ptrs, dict(PAGE_SIZE=16, BLOCK_T=64, BLOCK_D=128, SEL_BLOCK=1024,
                                                         ROPE_GROUP=8, KV_SCALED=fp8, OFFLOAD=offload,
                                                         VALUES=offload))


def variants(full: bool) -> list[tuple]:
    """Every compile as (kernel family, args). ``full``: each kernel configuration in all four
    fp8 x offload combinations. Otherwise (CI) twice: plain, and fp8 with offload together — both
    features compile in every configuration, only their pairings with the other's absence are
    left to ``all`` (the KV_SCALED and OFFLOAD branches are independent constexpr blocks)."""
    combos = [(False, False), (False, True), (True, False), (True, True)] if full else [(False, False), (True, True)]
    out: list[tuple] = []
    for fp8, offload in combos:
        out += [("pruning", style, fp8, offload) for style in PRUNING]
        out += [("attention", style, splits, bank, fp8, offload) for style, splits, bank in ATTENTION]
        out.append(("raw_keys", fp8, offload))
    return out


def _compile_variant(family: str, *args) -> None:
    {"pruning": _compile_pruning, "attention": _compile_attention, "raw_keys": _compile_raw_keys}[family](*args)


def _run(*args: str) -> subprocess.Popen:
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.Popen([sys.executable, __file__, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    """The CI set (variants(full=False)) in two processes at once; ``python
    tests/test_infinitehip_compile.py all`` compiles every combination (about 4 minutes)."""
    probe = _run("probe")
    _, err = probe.communicate(timeout=600)
    if probe.returncode != 0:
        pytest.skip(f"the NVIDIA backend cannot compile here: {err.strip()[-300:]}")
    shards = [_run("ci", f"{i}/2") for i in range(2)]
    for shard in shards:
        _, err = shard.communicate(timeout=900)
        assert shard.returncode == 0, err[-3000:]


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "probe":  # can this Triton compile for sm_90 at all?
        import triton
        import triton.language as tl

        @triton.jit
        def _trivial(x_ptr):
            tl.store(x_ptr + tl.arange(0, 16), tl.arange(0, 16))

        _compile(_trivial, {"x_ptr": "*i32"}, {})
    elif what in ("all", "ci"):  # optional shard "i/n": every n-th variant from the i-th
        i, n = (int(x) for x in sys.argv[2].split("/")) if len(sys.argv) > 2 else (0, 1)
        for v in variants(full=what == "all")[i::n]:
            _compile_variant(*v)
    elif what == "pruning":
        _compile_pruning(int(sys.argv[2]), "fp8" in sys.argv[3:], "offload" in sys.argv[3:])
    elif what == "raw_keys":
        _compile_raw_keys("fp8" in sys.argv[2:], "offload" in sys.argv[2:])
    else:
        _compile_attention(int(sys.argv[2]), int(sys.argv[3]), "bank" in sys.argv[4:], "fp8" in sys.argv[4:],
                           "offload" in sys.argv[4:])
