"""Load-time options never compile while serving (runtime/kernel_store.py, compile_at_load).

Tiny ``--target sm_90`` engines are built on the CPU with the compile step replaced by index
entries (the builder's enumeration is what is under test, not ptxas). For every runtime knob of
every registered plan method, a load that changes it is enumerated as the load does
(load_time_variants) and compared with the engine's index: the knobs that specialize kernels
(SPECIALIZING) must show the variants the engine lacks, and the rest none. A knob that the
load-time enumeration dropped (a plugin's aot_launches reading the built value, or the load
enumerating the built plan) would show none and fail here. Then compile_at_load: refused
under jit="forbid" naming the kernels, compiled with one notice under "warn", after which the
serve-time hook lets those variants through even under "forbid"."""

from __future__ import annotations

import dataclasses
import json
import logging
import types

import pytest

import infhip.builder.kernels as builder_kernels
from infhip.config import EngineConfig
from infhip.methods import methods
from infhip.runtime import kernel_store as KS
from infhip.runtime.kernel_store import JitForbidden, KernelStore, compile_at_load, load_time_variants

TINY_3K = dict(n_sink=4, n_stream=8, stages=[(8, 16, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0],
               special_final_k=16, dense_threshold=30)
TINY_DROP = dict(p=0.9, min_prompt_len=32, obs_window=8, block_size=8, num_sink=8)
SM90 = dict(target="sm_90", dtype="bfloat16", max_seq_len=256, max_batch_size=4, hf=dict(num_hidden_layers=2))

# (method, knob) -> a valid value other than the engine's: every load key of every method
CHANGES = {
    ("infinitehip", "refresh_intervals"): (8, 4, 2), ("infinitehip", "query_strides"): (2, 2, 1),
    ("infinitehip", "dense_threshold"): 64, ("infinitehip", "rope_off_in_trained_window"): False,
    ("infinitehip", "stagger_refresh"): False, ("infinitehip", "chunk_score"): "max",
    ("infinitehip", "key_bank"): False, ("infinitehip", "key_bank_slots"): 4,
    ("token_drop", "p"): 0.5, ("token_drop", "obs_window"): 16, ("token_drop", "block_size"): 16,
    ("token_drop", "num_sink"): 16, ("token_drop", "min_prompt_len"): 64, ("token_drop", "drop_layers"): [1],
    ("token_drop", "drop_point"): "before_attention", ("token_drop", "reenter"): True,
    ("token_drop", "spare_anchors"): 1,
}
# The knobs whose change needs kernel variants the engine lacks, with those kernels (measured
# 2026-12-07: dynamic RoPE inside the window, the scoring window's and blocks' sizes).
SPECIALIZING = {
    ("infinitehip", "rope_off_in_trained_window"): {"_select_rep_kernel", "_sparse_attn_kernel", "_unrotate_kernel",
                                                    "_write_bank_kernel"},
    ("token_drop", "obs_window"): {"_block_scores_kernel", "_expand_kernel", "_row_stats_kernel"},
    ("token_drop", "block_size"): {"_block_scores_kernel", "_expand_kernel"},
}


def _index_only(variants, target, kernels_dir, jobs=None, progress=False):
    """compile_variants' index entries without compiling (the enumeration is what is tested)."""
    kernels_dir.mkdir(parents=True, exist_ok=True)
    return [{"kernel": v.kernel, "variant": v.key, "hash": f"h{i}", "target": target.name, "triton": "-",
             "files": {f"h{i}/k.json": {"sha256": "", "size": 0}}} for i, v in enumerate(variants)]


@pytest.fixture(scope="module")
def engines(tiny_engine):
    """(dense engine, 3k engine with token drop), both --target sm_90, built on the CPU."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder_kernels, "compile_variants", _index_only)
        return (tiny_engine("llama", **SM90),
                tiny_engine("llama", **SM90, preset="3k", infinitehip_overrides=TINY_3K, token_drop=TINY_DROP))


def _store(engine, mode: str = "warn") -> KernelStore:
    index = json.loads((engine / "kernels" / "index.json").read_text())
    assert index["target"] == "sm_90" and index["kernels"]
    return KernelStore(root=engine / "kernels", target="sm_90", triton_version=index["triton"], mode=mode,
                       num_sms=index["num_sms"], variants={e["variant"] for e in index["kernels"]})


def _at_load(engine, overrides):
    config = EngineConfig.load(engine)
    return config, dataclasses.replace(config, plan=config.plan.at_load(overrides))


def test_the_table_covers_every_runtime_knob_of_every_method():
    assert set(CHANGES) == {(m.name, k) for m in methods() for k in m.load_keys()}, \
        "a method's runtime knob is missing from CHANGES: give it a changed value (and SPECIALIZING if it specializes)"


def test_as_built_the_load_enumerates_the_index(engines):
    for engine in engines:
        config = EngineConfig.load(engine)
        assert load_time_variants(_store(engine), config) == {}
        assert compile_at_load(_store(engine, "forbid"), config, config.plan) == []  # same plan: nothing to do


@pytest.mark.parametrize("method, knob", sorted(CHANGES))
def test_every_runtime_knob_is_enumerated_at_load(engines, method, knob):
    _, engine = engines
    _, config = _at_load(engine, {method: {knob: CHANGES[method, knob]}})
    assert config.plan.knobs_of(method) != EngineConfig.load(engine).plan.knobs_of(method)
    missing = {v.name for v in load_time_variants(_store(engine), config)}
    assert missing == SPECIALIZING.get((method, knob), set()), (method, knob, sorted(missing))


def test_a_transform_turned_on_at_load(engines, caplog, monkeypatch):
    dense, _ = engines
    built, config = _at_load(dense, {"token_drop": True})  # what infhip-eval --token-drop loads
    missing = load_time_variants(_store(dense), config)
    assert {v.name for v in missing} >= {"_select_kernel", "_expand_kernel"}
    with pytest.raises(JitForbidden, match=r"this load's options need \d+ kernel variant\(s\) .*_select_kernel"):
        compile_at_load(_store(dense, "forbid"), config, built.plan)
    compiled = []
    monkeypatch.setattr(KS, "_compile_into_triton_cache", lambda variants, store: compiled.extend(variants))
    store = _store(dense, "warn")
    caplog.set_level(logging.WARNING, logger="infhip.kernels")
    done = compile_at_load(store, config, built.plan)
    assert set(done) == set(compiled) == set(missing)
    [line] = [r.getMessage() for r in caplog.records if r.name == "infhip.kernels"]
    assert line.startswith(f"compiling {len(missing)} kernel variant(s) at load") and "_select_kernel" in line
    assert compile_at_load(store, config, built.plan) == []  # now the engine's: a second load compiles nothing
    # while serving, Triton's pre-compile hook finds them the engine's, even under "forbid"
    store.mode = "forbid"
    for variant, (jit, signature, constexprs, attrs, options) in list(missing.items())[:3]:
        fn = types.SimpleNamespace(jit_function=jit)
        args = dict(signature=signature, constants=constexprs, configs=[attrs], num_warps=options.num_warps,
                    num_stages=options.num_stages, num_ctas=options.num_ctas)
        with KS.serving(store):
            KS._check_variant(fn, args)


def test_load_rank_compiles_the_loads_plan(engines, monkeypatch):
    """The wiring: load_rank (EngineCore's and every TP worker's load) hands the load's plan, not
    the built one, to compile_at_load, before any step."""
    import infhip.runtime.load as load
    from infhip.runtime.options import LoadOptions

    dense, _ = engines
    monkeypatch.setattr(load, "load_engine", lambda *a, **k: types.SimpleNamespace(
        config=EngineConfig.load(dense), kernels=_store(dense, "forbid")))
    assert load.load_rank(dense, LoadOptions.of(jit="forbid")).config.plan.knobs_of("token_drop") is None
    with pytest.raises(JitForbidden, match="_select_kernel"):
        load.load_rank(dense, LoadOptions.of(jit="forbid", token_drop=True))


@pytest.mark.gpu
def test_gpu_token_drop_on_a_dense_engine_compiles_at_load_not_while_serving(tmp_path, caplog):
    """The issue's case on a GPU: a dense engine loaded with token drop (infhip-eval --token-drop)
    compiled its token-drop kernels on the first request; now at load, and none while serving."""
    from infhip import LLM, SamplingParams
    from infhip.builder.build import build_engine
    from tests._tiny import write_tiny_hf_checkpoint

    write_tiny_hf_checkpoint(tmp_path / "hf", "llama")
    engine = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "e", dtype="bfloat16", device="cuda",
                          max_seq_len=256, max_batch_size=4, progress=False)
    with pytest.raises(JitForbidden, match="this load's options need"):
        LLM(engine, token_drop=TINY_DROP, jit="forbid")
    caplog.set_level(logging.WARNING, logger="infhip.kernels")
    llm = LLM(engine, token_drop=TINY_DROP, jit="warn")
    assert any("at load" in r.getMessage() for r in caplog.records)
    caplog.clear()
    prompt = [(7 * j) % 250 + 3 for j in range(120)]  # past min_prompt_len: it drops
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].token_ids) == 4
    assert not [r.getMessage() for r in caplog.records if "while serving" in r.getMessage()]
