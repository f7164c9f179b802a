"""The builder's kernel enumeration covers what the runtime really launches.

Each scenario runs tiny engines through the runtime on CPU with every launch recorded
(plugins/aot.py: the launchers take the Triton path under the interpreter, sized for an H200's
132 SMs, as on the GPU) and checks that every recorded variant — kernel, types, constexprs,
integer and alignment specializations, launch options — is one that builder/kernels.py
enumerates for that engine's plan. A variant missing here is a kernel an engine would compile
while serving (or refuse to run under ``jit="forbid"``).
"""

from __future__ import annotations

import pytest

from infhip import LLM, SamplingParams
from infhip.builder.build import build_engine
from infhip.builder.kernels import enumerate_variants
from infhip.config import EngineConfig
from infhip.plugins.aot import Target, record
from tests._tiny import write_tiny_hf_checkpoint

# Stages small enough for contexts of ~100 tokens to go sparse (as tests/test_infinitehip_runtime.py).
TINY = dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0],
            special_final_k=16, dense_threshold=30)
PROMPTS = [[(7 * i + 3 * j) % 290 + 3 for j in range(n)] for i, n in enumerate((90, 41, 120, 5))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
KW = dict(dtype="float32", device="cpu", max_seq_len=200, max_batch_size=4, progress=False)
MiB = 1 << 20

# name -> (checkpoint arch, build options, LLM options)
SCENARIOS = {
    "dense": ("llama", {}, {}),
    "dense-fp8": ("llama", dict(kv_dtype="fp8"), {}),
    "3k": ("llama", dict(preset="3k", infinitehip_overrides=TINY), {}),
    "3k-flash-fp8": ("llama", dict(preset="3k-flash", infinitehip_overrides=TINY, kv_dtype="fp8"), {}),
    "3k-offload": ("llama", dict(preset="3k", infinitehip_overrides=TINY), dict(kv_offload_bytes=4 * MiB)),
    "token-drop": ("llama", dict(token_drop=dict(p=0.9, min_prompt_len=32, n=8, block_size=8, num_sink=8)), {}),
    "gemma3-3k": ("gemma3", dict(preset="3k", infinitehip_overrides=TINY), {}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("aot")
    for arch in ("llama", "gemma3"):
        write_tiny_hf_checkpoint(root / arch, arch)
    return root


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_enumeration_covers_launches(checkpoints, tmp_path, name):
    arch, build_kw, llm_kw = SCENARIOS[name]
    engine = build_engine(checkpoint=checkpoints / arch, output_dir=tmp_path / name, **KW, **build_kw)
    target = Target()
    enumerated = set(enumerate_variants(EngineConfig.load(engine), target))
    with record(target, launch=True) as rec:
        llm = LLM(engine, max_num_batched_tokens=64, **llm_kw)
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    assert rec.variants, "no Triton launch recorded: the scenario did not reach the kernels"
    missing = sorted(v.describe() for v in rec.variants - enumerated)
    assert not missing, f"{len(missing)} launched variant(s) not enumerated for {name}:\n" + "\n".join(missing)
