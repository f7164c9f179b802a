"""Compiling a compile matrix (builder/compile_matrix.py): the covering subset of the enumerated
variants (:func:`representatives`) and the compiles themselves, through TTGIR or to cubin, in
worker processes (:func:`compile_all`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import multiprocessing
import os
import tempfile

from infhip.plugins.aot import KernelVariant, Target

# Constexprs that are sizes even with three values or fewer (the rest: more than three integers).
SIZE_CONSTANTS = ("NUM_SPLITS", "TILES", "ROPE_GROUP", "K", "TP", "PAGE_SIZE")


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


def worker_pool(jobs: int):
    """Spawned processes that import torch and Triton once, compile without the interpreter."""
    return concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_worker_init)


def compile_all(variants: list[KernelVariant], target: Target, jobs: int, stage: str = "cubin",
                pool=None) -> dict[str, str]:
    """Compile each variant for target through ``stage`` in worker processes (``jobs`` new ones,
    or ``pool``'s); key -> error, failures only."""
    errors: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"infhip-compile-{target.name}-"))
        pool = pool or stack.enter_context(worker_pool(jobs))
        for key, err in pool.map(_compile_one, [(v, target, cache, stage) for v in variants], chunksize=2):
            if err:
                errors[key] = err
    return errors
