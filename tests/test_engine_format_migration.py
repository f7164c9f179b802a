"""Engines of format 1 (before the plan named registered methods: knobs under ``plan.infinitehip``
/ ``plan.token_drop``, a layer's backend under ``plugin``) load unchanged. The config.json in
tests/data/engine_v1_3k_token_drop.json was written by infhip at 70a085c (format 1) for the tiny
Llama of tests/_tiny.py: float32, CPU, max_seq_len 256, 4 sequences, preset 3k with tiny knobs,
token drop on. It migrates on read (infhip/config.py migrate_v1) to the plan that a build of the
same options writes now, and the engine serves the same tokens with either config.json."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from infhip import LLM, SamplingParams
from infhip.builder.build import build_engine
from infhip.config import FORMAT_VERSION, EngineConfig
from tests._tiny import write_tiny_hf_checkpoint

STORED = Path(__file__).parent / "data" / "engine_v1_3k_token_drop.json"
IH = dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0], special_final_k=16,
          dense_threshold=30)
DROP = dict(obs_window=8, block_size=8, num_sink=8, min_prompt_len=0)


def test_a_stored_v1_engine_loads_as_todays_build_and_serves_its_tokens(tmp_path):
    stored = json.loads(STORED.read_text())
    assert stored["format_version"] == 1 and "infinitehip" in stored["plan"] and "token_drop" in stored["plan"]
    write_tiny_hf_checkpoint(tmp_path / "hf", "llama", tokenizer=True)
    new = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "new", dtype="float32", device="cpu",
                       max_seq_len=256, max_batch_size=4, progress=False, preset="3k", infinitehip_overrides=IH,
                       token_drop=DROP)
    old = tmp_path / "old"
    shutil.copytree(new, old)
    (old / "config.json").write_text(STORED.read_text())

    a, b = EngineConfig.load(old), EngineConfig.load(new)
    assert json.loads((new / "config.json").read_text())["format_version"] == FORMAT_VERSION == 2
    assert a.format_version == FORMAT_VERSION
    assert a.model == b.model and a.plan == b.plan
    assert dataclasses.replace(a.build, created_at="") == dataclasses.replace(b.build, created_at="")
    assert set(a.plan.knobs) == {"infinitehip", "token_drop"}
    assert {lp.backend for lp in a.plan.layers} == {"infinitehip"}

    prompts = [[(7 * i + 3 * j) % 290 + 3 for j in range(n)] for i, n in enumerate((90, 41))]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def tokens(engine):
        return [o.token_ids for o in LLM(engine).generate(prompt_token_ids=prompts, sampling_params=greedy)]

    assert tokens(old) == tokens(new)
