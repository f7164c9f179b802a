"""One load of an engine, shared by rank 0 (`EngineCore`, runtime/engine_core.py) and every
tensor-parallel worker (runtime/distributed/worker.py): the rank's engine with the load's plan
changes, its ModelRunner, and the prefix-caching rule of its plan."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from infhip.runtime.attention.backend import backends
from infhip.runtime.engine import load_engine
from infhip.runtime.kernel_store import compile_at_load, serving
from infhip.runtime.model_runner import ModelRunner
from infhip.runtime.options import LoadOptions


def load_rank(engine_dir: str | Path, opts: LoadOptions, rank: int = 0):
    """Rank `rank`'s engine (its weight shard, its view of the model) with the load's plan
    changes applied (methods' load knobs, transforms on/off: LoadOptions.overrides), and the
    kernel variants those changes need compiled (kernel_store.compile_at_load): what
    EngineCore and each TP worker serve."""
    engine = load_engine(engine_dir, opts.device, opts.jit, rank=rank)
    built = engine.config.plan
    engine.config = dataclasses.replace(engine.config, plan=built.at_load(opts.overrides))
    # kernels the load's plan needs and the engine lacks compile now, never while serving
    compile_at_load(engine.kernels, engine.config, built)
    return engine


def make_runner(engine, opts: LoadOptions) -> tuple[ModelRunner, int, int, int]:
    """(runner, max_num_seqs, token budget per step, decode steps run back to back) of a load;
    every TP rank makes the same one (runtime/distributed/worker.py)."""
    num_decode_steps = opts.decode_steps_on(engine.device.type)
    build = engine.config.build
    max_num_seqs = opts.max_num_seqs or build.max_batch_size
    budget = opts.max_num_batched_tokens or build.max_num_batched_tokens
    if budget < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({max_num_seqs})")
    with serving(engine.kernels):  # graph capture launches every decode kernel once
        runner = ModelRunner(engine, max_num_seqs, budget, opts.kv_cache_memory_bytes,
                             gpu_memory_utilization=opts.gpu_memory_utilization, enforce_eager=opts.enforce_eager,
                             max_decode_steps=num_decode_steps, kv_offload_bytes=opts.kv_offload_bytes)
    return runner, max_num_seqs, budget, num_decode_steps


def prefix_caching_rule(config, page_size: int) -> dict:
    """KVCacheManager.enable_prefix_caching's arguments for an engine (docs/design/prefix_caching.md,
    "Exactness per plan"; token drop's rule is the scheduler's prefix_filter): reused prefixes are
    multiples of every attention backend's granule, and decode-filled pages are named only if
    every backend allows it (no state but K/V survives a prefill)."""
    used = [cls for cls in backends() if cls.knobs_of(config) is not None]
    if not used:
        return {}
    return dict(granule=math.lcm(page_size, *(cls.prefix_granule(config) for cls in used)),
                cache_decode_pages=all(cls.caches_decode_pages(config) for cls in used))


def load_report(engine, runner: ModelRunner, t0: float, t_engine: float) -> dict:
    """Where a load spent its time (t0: its start, t_engine: the engine loaded): reading weights,
    verifying the engine's compiled kernels, capturing the decode graphs (kernels load on their
    first launch, in the graphs' warm-ups)."""
    kernels = engine.kernels
    graphs = runner.graphs.report if runner.graphs is not None else {"graphs": 0, "seconds": 0.0}
    total = time.perf_counter() - t0
    verify = kernels.load_seconds if kernels is not None else 0.0
    return {"total_s": round(total, 3), "weights_s": round(t_engine - t0 - verify, 3),
            "kernels_verify_s": round(verify, 3), "kernels": len(kernels.variants) if kernels else 0,
            "graphs": graphs["graphs"], "graphs_s": round(graphs["seconds"], 3),
            "graph_pool_bytes": graphs.get("pool_bytes", 0),
            "other_s": round(total - (t_engine - t0) - graphs["seconds"], 3)}
