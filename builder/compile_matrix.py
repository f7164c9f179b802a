"""Compile the kernel variants engine configurations launch, for the GPUs users have, on a machine
without a GPU: CI's check that every engine builds for sm_80 / sm_89 / sm_90 under the Triton
installed (tests/run.sh runs it under the newest Triton and the floor, 3.6.0).

What is enumerated: the builder's own enumeration (builder/kernels.py: each plugin's
``aot_launches`` and each backend's ``launch_space``, offloaded KV and every sampling feature
included) for a matrix of engine configurations: the model shapes of builder/model_configs
(GQA ratios, head dims 64-256, sliding layers, biases, q/k norms) crossed with the presets, KV
dtype (bf16, fp8 where the target has e4m3), weight form (bf16, fp8, fp8 LM head), token drop,
a context past the trained window (dynamic RoPE, raw keys, the key bank) and tensor-parallel
shards. ``3k-fast`` and ``3k-flash`` differ from ``3k`` in refresh intervals only, which no
kernel specializes on (tests/test_compile_matrix.py holds that), so ``3k`` stands for them.

What is compiled: the union is ~2,800 variants per target, ~2.4 s each on a 2-core CI machine:
an hour per target and Triton. :func:`representatives` picks a covering subset per kernel:
every value of every constexpr (a size that fails alone, as ``tl.topk``'s K = 1 did under
Triton 3.6), and every pair of code-path settings (constexpr flags, pointer dtypes, launch
options) that occurs together (most lowering failures need one or two settings). That is ~220
variants. ``--full`` targets compile them to cubin (ptxas included); the others through TTGIR
(the frontend and the target's layout passes, where the arch-dependent type and op checks are;
~6x cheaper). A failure names the kernel, the variant, the target, the Triton version and one
configuration that launches it; the exit status is 1.

    python -m infhip.builder.compile_matrix                              # CI's matrix
    python -m infhip.builder.compile_matrix --targets sm_90 --full sm_90 --models llama-3.1-8b
    python -m infhip.builder.compile_matrix --all-variants --targets sm_90   # every variant (an hour)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

from infhip.plugins.aot import KernelVariant, Target

CONFIGS = Path(__file__).resolve().parent / "model_configs"

# The GPUs the builder's users have, with their SM counts (split-K grids are sized by them):
# A100 (sm_80), RTX 4090 (sm_89), H100 / H200 (sm_90).
TARGETS = {"sm_80": Target("sm_80", 108), "sm_89": Target("sm_89", 128), "sm_90": Target("sm_90", 132)}
PRESETS = ("dense", "3k", "5k")
MODELS = ("llama-3.1-8b", "gemma-3-12b", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "smollm2-135m",
          "qwen2.5-coder-0.5b", "gemma-3-270m", "llama-3.2-1b")
# The targets compiled through TTGIR take the shapes that differ most (head dims 128 / 256 / 64,
# GQA groups 4 / 2 / 3 / 7, sliding layers, biases): enumerating is half their time.
TTGIR_MODELS = ("llama-3.1-8b", "gemma-3-12b", "smollm2-135m", "qwen2.5-coder-0.5b")
# Constexprs that are sizes even with three values or fewer (the rest: more than three integers).
SIZE_CONSTANTS = ("NUM_SPLITS", "TILES", "ROPE_GROUP", "K", "TP", "PAGE_SIZE")


def engine_config(model: str, kv_dtype: str = "bfloat16", preset: str = "dense", token_drop: bool = False,
                  max_batch_size: int = 16, max_seq_len: int = 131072, weight_dtype: str = "bf16",
                  quantize_lm_head: bool = False, target: str = "sm_90", tp: int = 1):
    """The EngineConfig ``infhip-build`` writes for ``model`` (a builder/model_configs name) on a
    GPU target, without a checkpoint. With ``tp`` > 1 it is one rank's (the shard's shapes), as
    the builder compiles it."""
    from infhip.builder.build import _graph_batch_sizes
    from infhip.builder.hf_config import model_config_from_hf
    from infhip.builder.presets import plan_of
    from infhip.config import BuildConfig, EngineConfig

    mcfg, _ = model_config_from_hf(json.loads((CONFIGS / f"{model}.json").read_text()))
    build = BuildConfig(dtype="bfloat16", kv_dtype=kv_dtype, max_seq_len=min(mcfg.max_position_embeddings, max_seq_len)
                        if preset == "dense" else max_seq_len,
                        max_batch_size=max_batch_size, max_num_batched_tokens=32768,
                        cuda_graph_batch_sizes=_graph_batch_sizes(max_batch_size), target=target,
                        weight_dtype=weight_dtype, quantize_lm_head=quantize_lm_head)
    plan = plan_of(mcfg, preset, {"token_drop": True} if token_drop else None)
    if tp > 1:
        from infhip.tensor_parallel import local_model_config, shard_layout
        mcfg = local_model_config(mcfg, shard_layout(mcfg, tp)[0])
    return EngineConfig(model=mcfg, plan=plan, build=build)


def configurations(target: Target, models: tuple[str, ...] = MODELS) -> dict[str, dict]:
    """name -> engine_config keywords: every preset x KV dtype x weight form on each model, token
    drop, past-the-window contexts and TP shards of 2 and 4 where the heads divide."""
    from infhip.plugins.fp8_linear import FP8_MIN_CAPABILITY

    kv_dtypes = ("bfloat16", "fp8") if target.capability >= FP8_MIN_CAPABILITY else ("bfloat16",)
    out: dict[str, dict] = {}
    for model in models:
        for preset in PRESETS:
            for kv in kv_dtypes:
                for weights in ("bf16", "fp8", "fp8-lm-head"):
                    out[f"{model} {preset} kv={kv} w={weights}"] = dict(
                        model=model, preset=preset, kv_dtype=kv, weight_dtype=weights[:4].rstrip("-"),
                        quantize_lm_head=weights == "fp8-lm-head")
                if preset != "dense":  # past the trained window: dynamic RoPE, raw keys, the rotated key bank
                    out[f"{model} {preset} kv={kv} 1M"] = dict(model=model, preset=preset, kv_dtype=kv,
                                                               max_seq_len=1 << 20)
            out[f"{model} {preset} token-drop"] = dict(model=model, preset=preset, token_drop=True)
        for tp in (2, 4):
            if _heads_divide(model, tp):
                out[f"{model} dense tp={tp}"] = dict(model=model, tp=tp)
                out[f"{model} 3k kv={kv_dtypes[-1]} tp={tp}"] = dict(model=model, preset="3k", kv_dtype=kv_dtypes[-1],
                                                                     tp=tp)
    return out


def _heads_divide(model: str, tp: int) -> bool:
    """Whether the model splits over tp ranks (the builder's rule: it refuses the others)."""
    from infhip.builder.hf_config import model_config_from_hf
    from infhip.tensor_parallel import tp_problem

    mcfg, _ = model_config_from_hf(json.loads((CONFIGS / f"{model}.json").read_text()))
    return tp_problem(mcfg, tp) is None


def _enumerate_chunk(args: tuple) -> list[tuple[KernelVariant, str]]:
    from infhip.builder.kernels import enumerate_variants

    target, chunk = args
    return [(v, name) for name, kw in chunk for v in enumerate_variants(engine_config(**kw, target=target.name), target)]


def union_variants(target: Target, configs: dict[str, dict], jobs: int = 1) -> dict[KernelVariant, str]:
    """Every variant any configuration launches on ``target`` -> the first configuration that does
    (enumerated in ``jobs`` processes)."""
    items = list(configs.items())
    chunks = [items[i::jobs] for i in range(jobs)]
    seen: dict[KernelVariant, str] = {}
    with _pool(jobs) as pool:
        for pairs in pool.map(_enumerate_chunk, [(target, c) for c in chunks]):
            for v, name in pairs:
                seen.setdefault(v, name)
    return seen


def _is_size(name: str, values: set[str]) -> bool:
    ints = all(v.lstrip("-").isdigit() for v in values)
    return ints and (name.startswith("BLOCK") or name in SIZE_CONSTANTS or len(values) > 3)


def representatives(variants) -> list[KernelVariant]:
    """A covering subset of ``variants`` (module docstring): per kernel, greedily, until every
    constexpr value and every pair of code-path settings that occurs is in a chosen variant."""
    by_kernel: dict[str, list[KernelVariant]] = {}
    for v in sorted(variants, key=lambda v: v.key):
        by_kernel.setdefault(v.kernel, []).append(v)
    chosen: list[KernelVariant] = []
    for group in by_kernel.values():
        values: dict[str, set[str]] = {}
        for v in group:
            for name, value in v.constants:
                values.setdefault(name, set()).add(value)
        sizes = {n for n, vals in values.items() if _is_size(n, vals)}

        def facts(v: KernelVariant) -> set:
            path = sorted([c for c in v.constants if c[0] not in sizes]
                          + [s for s in v.signature if s[1].startswith("*")] + [("options", repr(v.options))])
            return set(v.constants) | set(itertools.combinations(path, 2)) | {(p,) for p in path}

        todo = {v: facts(v) for v in group}
        missing = set().union(*todo.values())
        while missing:
            best = max(todo, key=lambda v: len(todo[v] & missing))  # ties: the first in key order
            missing -= todo.pop(best)
            chosen.append(best)
    return chosen


class _Stop(Exception):
    """Raised by the first stage after the one compiled through."""


def _compile_one(args: tuple) -> tuple[str, str | None]:
    """(variant key, None or the error) of one compile in a worker, through ``stage``."""
    from infhip.plugins.aot import compile_variant

    variant, target, cache, stage = args
    try:
        with _through(stage):
            compile_variant(variant, None, target, cache)
    except _Stop:
        pass
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the others
        cause = f" (caused by {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return variant.key, f"{type(e).__name__}: {' | '.join(lines[-3:])[-500:]}{cause[:300]}"
    return variant.key, None


class _through:
    """Within: triton.compile runs its stages up to and including ``stage`` ("ttgir"), then stops
    (raises _Stop); "cubin" runs them all. Wraps the NVIDIA backend's add_stages (Triton 3.6-3.9:
    ``add_stages(self, stages, options, language)``)."""

    def __init__(self, stage: str):
        self.stage = stage

    def __enter__(self):
        from triton.backends.nvidia.compiler import CUDABackend

        self.cls, self.orig = CUDABackend, CUDABackend.add_stages
        if self.stage == "cubin":
            return self
        stop_after, orig = self.stage, self.orig

        def add_stages(backend, stages, *args, **kwargs):
            orig(backend, stages, *args, **kwargs)
            names = list(stages)
            if stop_after not in names:
                raise RuntimeError(f"this Triton has no {stop_after!r} stage (it has {names})")
            for name in names[names.index(stop_after) + 1:]:
                stages[name] = _raise_stop

        CUDABackend.add_stages = add_stages
        return self

    def __exit__(self, *exc):
        self.cls.add_stages = self.orig


def _raise_stop(src, metadata):
    raise _Stop


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # workers compile: the kernels must be JITFunctions


def _pool(jobs: int):
    return concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_worker_init)


