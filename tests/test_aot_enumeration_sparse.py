"""The InfiniteHiP, KV-offload and token-drop kernels' ahead-of-time enumeration on real engine
shapes: Llama-3.1-8B (no weights: its bundled config) with each InfiniteHiP preset, bf16 and fp8
KV caches, token drop, inside the trained window (128K) and past it (1M: dynamic RoPE, the key
bank, raw keys). Each plan's set is bounded (the builder compiles every variant: ~300 at a few
seconds each fit its 2-minute budget on 16 cores, with the dense kernels) and deterministic, and
every kernel of these modules appears in some plan. tests/test_aot_coverage.py checks on tiny
engines that the runtime launches nothing else.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest

from infhip.builder.hf_config import model_config_from_hf
from infhip.builder.kernels import enumerate_variants, plugin_modules
from infhip.builder.presets import make_plan
from infhip.builder.registry import bundled_config
from infhip.config import BuildConfig, EngineConfig
from infhip.methods.token_drop import parse_token_drop
from infhip.plugins.aot import LaunchSpace, Target, record

SPARSE_MODULES = ("kv_offload", "infinitehip.pruning", "infinitehip.sparse_attention", "infinitehip.key_bank",
                  "infinitehip.raw_keys", "token_drop.importance", "token_drop.top_p", "token_drop.attention",
                  "token_drop.gather")
# Every Triton kernel of those modules, and the split merge that sparse decode borrows from
# dense_attention (launched by sparse_decode_attention with its own split counts).
KERNELS = {
    "infhip.plugins.kv_offload:_copy_pages_kernel",
    "infhip.plugins.infinitehip.pruning:_select_rep_kernel", "infhip.plugins.infinitehip.pruning:_topk_expand_kernel",
    "infhip.plugins.infinitehip.sparse_attention:_sparse_attn_kernel",
    "infhip.plugins.dense_attention:_decode_merge_kernel",
    "infhip.plugins.infinitehip.key_bank:_write_bank_kernel", "infhip.plugins.infinitehip.raw_keys:_unrotate_kernel",
    "infhip.plugins.token_drop.importance:_row_stats_kernel",
    "infhip.plugins.token_drop.importance:_block_scores_kernel",
    "infhip.plugins.token_drop.top_p:_pack_keys_kernel", "infhip.plugins.token_drop.top_p:_select_kernel",
    "infhip.plugins.token_drop.top_p:_expand_kernel", "infhip.plugins.token_drop.attention:_kept_attention_kernel",
}
# Bounds per plan of these modules' variants (measured: 64 at 128K, 200 with token drop past
# the window; see test_counts for where they come from)
BOUND_IN_WINDOW, BOUND_PAST_WINDOW = 100, 240
K, M = 1 << 17, 1 << 20


def engine_config(model: str = "llama-3.1-8b", preset: str = "3k", kv_dtype: str = "bfloat16",
                  token_drop: bool = False, max_seq_len: int = K) -> EngineConfig:
    """An engine's config as infhip-build writes it for an sm_90 target (defaults: 16 sequences,
    32K-token steps), without weights."""
    m, _ = model_config_from_hf(json.loads(bundled_config(model).read_text()))
    plan = make_plan(m, preset)
    if token_drop:
        plan = plan.with_knobs("token_drop", parse_token_drop(""))
    build = BuildConfig(dtype="bfloat16", kv_dtype=kv_dtype, max_seq_len=max_seq_len, max_batch_size=16,
                        max_num_batched_tokens=32768, cuda_graph_batch_sizes=(1, 2, 4, 8, 16), target="sm_90")
    return EngineConfig(model=m, plan=plan, build=build)


def sparse_variants(config: EngineConfig) -> set:
    """The variants these modules enumerate for config (builder/kernels.enumerate_variants,
    restricted to them)."""
    space = LaunchSpace(config, Target())
    with record(space.target, launch=False) as rec:
        for name in SPARSE_MODULES:
            importlib.import_module(f"infhip.plugins.{name}").aot_launches(space)
    return set(rec.variants)


def test_modules_are_enumerated_by_the_builder():
    assert set(SPARSE_MODULES) <= set(plugin_modules())


@pytest.mark.parametrize("preset", ["3k", "3k-flash", "5k"])
def test_bounded_and_deterministic(preset):
    """Per preset: bf16 and fp8 KV in the window, fp8 with token drop past it; the same set twice
    (and the builder's own enumeration holds it)."""
    seen = set()
    for kv, drop, msl, bound in (("bfloat16", False, K, BOUND_IN_WINDOW), ("fp8", True, M, BOUND_PAST_WINDOW)):
        config = engine_config(preset=preset, kv_dtype=kv, token_drop=drop, max_seq_len=msl)
        first = sparse_variants(config)
        assert 0 < len(first) <= bound, f"{preset} {kv} token_drop={drop} max_seq_len={msl}: {len(first)} variants"
        assert sparse_variants(config) == first
        assert {v.kernel for v in first} <= KERNELS
        seen |= {v.kernel for v in first}
    assert seen >= KERNELS - {"infhip.plugins.token_drop.attention:_kept_attention_kernel"}  # Llama: no sliding layer


def test_builder_enumeration_includes_them():
    config = engine_config(preset="3k-flash", kv_dtype="fp8")
    assert sparse_variants(config) <= set(enumerate_variants(config, Target()))


def test_kept_attention_on_sliding_models():
    """kept_attention runs only at the sliding layers between token-drop anchors (Gemma-3)."""
    config = engine_config("gemma-3-1b", preset="3k", token_drop=True, max_seq_len=8192)
    kernels = {v.kernel for v in sparse_variants(config)}
    assert "infhip.plugins.token_drop.attention:_kept_attention_kernel" in kernels
    assert not sparse_variants(engine_config(preset="dense"))  # a dense engine without token drop: none


def test_space_follows_the_plan():
    """Past the window: dynamic RoPE, the key bank (and its writer), raw keys; inside it none of
    them; the split count of sparse decode covers batch 1 to max_batch_size; offload (a load
    option) always."""
    inside, past = (sparse_variants(engine_config(max_seq_len=msl)) for msl in (K, M))
    names = lambda vs: {v.name for v in vs}  # noqa: E731
    assert not names(inside) & {"_write_bank_kernel", "_unrotate_kernel"}
    assert {"_write_bank_kernel", "_unrotate_kernel", "_copy_pages_kernel"} <= names(past)
    consts = lambda vs, name, key: {dict(v.constants).get(key) for v in vs if v.name == name}  # noqa: E731
    assert consts(inside, "_select_rep_kernel", "ROPE_STYLE") == {"0"}
    assert consts(past, "_select_rep_kernel", "ROPE_STYLE") == {"0", "1", "2"}
    assert consts(past, "_sparse_attn_kernel", "BANK") == {"False", "True"}
    assert consts(inside, "_select_rep_kernel", "OFFLOAD") == {"False", "True"}
    from infhip.plugins.dense_attention import choose_num_splits
    tiles = -(-(256 + 2048 + 1024) // 64)
    splits = {str(choose_num_splits(b, 8, tiles, Target().num_sms)) for b in (1, 2, 4, 8, 16)}  # batch buckets
    assert consts(inside, "_sparse_attn_kernel", "NUM_SPLITS") == splits | {"1"}


def with_mask_layout(config: EngineConfig, layout: str) -> EngineConfig:
    """config whose InfiniteHiP knobs ask for a mask layout (plugins/infinitehip/_aot.mask_layout_of
    reads ``mask_layout``; the runtime's config gains the knob in its own change, issue 32)."""
    @dataclasses.dataclass(frozen=True)
    class LayoutConfig(type(config.plan.knobs_of("infinitehip"))):
        mask_layout: str = "shared"

    cfg = config.plan.knobs_of("infinitehip")
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    plan = config.plan.with_knobs("infinitehip", LayoutConfig(**fields, mask_layout=layout))
    return dataclasses.replace(config, plan=plan)


@pytest.mark.parametrize("layout", ["kv_head", "q_head"])
def test_mask_layouts_have_their_kernels(layout):
    """An engine asking for a per-head layout (Llama-8B: 32 q / 8 kv heads) enumerates its own
    SelectRep, top-k and attention variants: q_head one program per q head (group_size
    specialized to 1, 4 programs per kv head), kv_head per kv head (groups of 4) with head
    strides on the index rows; no key bank either way (shared only); bounded and deterministic;
    what a direct launch of that layout records at other batch sizes is in the set."""
    from infhip.plugins.aot import LaunchSpace
    from infhip.plugins.infinitehip import pruning_stage, sparse_decode_attention
    from infhip.plugins.infinitehip._aot import sparse_space

    base = engine_config(max_seq_len=M)
    config = with_mask_layout(base, layout)
    got, shared = sparse_variants(config), sparse_variants(base)
    assert 0 < len(got) <= BOUND_PAST_WINDOW and sparse_variants(config) == got and got != shared
    names = {v.name for v in got}
    assert "_write_bank_kernel" not in names and {"_select_rep_kernel", "_topk_expand_kernel"} <= names
    consts = lambda vs, name, key: {dict(v.constants).get(key) for v in vs if v.name == name}  # noqa: E731
    assert consts(got, "_sparse_attn_kernel", "BANK") == {"False"}
    for kernel in ("_select_rep_kernel", "_sparse_attn_kernel"):
        assert consts(shared, kernel, "group_size") == {None} and consts(shared, kernel, "heads_per_kv") == {"1"}
        if layout == "q_head":
            assert consts(got, kernel, "group_size") == {"1"} and consts(got, kernel, "heads_per_kv") == {None}
        else:
            assert consts(got, kernel, "group_size") == {None} and consts(got, kernel, "heads_per_kv") == {"1"}

    space = LaunchSpace(config, Target())
    ss = sparse_space(space)
    stage = ss.kinds[0].stages[1]
    with record(space.target, launch=False) as rec:  # decode of 3 rows: stage 2 and the attention
        pruning_stage(ss.step_q(3), ss.kv(False), ss.tables(3), ss.i32(3), ss.i32(3), ss.i32(3),
                      ss.index_rows(3, ss.kinds[0].stages[0].k), ss.index_lens(3), chunk_size=stage.chunk_size,
                      k=stage.k, block_q=1, n_sink=ss.cfg.n_sink, n_stream=ss.cfg.n_stream, mask_layout=layout,
                      head_normalized=True)
        sparse_decode_attention(ss.rows_q(3), ss.kv(False), ss.tables(3), ss.i32(3),
                                ss.index_rows(3, ss.kinds[0].stages[-1].k), n_sink=ss.cfg.n_sink,
                                n_stream=ss.cfg.n_stream, scale=0.1, rope_group=ss.kinds[0].stages[-1].chunk_size)
    assert rec.variants and set(rec.variants) <= got
