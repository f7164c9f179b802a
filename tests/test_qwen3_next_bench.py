"""benchmarks/speed/bench_qwen3_next_ttft.py at tiny size on the CPU (--smoke): it builds the
depth-cut random-weight engine, times dense and token drop at each length and the MoE loop, and
writes its JSON."""

from __future__ import annotations

import json

from benchmarks.speed.bench_qwen3_next_ttft import main


def test_smoke_run_writes_every_row(tmp_path):
    res = main(["--smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    saved = json.loads((tmp_path / "out" / "bench_qwen3_next_ttft.json").read_text())
    assert saved["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert saved["drop_layers"] and set(saved["drop_layers"]) <= {3, 7}
    assert [r["length"] for r in saved["ttft"]] == [64]
    assert all(r[c] > 0 for r in saved["ttft"] for c in ("dense", "rho=0.3"))
    assert [r["tokens"] for r in saved["moe"]] == [1, 16] and res["smoke"]
