"""The benchmarks' ``--smoke`` mode: a GPU benchmark's own code on the CPU at tiny sizes, so that a
suite which cannot start on the GPU because of our Python fails in CI instead
(tests/test_gpu_suites_on_cpu.py runs every suite's entry points this way). The numbers of a smoke
run time nothing worth reading; the code paths, argument parsing and JSON are what it checks.

    device(smoke)        "cpu" under --smoke, else "cuda"
    gpu_name()           the GPU's name, or "cpu (smoke)"
    sync()               torch.cuda.synchronize() where a GPU is, nothing on the CPU
    tiny_config(model)   a bundled config (llama-3.1-8b, gemma-3-12b, ...) shrunk: 3 layers (gemma 7:
                         5 sliding + 1 global + 1), 64 wide, 4 q / 2 kv heads of 16, vocab 320, a
                         128-token trained window (so a 200-token prompt runs past it)
    write_config(path, model, smoke)   the config a benchmark builds from, tiny under --smoke
    BUILD                build_engine keywords of a CPU build: float32 on the CPU, chunks of 64
    TINY_IH              InfiniteHiP overrides whose stages make a 64-token context run sparse
    cap(n)               a context or prompt length cut to at most TOKENS under --smoke
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENS = 200  # longest context a smoke run uses: past the 128-token window, a few 64-token chunks
BUILD = dict(dtype="float32", device="cpu", max_num_batched_tokens=64)
TINY_IH = dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0],
               special_final_k=16, dense_threshold=30)
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=320, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)


def device(smoke: bool) -> str:
    return "cpu" if smoke else "cuda"


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cap(n: int, smoke: bool) -> int:
    return min(n, TOKENS) if smoke else n


def tiny_config(model: str) -> dict:
    """`model`'s bundled config with every size small and its architecture kept (the layer
    pattern re-derived, the sliding window shrunk to 16, llama3 RoPE scaled from 64 tokens)."""
    from infhip.builder.registry import bundled_config

    cfg = json.loads(bundled_config(model).read_text())
    gemma = "gemma" in cfg.get("model_type", "")
    cfg.update(_SHAPE, num_hidden_layers=7 if gemma else 3)
    cfg.pop("layer_types", None)  # re-derived from sliding_window_pattern
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = 16 if gemma else None
    if gemma:
        cfg["query_pre_attn_scalar"] = 16
    scaling = cfg.get("rope_scaling") or {}
    if "original_max_position_embeddings" in scaling:
        scaling["original_max_position_embeddings"] = 64
    return cfg


def write_config(path: Path, model: str, smoke: bool) -> Path:
    """`model`'s config as a checkpoint to build random weights from (tiny under smoke)."""
    from infhip.builder.registry import bundled_config

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tiny_config(model)) if smoke else bundled_config(model).read_text())
    return path
