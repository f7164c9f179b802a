"""InfiniteHiP (paper 000): the attention backend of "infinitehip" layers.

* planner.py — the host plan of one step (which rows go sparse, which pruning stages they
  recompute), its device view SparseStep and the CUDA-graph keys; the rules it shares with its
  kernels' AOT enumeration live in infhip/methods/infinitehip/rules.py;
* mask_cache.py — the refresh schedule, mask-cache slots and the per-layer cached stage outputs;
* layer.py — the run side of one layer (pruning stages, key bank, block-sparse attention);
* backend.py — the backend (runtime/attention/backend.py's contract), registered on import.
"""

from .backend import InfiniteHipBackend
from .layer import InfiniteHipLayer
from .planner import SparseGraphKey, SparsePlanner, SparseStep, SparseStepHost

__all__ = ["InfiniteHipBackend", "InfiniteHipLayer", "SparseGraphKey", "SparsePlanner", "SparseStep",
           "SparseStepHost"]
