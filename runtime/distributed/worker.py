"""A tensor-parallel worker (ranks 1..N-1): load its shard, make the same ModelRunner as rank 0,
then run what rank 0 publishes, step by step, until "stop".

Rank 0 owns the scheduler, the KV page allocation, the InfiniteHiP planner and the sampler; a
worker holds only its shard's weights, its own KV pages (the same page ids, its kv heads), its
mask caches, key banks and host pools. Each step rank 0 publishes the runner method and its
host-side plan (runtime/model_runner.py: ``forward_plan(StepPlan)``, ``run_decode_plans([StepPlan])``,
``move_pages(src, dst)`` for KV offloading), and every rank runs it; the collectives inside
keep them in lock-step.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

# What rank 0 may ask of a worker's runner (TPGroup.publish's kinds), besides "stop".
STEP_KINDS = ("forward_plan", "run_decode_plans", "move_pages", "set_backend", "set_transform")


def run_rank(rank: int, tp: int, init_method: str, engine_dir: str, opts, errors, threads: int | None = None) -> None:
    """The whole life of worker `rank` (the target of the spawned process, or a torchrun rank's
    LLM()). errors: rank 0's queue for "ready" and "error" reports (None under torchrun)."""
    from infhip.runtime.distributed.group import join_group
    from infhip.runtime.load import load_rank

    def report(kind: str, text: str = "") -> None:
        if errors is not None:
            errors.put((kind, rank, text))

    try:
        if threads:
            torch.set_num_threads(threads)
        engine = load_rank(engine_dir, opts, rank)
        report("ready")
        group = join_group(rank, tp, init_method, engine.device.type)
        serve(engine, opts, group)
    except BaseException as e:  # noqa: BLE001 - rank 0 learns why; our exit breaks its collectives
        report("error", f"{type(e).__name__}: {e}")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        if errors is not None:
            errors.close()
            errors.join_thread()  # the report reaches rank 0 before the sockets close
        os._exit(1)
    group.end()


def serve(engine, opts, group) -> None:
    """Make the runner (its collectives meet rank 0's), then run published steps until "stop"."""
    from infhip.runtime.distributed.group import attach
    from infhip.runtime.kernel_store import serving
    from infhip.runtime.load import make_runner

    engine.tp = group
    attach(engine.model, group)
    runner = make_runner(engine, opts)[0]
    while True:
        kind, payload = group.receive()
        if kind == "stop":
            return
        if kind not in STEP_KINDS:
            raise RuntimeError(f"tensor-parallel worker got an unknown request {kind!r} from rank 0")
        with serving(engine.kernels):
            getattr(runner, kind)(*payload)
