"""An engine's whole launch space: every Triton kernel variant its plan can launch (each plugin's
``aot_launches``, on the plan's methods' plugins too) and compiling variants for a GPU target
in worker processes. Shared by the builder (builder/kernels.py: an engine's ``kernels/`` and
its index) and the runtime (runtime/kernel_store.py: the variants a load's options add), which
meet only at the engine format and the plugins (tests/test_import_cycles.py).

Enumeration asks every plugin module that owns kernels for its ``aot_launches(space)``: the
plugin calls its own launchers on fake (meta) tensors for every shape class the runtime passes
it, under plugins/aot.py's recorder, which turns each launch into the variant Triton would
compile. Compiling runs ``triton.compile`` for the target in worker processes (no GPU needed).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import os
from pathlib import Path

from infhip.plugins.aot import KernelVariant, LaunchSpace, Target, compile_variant, record


def _block_modules() -> tuple[str, ...]:
    """The plugin modules of the model blocks, the dense attention, every registered step transform
    method (token drop) and the sampler (plugins/catalog.py), as full module names."""
    from infhip.methods import TRANSFORM, methods
    from infhip.plugins.catalog import DENSE_ATTENTION, MODEL_BLOCKS, SAMPLER

    steps = tuple(m for cls in methods(TRANSFORM) for m in cls.plugin_modules)
    return tuple(dict.fromkeys(_full(MODEL_BLOCKS + DENSE_ATTENTION) + steps + _full(SAMPLER)))


def _backend_modules() -> tuple[str, ...]:
    """The plugin modules of every registered attention-backend method (infhip/methods/), then the
    KV offload's page copies (they ask the plan's methods whether pages move)."""
    from infhip.methods import BACKEND, methods
    from infhip.plugins.catalog import OFFLOAD

    return tuple(dict.fromkeys(tuple(m for cls in methods(BACKEND) for m in cls.plugin_modules) + _full(OFFLOAD)))


def _full(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(f"infhip.plugins.{n}" for n in names)


def plugin_modules() -> tuple[str, ...]:
    """Every module with Triton kernels, by full name (each defines aot_launches(space), which
    enumerates what the engine's plan lets it launch): the model blocks' and every plan method's.
    Imported here, not at module level: compile workers import this module before they drop
    TRITON_INTERPRET, and importing the kernels first would make them interpreted functions."""
    return tuple(dict.fromkeys(_block_modules() + _backend_modules()))


def enumerate_variants(config, target: Target) -> dict[KernelVariant, tuple]:
    """variant -> what triton.compile needs, for every launch the engine's plan allows: the
    blocks' plugins' aot_launches, then each registered backend method's plugins'."""
    space = LaunchSpace(config, target)
    with record(target, launch=False) as rec:
        for name in plugin_modules():
            launches = getattr(importlib.import_module(name), "aot_launches", None)
            if launches is not None:
                launches(space)
    return rec.packed


def _compile_in_worker(args: tuple) -> dict:
    variant, target, out = args
    return compile_variant(variant, None, target, out, load=_can_load(target))


def _can_load(target: Target) -> bool:
    """Whether this machine has a GPU of the target (then the launchers are built too)."""
    import torch
    if not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" == target.name


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # workers compile: the kernels must be JITFunctions


def compile_variants(variants: list[KernelVariant], target: Target, kernels_dir: Path, jobs: int | None = None,
                     progress: bool = False) -> list[dict]:
    """Compile variants into kernels_dir in worker processes (fresh interpreters: a process that
    imported the kernels under TRITON_INTERPRET=1 cannot compile them). Index entries, in order."""
    from tqdm import tqdm

    kernels_dir.mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(variants) or 1))
    entries = []
    bar = tqdm(total=len(variants), desc=f"compiling kernels for {target.name}", unit="kernel",
               disable=not progress)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init) as pool:
        for entry in pool.map(_compile_in_worker, [(v, target, str(kernels_dir)) for v in variants]):
            entries.append(entry)
            bar.update(1)
    bar.close()
    return entries
