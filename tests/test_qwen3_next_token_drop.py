"""UniPrefill token drop on Qwen3-Next (tiny, 8 layers: linear x3, full, linear x3, full; CPU,
float32): with a forced retention, the drops at the full-attention layers carry only the kept
tokens through the following linear-attention layers (their conv and delta-rule state are those
of the kept tokens) and the MoE, then decode; the logits equal a float64 reference that runs
each layer over its active rows (eval/hybrid_reference.py), and differ from the
undropped model's. The authors' schedule in chunks of 100 (a later chunk resumes the kept
tokens' state) and the paper's (before attention, re-entry) whole. And the TTFT benchmark
(benchmarks/speed/bench_qwen3_next_ttft.py) at tiny size on the CPU (--smoke)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.speed.bench_qwen3_next_ttft import main as bench_main
from infhip import LLM
from infhip.eval.common import record_kept_positions, set_forced_retention
from infhip.eval.hybrid_reference import reference_logits
from infhip.eval.token_drop_reference import reference_schedule, run_greedy

TINY = dict(obs_window=8, block_size=8, num_sink=8, min_prompt_len=0, spare_anchors=0)
SCHEDULES = {
    "authors": dict(drop_layers="every", drop_point="after_attention", reenter=False),
    "paper": dict(drop_layers="every", drop_point="before_attention", reenter=True),
}
# float32 through 8 layers of recurrences and MoE: the undropped engine is ~2e-4 off float64 here
TOL = 5e-4


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine("qwen3_next", hf=dict(num_hidden_layers=8), max_seq_len=256, max_batch_size=4)


@pytest.mark.parametrize("schedule, budget", [("authors", 100), ("paper", None)])
def test_drop_through_linear_layers_equals_float64_reference(engine, schedule, budget):
    ids = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = set_forced_retention(LLM(engine, max_num_batched_tokens=budget,
                                   token_drop=dict(TINY, **SCHEDULES[schedule])), 0.3)
    kept_positions = record_kept_positions(llm)
    tokens, logits, sid = run_greedy(llm, ids, 4)
    kept = {layer: torch.cat(chunks) for layer, chunks in kept_positions[sid].items()}
    sched = reference_schedule(llm)
    assert set(sched["layers"]) == set(kept) == {3, 7}  # the full-attention layers only
    assert all(len(kept[layer]) < 0.6 * len(ids) for layer in kept)  # really dropped
    layers = llm.engine.config.plan.layers
    full = ids + tokens[:-1]
    ref = reference_logits(llm.engine.model, full, len(ids), kept, layers, schedule=sched)[len(ids) - 1:]
    assert (logits.double() - ref).abs().max() < TOL
    dense = reference_logits(llm.engine.model, full, len(ids), {}, layers)[len(ids) - 1:]
    assert (logits.double() - dense).abs().max() > 1e-2


def test_decode_graph_inputs_after_drops_equal_eager_steps(engine, monkeypatch):
    """Decode after drops through the graphs' static buffers (tests/_graph_sim.py): the per-layer
    KV shifts of the full-attention layers and the recurrent slots staged together give the eager
    steps' tokens (three sequences, padded to a graph of 4)."""
    from infhip import SamplingParams
    from tests._graph_sim import simulate_graphs

    knobs = dict(TINY, drop_layers="every")
    prompts = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(40 + n)).tolist() for n in (90, 120, 70)]
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    eager = set_forced_retention(LLM(engine, token_drop=knobs), 0.3).generate(prompt_token_ids=prompts, sampling_params=sp)
    llm = set_forced_retention(LLM(engine, token_drop=knobs), 0.3)
    keys, _ = simulate_graphs(llm, monkeypatch)
    got = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    assert any(key.kv_shift == "token_drop" for key in keys)


def test_ttft_benchmark_smoke_run_writes_every_row(tmp_path):
    res = bench_main(["--smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    saved = json.loads((tmp_path / "out" / "bench_qwen3_next_ttft.json").read_text())
    assert saved["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert saved["drop_layers"] and set(saved["drop_layers"]) <= {3, 7}
    assert [r["length"] for r in saved["ttft"]] == [64]
    assert all(r[c] > 0 for r in saved["ttft"] for c in ("dense", "rho=0.3"))
    assert [r["tokens"] for r in saved["moe"]] == [1, 16] and res["smoke"]
