"""TPGroup: one rank's handle on its tensor-parallel group; the only object that communicates.

Every collective of a TP step goes through it (torch.distributed; NCCL on GPUs, gloo on the
CPU), over two groups:

* ``dev`` — the step's tensors: the all-reduce after o_proj and after down_proj (sum of the
  row-parallel partial outputs), InfiniteHiP's chunk scores (max over every rank's kv heads,
  plugins/infinitehip/pruning.py), token drop's block scores (sum over every rank's query heads,
  infhip/methods/token_drop/runtime/step.py), the tokens sampled between back-to-back decode steps, and the KV page
  count all ranks agree on. Short timeout: a step that waits this long has lost a rank.
* ``ctrl`` — gloo, the step's plan from rank 0 (``publish`` / ``receive``: pickled host data);
  workers wait here between requests, so its timeout is effectively unbounded.

At tensor parallelism 1 (``SINGLE``) every call returns at once and nothing is imported from
torch.distributed: one code path for both.
"""

from __future__ import annotations

import datetime
import os
from typing import Callable

import torch


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1, dev=None, ctrl=None,
                 on_failure: Callable[[BaseException], BaseException] | None = None,
                 workers_gone: Callable[[], bool] | None = None):
        """dev / ctrl: torch.distributed groups (None at size 1); on_failure: turns a failed
        collective into the error to raise (the launcher's: names the rank that died and why);
        workers_gone: rank 0's check that a worker process has exited (spawned workers only)."""
        self.rank, self.size, self.dev, self.ctrl = rank, size, dev, ctrl
        self._on_failure, self._workers_gone = on_failure, workers_gone
        self.broken: BaseException | None = None  # the first failure; every later step raises it

    @property
    def is_driver(self) -> bool:
        """Rank 0: the user's process, owner of the scheduler, the sampler and the logits."""
        return self.rank == 0

    def _fail(self, e: BaseException) -> BaseException:
        if self.broken is None:
            self.broken = self._on_failure(e) if self._on_failure is not None else e
        return self.broken

    def end(self) -> None:
        """Destroy the process groups (every rank, after the "stop" handshake) and drop this
        handle's references to them, so gloo's threads stop here: a group that lives on until
        interpreter teardown can abort the process there ("terminate called without an active
        exception"). Later collectives raise."""
        import gc

        import torch.distributed as dist
        if self.size == 1:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        self.dev = self.ctrl = None
        # A failed collective's traceback holds torch.distributed's frames, whose locals hold a
        # group: keep the message, drop the frames, and collect what they kept alive now.
        e, seen = self.broken, set()
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            e.__traceback__ = None
            e = e.__cause__ or e.__context__
        gc.collect()
        if self.broken is None:
            self.broken = RuntimeError("this tensor-parallel LLM is closed: load the engine again")

    # -- tensors (every rank calls these in the same order) ---------------------------------------
    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """x summed (op "max": maxed) over the ranks, in place; returns x. Identical bits on every rank."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        try:
            dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.dev)
        except Exception as e:  # noqa: BLE001 - a peer died: say which and why
            raise self._fail(e) from e
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(x, "max")

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (in place; same shape and dtype everywhere)."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        try:
            dist.broadcast(x, src=0, group=self.dev)
        except Exception as e:  # noqa: BLE001
            raise self._fail(e) from e
        return x

    def agree_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum over the ranks (e.g. KV pages: every rank must hold the page
        ids rank 0's cache manager hands out)."""
        if self.size == 1 or not values:
            return values
        import torch.distributed as dist
        nccl = dist.get_backend(self.dev) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.int64, device=device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.dev)
        except Exception as e:  # noqa: BLE001
            raise self._fail(e) from e
        return t.tolist()

    def abandon(self, cause: BaseException) -> None:
        """Rank 0's step failed mid-forward: the workers may wait inside a collective of it, which
        the next step's collectives would meet out of order. Every later step raises instead."""
        if self.size > 1 and self.broken is None:
            self.broken = RuntimeError(
                f"a step failed on rank 0 ({type(cause).__name__}: {cause}); the tensor-parallel ranks are out "
                "of step: close this LLM and load the engine again")

    # -- the step's plan (rank 0 -> workers) ------------------------------------------------------
    def publish(self, kind: str, *payload) -> None:
        """Rank 0 hands the workers what to run next (runtime/distributed/worker.py serves it):
        a runner method's name and its arguments (plain host data). No-op elsewhere."""
        if self.size == 1 or not self.is_driver:
            return
        if self.broken is not None:
            raise self.broken
        if self._workers_gone is not None and self._workers_gone():
            # before any collective: a send to a dead peer can wait on the plan channel's
            # unbounded timeout instead of failing
            raise self._fail(RuntimeError("a tensor-parallel worker exited"))
        self._objects([(kind, payload)])

    def receive(self) -> tuple[str, tuple]:
        """A worker's next (kind, payload) from rank 0; blocks until rank 0 publishes."""
        box = [None]
        self._objects(box)
        return box[0]

    def _objects(self, box: list) -> None:
        import torch.distributed as dist
        try:
            dist.broadcast_object_list(box, src=0, group=self.ctrl)
        except Exception as e:  # noqa: BLE001
            raise self._fail(e) from e


SINGLE = TPGroup()  # tensor parallelism 1: every collective is a no-op


def attach(model: torch.nn.Module, group: TPGroup) -> None:
    """Give every module that reduces (attention after o_proj, the MLP after down_proj) the group."""
    for module in model.modules():
        if hasattr(module, "tp"):
            module.tp = group


# The step's collectives: a rank that makes no progress this long is gone (NCCL / gloo timeout).
DEV_TIMEOUT_S = float(os.environ.get("INFHIP_TP_TIMEOUT_S", "600"))
# Workers wait for rank 0's next step here, between requests too: no practical bound.
_CTRL_TIMEOUT = datetime.timedelta(days=3650)


def join_group(rank: int, tp: int, init_method: str, device_type: str, on_failure=None,
               workers_gone=None) -> TPGroup:
    """This process's TPGroup: the default group (gloo, the plan's channel) and a device group
    (NCCL on GPUs, gloo on the CPU) for the step's tensors."""
    import torch.distributed as dist

    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=tp, timeout=_CTRL_TIMEOUT)
    dev = dist.new_group(backend="nccl" if device_type == "cuda" else "gloo",
                         timeout=datetime.timedelta(seconds=DEV_TIMEOUT_S))
    return TPGroup(rank, tp, dev, dist.group.WORLD, on_failure, workers_gone)
