"""Tensor parallelism's shard layout: which heads and MLP columns each rank holds (Megatron-style).

One place for the contract between the builder (builder/shard.py cuts the weights) and the
runtime (runtime/distributed/: each rank builds its model with `local_model_config`), recorded
in config.json under "tensor_parallel" (docs/design/tensor_parallel.md).

Rank r of N holds:

* query heads [r Hq/N, (r+1) Hq/N) — contiguous, so a rank's heads share GQA groups;
* kv heads [r Hkv/N, (r+1) Hkv/N) when N divides Hkv; when Hkv divides N (fewer kv heads than
  ranks) the one kv head r // (N / Hkv), i.e. each kv head is replicated on N / Hkv ranks — the
  kv head of every query head the rank holds (head h reads kv head h // (Hq / Hkv));
* intermediate columns [r I/N, (r+1) I/N) of gate and up (column-parallel) and the same rows
  of down's input (row-parallel); o_proj's input columns of its query heads (row-parallel).

Everything else (embeddings, norms, the LM head, RoPE tables, q/k norms) is replicated. The
partial outputs of o_proj and down_proj are summed by one all-reduce each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from infhip.model_config import ModelConfig


@dataclass(frozen=True)
class RankShard:
    """What rank `rank` holds; ranges are [lo, hi) in the full model's numbering."""

    rank: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]


def tp_problem(model: ModelConfig, tp: int) -> str | None:
    """Why `model` cannot be split over `tp` ranks (one line, with what to do), or None."""
    if not isinstance(tp, int) or tp < 1:
        return f"--tp must be a positive integer, got {tp!r}"
    if tp == 1:
        return None
    hq, hkv, inter = model.num_heads, model.num_kv_heads, model.intermediate_size
    divisors = [d for d in range(1, hq + 1) if hq % d == 0 and (hkv % d == 0 or d % hkv == 0)
                and inter % d == 0]
    hint = f"choose --tp from {', '.join(map(str, divisors))}"
    if hq % tp:
        return f"--tp {tp} does not divide the model's {hq} query heads; {hint}"
    if hkv % tp and tp % hkv:
        return (f"--tp {tp} neither divides the model's {hkv} kv heads nor is a multiple of them "
                f"(kv heads are split or replicated whole); {hint}")
    if inter % tp:
        return f"--tp {tp} does not divide the model's MLP width {inter}; {hint}"
    return None


def shard_layout(model: ModelConfig, tp: int) -> tuple[RankShard, ...]:
    """Every rank's shard (tp_problem must be None)."""
    problem = tp_problem(model, tp)
    if problem is not None:
        raise ValueError(problem)
    hq, hkv, inter = model.num_heads // tp, model.num_kv_heads, model.intermediate_size // tp
    shards = []
    for r in range(tp):
        if hkv % tp == 0:
            kv = (r * hkv // tp, (r + 1) * hkv // tp)
        else:  # replicated: tp // hkv ranks per kv head
            head = r // (tp // hkv)
            kv = (head, head + 1)
        shards.append(RankShard(r, (r * hq, (r + 1) * hq), kv, (r * inter, (r + 1) * inter)))
    return tuple(shards)


def replicates_kv_heads(model: ModelConfig, tp: int) -> bool:
    """Fewer kv heads than ranks: each kv head lives on several ranks."""
    return tp > 1 and model.num_kv_heads % tp != 0


def local_model_config(model: ModelConfig, shard: RankShard) -> ModelConfig:
    """The model as one rank sees it: its own head counts and MLP width (the blocks size their
    layers, the runner its KV pages and the builder its AOT kernels from these)."""
    return dataclasses.replace(
        model, num_heads=shard.q_heads[1] - shard.q_heads[0],
        num_kv_heads=shard.kv_heads[1] - shard.kv_heads[0],
        intermediate_size=shard.intermediate[1] - shard.intermediate[0])


def layout_record(model: ModelConfig, tp: int) -> dict:
    """config.json's "tensor_parallel" section: the mapping, for readers of the engine."""
    return {"size": tp, "ranks": [dataclasses.asdict(s) for s in shard_layout(model, tp)],
            "weights": [f"rank{r}.safetensors" for r in range(tp)]}
