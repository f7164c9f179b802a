"""AOT kernels of an engine: enumerate every Triton kernel variant its plan can launch, compile
each for the engine's GPU target, write ``kernels/`` (Triton's cache layout) and its index.

Enumeration and compiling are plugins/aot_engine.py's (``enumerate_variants``,
``compile_variants``, re-exported here): every plugin's ``aot_launches(space)`` under
plugins/aot.py's recorder, then ``triton.compile`` for the target in worker processes.

kernels/index.json::

    {"format": 1, "target": "sm_90", "num_sms": 132, "triton": "3.6.0",
     "kernels": [{"kernel": "infhip.plugins.rms_norm:_rms_norm_kernel", "variant": "<canonical key>",
                  "hash": "<Triton's hash>", "target": "sm_90", "triton": "3.6.0",
                  "files": {"<DIR>/<name>.cubin": {"sha256": ..., "size": ...}, ...}}, ...]}
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from infhip.plugins.aot import Target, folder_files
# the enumeration and the compile workers live with the plugins: the runtime uses them too
from infhip.plugins.aot_engine import compile_variants, enumerate_variants, plugin_modules  # noqa: F401

INDEX_FORMAT = 1


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
