"""Rank 0's side of a tensor-parallel engine: start the other ranks, form the group, stop them.

    session = start_ranks(engine_dir, opts)   # None for a one-rank engine; else workers start loading
    engine = load_rank(engine_dir, opts)      # rank 0 loads its own shard meanwhile (runtime/load.py)
    session.join(engine)                      # workers loaded -> process group -> engine.tp
    ...                                       # steps: the runner publishes each plan (TPGroup)
    session.close()                           # LLM.close / interpreter exit: workers stop

Two ways to get the ranks:

* spawn (default): rank 0 is the user's process; it starts ranks 1..N-1 with
  torch.multiprocessing's "spawn" (daemonic: they die with it), each on GPU cuda:rank (or the
  CPU); the group meets through a file store in a temporary folder.
* torchrun (``WORLD_SIZE`` set): every process calls ``LLM(engine)``; rank 0's returns as usual,
  the others serve steps inside it and exit when rank 0 closes (so ``infhip-serve`` and
  ``infhip-run`` run unchanged under ``torchrun --nproc-per-node N``).

Failures: a worker that fails (loading, or in a step) reports why on a queue and exits; rank
0's pending or next collective then fails, and `_failure` turns that into one error naming the
rank and its reason. The engine cannot run steps after that (its ranks' states have diverged):
close it and load it again.
"""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from infhip.config import EngineConfig, EngineFormatError
from infhip.runtime.distributed.group import TPGroup, attach, join_group

# Workers loading their shard (weights, kernels) before the group forms.
START_TIMEOUT_S = float(os.environ.get("INFHIP_TP_START_TIMEOUT_S", "900"))


def _device_type(config: EngineConfig, device) -> str:
    if device is not None:
        return torch.device(device).type
    return "cpu" if config.build.target == "cpu" else "cuda"


def check_resources(config: EngineConfig, device, engine_dir="the engine") -> None:
    """One line (what is wrong, what to do) when the engine's ranks cannot all be placed: fewer
    GPUs than ranks, or a torchrun launch of another size."""
    tp = config.build.tp
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != tp:
        raise EngineFormatError(
            f"{engine_dir} was built for tensor parallelism {tp} but torchrun started "
            f"{os.environ['WORLD_SIZE']} process(es); launch it with torchrun --nproc-per-node {tp}, "
            f"or without torchrun (LLM then starts its {tp - 1} worker(s) itself)")
    if _device_type(config, device) == "cuda" and torch.cuda.device_count() < tp:
        have = torch.cuda.device_count()
        raise EngineFormatError(
            f"{engine_dir} was built for tensor parallelism {tp} ({tp} GPUs) but {have} GPU(s) are "
            f"visible; run it where {tp} GPUs are visible (CUDA_VISIBLE_DEVICES), or rebuild it with "
            f"infhip-build ... --tp {max(1, have)}")


def start_ranks(engine_dir, opts) -> "TPSession | None":
    """The session of a tensor-parallel engine, its workers started (None for tp 1). Under
    torchrun, ranks > 0 serve here and exit when rank 0 closes."""
    config = EngineConfig.load(engine_dir)
    tp = config.build.tp
    if tp == 1:
        return None
    check_resources(config, opts.device, engine_dir)
    import torch.distributed as dist
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel LLM is already open in this process (one process group per "
                           "process); close() it before loading another tensor-parallel engine")
    if "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"])
        if rank > 0:
            from infhip.runtime.distributed.worker import run_rank
            run_rank(rank, tp, "env://", str(engine_dir), opts, None)
            raise SystemExit(0)
        return TPSession(engine_dir, opts, tp, "env://", spawn=False)
    return TPSession(engine_dir, opts, tp)


