"""Compile the kernel variants engine configurations launch, for the GPUs users have, on a machine
without a GPU: CI's check that every engine builds for sm_80 / sm_89 / sm_90 under the Triton
installed (tests/run.sh runs it under the newest Triton and the floor, 3.6.0).

What is enumerated: the builder's own enumeration (builder/kernels.py: each plugin's
``aot_launches``, the registered plan methods' plugins included, offloaded KV and every sampling
feature too) for a matrix of engine configurations (builder/matrix_configs.py): the model shapes
of builder/model_configs crossed with the presets the registered backend methods give the matrix
(a method's ``matrix_presets``: InfiniteHiP's ``3k`` stands for ``3k-fast`` and ``3k-flash``,
which differ in refresh intervals only, which no kernel specializes on:
tests/test_compile_matrix.py holds that), KV dtype, weight form, each registered step transform,
a context past the trained window and tensor-parallel shards. A registered method joins the
matrix; none is named here.

What is compiled: the union is ~2,800 variants per target, ~2.4 s each on a 2-core CI machine:
an hour per target and Triton. :func:`representatives` picks a covering subset per kernel:
every value of every constexpr (a size that fails alone, as ``tl.topk``'s K = 1 did under
Triton 3.6), and every pair of code-path settings (constexpr flags, pointer dtypes, launch
options) that occurs together (most lowering failures need one or two settings). That is ~220
variants. ``--full`` targets compile them to cubin (ptxas included); the others through TTGIR
(the frontend and the target's layout passes, where the arch-dependent type and op checks are;
~6x cheaper). A failure names the kernel, the variant, the target, the Triton version and one
configuration that launches it; the exit status is 1.

Enumerating is ~40 % of a matrix: the plugins' Python on meta tensors, ~1 s per configuration.
Each process binds a distinct launch once, and a matrix records each target's launches in the
checkout's ``.cache/compile-matrix/`` (keyed by a fingerprint of the package's sources): the
launches do not depend on the Triton installed, so tests/run.sh's second matrix (the floor
Triton) binds the recorded launches under its own Triton instead of running the plugins again,
and checks one configuration per target against a fresh enumeration (builder/matrix_launches.py).
The covering subset and the compiles are builder/matrix_compile.py's.

    python -m infhip.builder.compile_matrix                              # CI's matrix
    python -m infhip.builder.compile_matrix --targets sm_90 --full sm_90 --models llama-3.1-8b
    python -m infhip.builder.compile_matrix --all-variants --targets sm_90   # every variant (an hour)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from infhip.builder.matrix_compile import compile_all, representatives, worker_pool
from infhip.builder.matrix_configs import MODELS, TARGETS, TTGIR_MODELS, configurations
from infhip.builder.matrix_launches import CACHE, union_variants


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infhip.builder.compile_matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--full", default="sm_90", help="targets compiled to cubin (the others through TTGIR)")
    ap.add_argument("--models", default="", help="comma-separated builder/model_configs names (default: all of "
                    "them for --full targets, " + ", ".join(TTGIR_MODELS) + " for the others)")
    ap.add_argument("--all-variants", action="store_true", help="compile every variant, not the covering subset")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: the cores)")
    ap.add_argument("--launch-cache", default=str(CACHE or ""), help="folder of the recorded launches (enumeration "
                    "section of the source; default: the checkout's .cache/compile-matrix; '' for none)")
    args = ap.parse_args(argv)
    names = [t for t in args.targets.split(",") if t]
    models = tuple(m for m in args.models.split(",") if m)
    full = [t for t in args.full.split(",") if t]
    for bad, what, known in ((set(names) - set(TARGETS), "target", TARGETS),
                             (set(models) - set(MODELS), "model", MODELS)):
        if bad:
            ap.error(f"unknown {what}(s) {sorted(bad)}: the matrix knows {', '.join(known)}")

    import triton
    failed, jobs = 0, max(1, args.jobs)
    with worker_pool(jobs) as pool:  # one set of workers for every target (each start imports torch and Triton)
        for name in names:
            failed += _one_target(name, name in full, models, args.all_variants, jobs, pool,
                                  Path(args.launch_cache) if args.launch_cache else None)
    return 1 if failed else 0


def _one_target(name: str, full: bool, models: tuple[str, ...], all_variants: bool, jobs: int, pool,
                launch_cache: Path | None) -> int:
    """Enumerate, pick and compile one target's matrix; print what failed; the number of failures."""
    import triton

    target, t0 = TARGETS[name], time.perf_counter()
    stage = "cubin" if full else "ttgir"
    configs = configurations(target, models or (MODELS if stage == "cubin" else TTGIR_MODELS))
    seen = union_variants(target, configs, jobs, pool, launch_cache)
    chosen = sorted(seen, key=lambda v: v.key) if all_variants else representatives(seen)
    t_enum = time.perf_counter() - t0
    errors = compile_all(chosen, target, jobs, stage, pool)
    for v in chosen:
        if v.key in errors:
            print(f"FAILED {v.name} for {name} under Triton {triton.__version__}: {errors[v.key]}\n"
                  f"  variant: {v.describe()}\n  launched by: {seen[v]}", flush=True)
    print(f"{name} (Triton {triton.__version__}, through {stage}): {len(chosen) - len(errors)} of {len(chosen)} "
          f"variants compiled, covering {len(seen)} from {len(configs)} engine configurations "
          f"({t_enum:.0f} s enumerating, {time.perf_counter() - t0 - t_enum:.0f} s compiling)", flush=True)
    return len(errors)


if __name__ == "__main__":
    sys.exit(main())
