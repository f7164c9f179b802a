"""Registers, spills and shared memory of the kernels an engine configuration launches, for a GPU
target, on a machine without a GPU: the builder's enumeration (builder/compile_matrix.py's
configurations) compiled to PTX, then ``ptxas -v`` (Triton's own ptxas) for the target.

Why: a kernel that spills registers to local memory runs far below its roofline, and the GPU is
rarely here to profile; ptxas says so at compile time. One row per kernel variant, worst first.

    python -m benchmarks.speed.kernel_resources --model qwen3-next-80b-a3b --token-drop --kernels gated_delta
    python -m benchmarks.speed.kernel_resources --model llama-3.1-8b --preset 3k --limit 20
    python -m benchmarks.speed.kernel_resources --smoke          # tiny: one small kernel (CI)

Prints ``kernel  regs  spill_stores  spill_loads  smem  variant`` and, with ``--out``, the rows as
JSON. Exit status 1 when ``--fail-on-spill`` is given and some variant spills.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_STACK = re.compile(r"(\d+) bytes stack frame")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict:
    """{"regs", "stack", "spill_stores", "spill_loads", "smem"} (bytes; smem: static only) from
    ``ptxas -v`` output of one entry function."""
    regs = _REGS.search(log)
    if regs is None:
        raise ValueError(f"ptxas printed no register count; its output was:\n{log[-2000:]}")
    stack, spills = _STACK.search(log), _SPILLS.search(log)
    return {"regs": int(regs.group(1)), "stack": int(stack.group(1)) if stack else 0,
            "spill_stores": int(spills.group(1)) if spills else 0,
            "spill_loads": int(spills.group(2)) if spills else 0, "smem": int(regs.group(2) or 0)}


def ptx_of(variant, target) -> tuple[str, int]:
    """(PTX text, the Triton-launched shared memory in bytes) of one variant compiled for target."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    from infhip.plugins.aot import _unpack

    fn, signature, constexprs, attrs, options = _unpack(variant, target)
    with tempfile.TemporaryDirectory(prefix="infhip-resources-") as cache:
        old = knobs.cache.dir
        knobs.cache.dir = cache
        try:
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target.gpu_target(),
                                    options=options.__dict__)
        finally:
            knobs.cache.dir = old
    return kernel.asm["ptx"], int(kernel.metadata.shared)


def _ptxas_path(capability: int) -> str:
    """The ptxas Triton itself runs for this capability (Triton 3.6: one ptxas; 3.9: a second
    one for sm_90 and newer)."""
    from triton.backends.nvidia import compiler

    try:
        tool = compiler.get_ptxas(capability)
    except TypeError:  # Triton 3.6: get_ptxas() takes no capability
        tool = compiler.get_ptxas()
    return tool.path


def ptxas_report(ptx: str, arch: str) -> dict:
    """``ptxas -v`` of one PTX module for ``arch`` (e.g. sm_90a), parsed."""
    ptxas = _ptxas_path(int(arch[3:5]))
    with tempfile.TemporaryDirectory(prefix="infhip-ptxas-") as d:
        src, out = Path(d) / "k.ptx", Path(d) / "k.cubin"
        src.write_text(ptx)
        done = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(out)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"ptxas failed for {arch}: {done.stderr[-2000:]}")
    return parse_ptxas(done.stdout + done.stderr)


def variants_of(model: str, preset: str, token_drop: bool, target_name: str, kernels: list[str]):
    """The variants one engine configuration launches on the target, filtered by kernel-name parts."""
    from infhip.builder.compile_matrix import TARGETS, union_variants

    target = TARGETS[target_name]
    configs = {f"{model} {preset}": dict(model=model, preset=preset, transforms=["token_drop"] if token_drop else [])}
    seen = union_variants(target, configs, jobs=1, launch_cache=None)
    chosen = [v for v in sorted(seen, key=lambda v: v.key) if not kernels or any(k in v.kernel for k in kernels)]
    return target, chosen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speed.kernel_resources", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b", help="a builder/model_configs name")
    ap.add_argument("--preset", default="dense")
    ap.add_argument("--token-drop", action="store_true")
    ap.add_argument("--target", default="sm_90", help="sm_80, sm_89 or sm_90")
    ap.add_argument("--kernels", default="", help="comma-separated parts of kernel names to keep (default: all)")
    ap.add_argument("--limit", type=int, default=0, help="at most this many variants (0: all)")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    ap.add_argument("--fail-on-spill", action="store_true", help="exit 1 when some variant spills")
    ap.add_argument("--smoke", action="store_true", help="tiny: smollm2-135m's RMS norm kernels only")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.preset, args.kernels, args.limit = "smollm2-135m", "dense", "rms_norm", 1
    os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the kernels as JITFunctions
    target, chosen = variants_of(args.model, args.preset, args.token_drop, args.target,
                                 [k for k in args.kernels.split(",") if k])
    if not chosen:
        print(f"no variant of {args.model} {args.preset} matches --kernels {args.kernels!r}", file=sys.stderr)
        return 2
    chosen = chosen[:args.limit] if args.limit else chosen
    arch = f"{args.target}a" if args.target == "sm_90" else args.target
    rows = []
    for v in chosen:
        ptx, launched_smem = ptx_of(v, target)
        rep = ptxas_report(ptx, arch)
        rows.append(dict(kernel=v.name, **rep, launch_smem=launched_smem, num_warps=v.options[0],
                         num_stages=v.options[1], constants=dict(v.constants)))
    rows.sort(key=lambda r: (-(r["spill_stores"] + r["spill_loads"]), -r["regs"]))
    print(f"{'kernel':36s} {'regs':>5s} {'stack':>6s} {'spill st':>9s} {'spill ld':>9s} {'smem':>7s}  warps/stages  constants")
    for r in rows:
        consts = ", ".join(f"{k}={val}" for k, val in r["constants"].items())
        print(f"{r['kernel'][:36]:36s} {r['regs']:5d} {r['stack']:6d} {r['spill_stores']:9d} {r['spill_loads']:9d} "
              f"{r['launch_smem']:7d}  {r['num_warps']}/{r['num_stages']}  {consts[:120]}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    spilled = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    print(f"{len(rows)} variants for {args.target}, {len(spilled)} spill")
    return 1 if args.fail_on_spill and spilled else 0


if __name__ == "__main__":
    sys.exit(main())