class TPSession:
    """Rank 0's handle on the other ranks (worker processes) of one loaded engine."""

    def __init__(self, engine_dir, opts, tp: int, init_method: str | None = None, spawn: bool = True):
        import torch.multiprocessing as mp

        self.tp, self.group, self.closed = tp, None, False
        self.device_type = _device_type(EngineConfig.load(engine_dir), opts.device)
        self._tmp = None if init_method else tempfile.mkdtemp(prefix="infhip-tp-")
        self.init_method = init_method or Path(self._tmp, "rendezvous").as_uri()
        self.procs, self.errors = [], None
        if spawn:
            ctx = mp.get_context("spawn")
            _python_for_spawn(ctx)
            self.errors = ctx.Queue()
            from infhip.runtime.distributed.worker import run_rank
            for rank in range(1, tp):
                p = ctx.Process(target=run_rank, name=f"infhip-tp-rank{rank}", daemon=True,
                                args=(rank, tp, self.init_method, str(engine_dir), opts, self.errors,
                                      torch.get_num_threads()))
                p.start()
                self.procs.append(p)
        atexit.register(self.close)

    def join(self, engine) -> TPGroup:
        """Wait until every worker has loaded its shard, form the group, give it to rank 0's
        engine and model. Raises (and stops the workers) if a worker failed or never came."""
        self._wait_ready()
        self.group = join_group(0, self.tp, self.init_method, self.device_type, self._failure,
                                (lambda: any(p.exitcode is not None for p in self.procs)) if self.procs else None)
        engine.tp = self.group
        attach(engine.model, self.group)
        return self.group

    def _wait_ready(self) -> None:
        if self.errors is None:  # torchrun: the ranks meet in init_process_group
            return
        ready, deadline = set(), time.monotonic() + START_TIMEOUT_S
        while len(ready) < self.tp - 1:
            try:
                kind, rank, text = self.errors.get(timeout=0.2)
            except queue.Empty:
                gone = [(r + 1, p.exitcode) for r, p in enumerate(self.procs) if p.exitcode is not None]
                if gone:
                    raise RuntimeError(f"tensor-parallel worker rank {gone[0][0]} exited (code {gone[0][1]}) "
                                       "while loading the engine; its error is printed above")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel workers did not load the engine in {START_TIMEOUT_S:.0f} s "
                                       "(INFHIP_TP_START_TIMEOUT_S)")
                continue
            if kind == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} could not load the engine: {text}")
            ready.add(rank)

    def _failure(self, cause: BaseException) -> BaseException:
        """The error to raise for a failed collective: the worker's own report if one arrives."""
        report = None
        deadline = time.monotonic() + 5.0
        while self.errors is not None and time.monotonic() < deadline:
            try:
                kind, rank, text = self.errors.get(timeout=0.1)
            except queue.Empty:
                if any(p.exitcode is not None for p in self.procs) and time.monotonic() > deadline - 4.0:
                    break
                continue
            if kind == "error":
                report = f"rank {rank} failed: {text}"
                break
        if report is None:
            gone = [f"rank {r + 1} exited with code {p.exitcode}" for r, p in enumerate(self.procs)
                    if p.exitcode is not None]
            report = "; ".join(gone) or f"a collective failed ({type(cause).__name__}: {cause})"
        return RuntimeError(f"tensor parallelism broke down ({report}); this LLM cannot run more steps: "
                            "close it and load the engine again")

    def close(self) -> None:
        """Tell the workers to stop, wait briefly, then end any that remain (and the group)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        stopped = False
        if self.group is not None and self.group.broken is None:
            try:
                self.group.publish("stop")
                stopped = True
            except Exception:  # noqa: BLE001 - a worker already gone: end the rest below
                pass
        for p in self.procs:  # told to stop: they exit at once; else they may sit in a collective
            p.join(timeout=10 if stopped else 0.5)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        if self.group is not None:
            self.group.end()
        if self.errors is not None:
            self.errors.close()
            self.errors.join_thread()
            self.errors = None  # its semaphores are released when it is collected, not at exit
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _python_for_spawn(ctx) -> None:
    """Spawned workers start `sys.executable`; an embedded interpreter (Triton's Python-backend
    stub) reports its host binary there, so point spawn at the environment's python instead.
    (Not exercised by the tests: they run under a plain python.)"""
    exe = Path(sys.executable or "")
    if exe.name.startswith("python"):
        return
    candidate = Path(sys.exec_prefix, "bin", "python3")
    if candidate.is_file():
        ctx.set_executable(str(candidate))
