"""The builder's kernel enumeration covers what the runtime really launches.

Each scenario runs tiny engines through the runtime on CPU with every launch recorded
(plugins/aot.py: the launchers take the Triton path under the interpreter, sized for an H200's
132 SMs, as on the GPU) and checks that every recorded variant — kernel, types, constexprs,
integer and alignment specializations, launch options — is one that builder/kernels.py
enumerates for that engine's plan. A variant missing here is a kernel an engine would compile
while serving (or refuse to run under ``jit="forbid"``).

Past the trained window (``rope_off_in_trained_window`` off: every sparse step is past it for
the tiny model) the scenarios reach dynamic RoPE in pruning and attention, raw-keys prefill (a
step of >= 8 query blocks) and re-rotating prefill (fewer), the key bank and, for decode rows
that own no bank row (``key_bank_slots=2``), rotating decode; with KV offloading (pages moved
one at a time) host pages, the value bank, staged prefill and the page copies.
"""

from __future__ import annotations

import pytest

from infhip import LLM, SamplingParams
from infhip.builder.kernels import enumerate_variants
from infhip.config import EngineConfig
import infhip.runtime.offload.policy as offload_policy
from infhip.plugins.aot import Target, record

# Stages small enough for contexts of ~100 tokens to go sparse (as tests/test_infinitehip_runtime.py).
# Stage 1's chunks of 16: the candidate capacity is at least 1024 (64 chunks, 2 tiles of the
# SelectRep kernel, 1 under dynamic RoPE), so the interpreter walks few empty tiles.
TINY = dict(n_sink=4, n_stream=8, stages=[(8, 16, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0],
            special_final_k=16, dense_threshold=30)
PAST = dict(TINY, rope_off_in_trained_window=False, key_bank_slots=2)  # dynamic RoPE; 2 bank rows
PROMPTS = [[(7 * i + 3 * j) % 290 + 3 for j in range(n)] for i, n in enumerate((90, 41, 120, 5))]
LONG = [(5 * j) % 290 + 3 for j in range(150)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
KW = dict(max_seq_len=200, max_batch_size=4)
# Fewer layers, the same launches (variant sets compared with the full tiny models, 2026-12-05),
# a third (Llama) to half (Gemma-3) of the interpreter time: the tiny Llama's special layer 0 and
# one regular layer; Gemma-3's global layer between two sliding ones. gemma3-token-drop keeps
# all 7 layers (with 3 its default drop rule drops nothing: 7 of its 15 variants were launched).
L2 = dict(num_hidden_layers=2)
G3 = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
MiB = 1 << 20

# name -> (checkpoint arch, tiny_engine options (hf: checkpoint overrides), LLM options[, run
# options: prompts, step token budget (64), one-page offload batches]). fp8 KV and offloading are
# covered together by the past-window scenario (separate inside-window ones cost 7 CPU minutes of
# CI and added nothing).
SCENARIOS = {
    "dense": ("llama", dict(hf=L2), {}),
    "dense-fp8": ("llama", dict(hf=L2, kv_dtype="fp8"), {}),
    # fp8 weights, the LM head too: decode rows through the fp8 skinny kernel, prefill chunks
    # through torch._scaled_mm's activation quantization (emulated off the GPU), fused into the
    # norms and the activation where they feed an fp8 linear
    "dense-fp8-weights": ("llama", dict(hf=L2, weight_dtype="fp8", quantize_lm_head=True), {}),
    "3k": ("llama", dict(hf=L2, preset="3k", infinitehip_overrides=TINY), {}),
    "token-drop": ("llama", dict(hf=L2, token_drop=dict(p=0.9, min_prompt_len=32, obs_window=8, block_size=8,
                                                        num_sink=8)), {}),
    "gemma3-3k": ("gemma3", dict(hf=G3, preset="3k", infinitehip_overrides=TINY), {}),
    "gemma3-token-drop": ("gemma3", dict(token_drop=dict(p=0.9, min_prompt_len=32, obs_window=8, block_size=8, num_sink=8,
                                                         spare_anchors=0)),
                          {}, dict(prompts=PROMPTS[:2])),
    "3k-past-window": ("llama", dict(hf=L2, preset="3k", infinitehip_overrides=PAST), {}),
    # Qwen3-Next: linear-attention layers (causal conv, the gated delta rule's chunked scan and
    # recurrent decode), MoE experts and the shared expert's MLP (its own width: the strict GPU
    # suite found its activation launch missing, 2026-12-08), token drop through all of them
    "qwen3-next": ("qwen3_next", {}, {}),
    "qwen3-next-token-drop": ("qwen3_next", dict(token_drop=dict(p=0.9, min_prompt_len=32, obs_window=8, block_size=8,
                                                                 num_sink=8)), {}),
    # a 150-token prompt in 48-token chunks: its pages move after its second chunk, and its third
    # and fourth prefill from staged copies
    "3k-past-window-offload-fp8": ("llama", dict(hf=L2, preset="3k", infinitehip_overrides=PAST, kv_dtype="fp8"),
                                   dict(kv_offload_bytes=4 * MiB),
                                   dict(prompts=[LONG, PROMPTS[1], PROMPTS[3]], budget=48, small_batches=True)),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_enumeration_covers_launches(tiny_engine, monkeypatch, name):
    arch, build_kw, llm_kw, run = (*SCENARIOS[name], {})[:4]
    if run.get("small_batches"):  # move pages one at a time (tiny contexts)
        monkeypatch.setattr(offload_policy, "OFFLOAD_BATCH_TOKENS", 16)
    engine = tiny_engine(arch, **KW, **build_kw)
    target = Target()
    enumerated = set(enumerate_variants(EngineConfig.load(engine), target))
    with record(target, launch=True) as rec:
        llm = LLM(engine, max_num_batched_tokens=run.get("budget", 64), **llm_kw)
        outs = llm.generate(prompt_token_ids=run.get("prompts", PROMPTS), sampling_params=GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert rec.variants, "no Triton launch recorded: the scenario did not reach the kernels"
    if build_kw.get("weight_dtype") == "fp8":
        assert {"_fp8_skinny_kernel", "_quantize_act_kernel"} <= {v.name for v in rec.variants}
        # prefill chunks: the norms and the activation write fp8 rows for scaled_mm (Fp8Act)
        fused = {v.name for v in rec.variants if dict(v.constants).get("QUANT") == "True"}
        assert fused == {"_rms_norm_kernel", "_gated_act_kernel"}
    missing = sorted(v.describe() for v in rec.variants - enumerated)
    assert not missing, f"{len(missing)} launched variant(s) not enumerated for {name}:\n" + "\n".join(missing)
