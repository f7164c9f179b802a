"""AOT kernels of an engine: enumerate every Triton kernel variant its plan can launch, compile
each for the engine's GPU target, write ``kernels/`` (Triton's cache layout) and its index.

Enumeration asks every plugin module that owns kernels for its ``aot_launches(space)``: the
plugin calls its own launchers on fake (meta) tensors for every shape class the runtime passes
it, under plugins/aot.py's recorder, which turns each launch into the variant Triton would
compile. Compiling runs ``triton.compile`` for the target in worker processes (no GPU needed).

kernels/index.json::

    {"format": 1, "target": "sm_90", "num_sms": 132, "triton": "3.6.0",
     "kernels": [{"kernel": "infhip.plugins.rms_norm:_rms_norm_kernel", "variant": "<canonical key>",
                  "hash": "<Triton's hash>", "target": "sm_90", "triton": "3.6.0",
                  "files": {"<DIR>/<name>.cubin": {"sha256": ..., "size": ...}, ...}}, ...]}
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import multiprocessing
import os
import time
from pathlib import Path

from infhip.plugins.aot import KernelVariant, LaunchSpace, Target, compile_variant, folder_files, record

INDEX_FORMAT = 1


def _block_modules() -> tuple[str, ...]:
    """The plugin modules of the model blocks, the dense attention, every registered step transform
    method (token drop) and the sampler (plugins/catalog.py)."""
    from infhip.methods import TRANSFORM, methods
    from infhip.plugins.catalog import DENSE_ATTENTION, MODEL_BLOCKS, SAMPLER

    steps = tuple(m for cls in methods(TRANSFORM) for m in cls.plugin_modules)
    return tuple(dict.fromkeys(MODEL_BLOCKS + DENSE_ATTENTION + steps + SAMPLER))


def _backend_modules() -> tuple[str, ...]:
    """The plugin modules of every registered attention-backend method (infhip/methods/)."""
    from infhip.methods import BACKEND, methods

    return tuple(dict.fromkeys(m for cls in methods(BACKEND) for m in cls.plugin_modules))


def plugin_modules() -> tuple[str, ...]:
    """Every plugin module with Triton kernels (each defines aot_launches(space), which enumerates
    what the engine's plan lets it launch): the model blocks' and every plan method's. Imported
    here, not at module level: compile workers import this module before they drop
    TRITON_INTERPRET, and importing the kernels first would make them interpreted functions."""
    return tuple(dict.fromkeys(_block_modules() + _backend_modules()))


def enumerate_variants(config, target: Target) -> dict[KernelVariant, tuple]:
    """variant -> what triton.compile needs, for every launch the engine's plan allows: the
    blocks' plugins' aot_launches, then each registered backend method's plugins'."""
    space = LaunchSpace(config, target)
    with record(target, launch=False) as rec:
        for name in _block_modules() + _backend_modules():
            launches = getattr(importlib.import_module(f"infhip.plugins.{name}"), "aot_launches", None)
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


def compile_kernels(config, target: Target, kernels_dir: Path, jobs: int | None = None,
                    progress: bool = True) -> dict:
    """Enumerate and compile the engine's kernels into kernels_dir; write index.json. Returns the
    build report's entry: count, bytes, seconds."""
    import triton

    t0 = time.perf_counter()
    variants = sorted(enumerate_variants(config, target), key=lambda v: v.key)
    entries = compile_variants(variants, target, kernels_dir, jobs, progress)
    kernel_dirs = {next(iter(e["files"])).split("/", 1)[0] for e in entries}
    launchers = {}  # Triton's host-side launchers (built when compiling on a GPU of the target)
    for folder in sorted(p for p in kernels_dir.iterdir() if p.is_dir() and p.name not in kernel_dirs):
        launchers.update(folder_files(folder))
    index = {"format": INDEX_FORMAT, "target": target.name, "num_sms": target.num_sms,
             "triton": triton.__version__, "kernels": entries, "launchers": launchers}
    (kernels_dir / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    size = sum(f["size"] for e in entries for f in e["files"].values()) + sum(f["size"] for f in launchers.values())
    return {"count": len(entries), "launchers": len(launchers), "bytes": size, "seconds": round(time.perf_counter() - t0, 2),
            "target": target.name, "triton": triton.__version__}
