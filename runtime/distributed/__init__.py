"""Tensor parallelism in the runtime (docs/design/tensor_parallel.md): everything that knows
there are several ranks lives here.

* group.py — `TPGroup`: the collectives (all-reduce, broadcast, the step's plan from rank 0);
  `SINGLE` at tensor parallelism 1, where every call is a no-op, so one code path serves both.
* launch.py — rank 0's side: `start_ranks` spawns one worker process per other rank (or joins a
  torchrun launch), `TPSession.join` forms the group, `close` stops the workers; a worker's
  failure comes back to rank 0 as one clear error.
* worker.py — a worker's life: load its shard, make the same ModelRunner as rank 0, then run
  each step's plan that rank 0 publishes until told to stop.

Outside this package: the model blocks call `self.tp.all_reduce` after o_proj and down_proj,
InfiniteHiP's pruning maxes its chunk scores and token drop sums its block scores through the
layer's group, and the runner publishes each step's plan (runtime/model_runner.py).
"""

from infhip.runtime.distributed.group import SINGLE, TPGroup, attach
from infhip.runtime.distributed.launch import TPSession, check_resources, start_ranks

__all__ = ["SINGLE", "TPGroup", "TPSession", "attach", "check_resources", "start_ranks"]