def compile_all(variants: list[KernelVariant], target: Target, jobs: int, stage: str = "cubin") -> dict[str, str]:
    """Compile each variant for target through ``stage`` in worker processes; key -> error, failures only."""
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix=f"infhip-compile-{target.name}-") as cache, _pool(jobs) as pool:
        for key, err in pool.map(_compile_one, [(v, target, cache, stage) for v in variants], chunksize=2):
            if err:
                errors[key] = err
    return errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infhip.builder.compile_matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--full", default="sm_90", help="targets compiled to cubin (the others through TTGIR)")
    ap.add_argument("--models", default="", help="comma-separated builder/model_configs names (default: all of "
                    "them for --full targets, " + ", ".join(TTGIR_MODELS) + " for the others)")
    ap.add_argument("--all-variants", action="store_true", help="compile every variant, not the covering subset")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: the cores)")
    args = ap.parse_args(argv)
    names = [t for t in args.targets.split(",") if t]
    models = tuple(m for m in args.models.split(",") if m)
    full = [t for t in args.full.split(",") if t]
    for bad, what, known in ((set(names) - set(TARGETS), "target", TARGETS),
                             (set(models) - set(MODELS), "model", MODELS)):
        if bad:
            ap.error(f"unknown {what}(s) {sorted(bad)}: the matrix knows {', '.join(known)}")

    import triton
    failed = 0
    for name in names:
        target, t0 = TARGETS[name], time.perf_counter()
        stage = "cubin" if name in full else "ttgir"
        configs = configurations(target, models or (MODELS if stage == "cubin" else TTGIR_MODELS))
        seen = union_variants(target, configs, max(1, args.jobs))
        chosen = sorted(seen, key=lambda v: v.key) if args.all_variants else representatives(seen)
        t_enum = time.perf_counter() - t0
        errors = compile_all(chosen, target, max(1, args.jobs), stage)
        for v in chosen:
            if v.key in errors:
                print(f"FAILED {v.name} for {name} under Triton {triton.__version__}: {errors[v.key]}\n"
                      f"  variant: {v.describe()}\n  launched by: {seen[v]}", flush=True)
        failed += len(errors)
        print(f"{name} (Triton {triton.__version__}, through {stage}): {len(chosen) - len(errors)} of {len(chosen)} "
              f"variants compiled, covering {len(seen)} from {len(configs)} engine configurations "
              f"({t_enum:.0f} s enumerating, {time.perf_counter() - t0 - t_enum:.0f} s compiling)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
