"""Compile the kernel variants engine configurations launch, for the GPUs users have, on a machine
without a GPU: CI's check that every engine builds for sm_80 / sm_89 / sm_90 under the Triton
installed (tests/run.sh runs it under the newest Triton and the floor, 3.6.0).

What is enumerated: the builder's own enumeration (builder/kernels.py: each plugin's
``aot_launches`` and each backend's ``launch_space``, offloaded KV and every sampling feature
included) for a matrix of engine configurations: the model shapes of builder/model_configs
(GQA ratios, head dims 64-256, sliding layers, biases, q/k norms) crossed with the presets, KV
dtype (bf16, fp8 where the target has e4m3), weight form (bf16, fp8, fp8 LM head), token drop,
a context past the trained window (dynamic RoPE, raw keys, the key bank) and tensor-parallel
shards. ``3k-fast`` and ``3k-flash`` differ from ``3k`` in refresh intervals only, which no
kernel specializes on (tests/test_compile_matrix.py holds that), so ``3k`` stands for them.

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
and checks one configuration per target against a fresh enumeration (see "enumeration" below).

    python -m infhip.builder.compile_matrix                              # CI's matrix
    python -m infhip.builder.compile_matrix --targets sm_90 --full sm_90 --models llama-3.1-8b
    python -m infhip.builder.compile_matrix --all-variants --targets sm_90   # every variant (an hour)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

from infhip.plugins.aot import KernelVariant, Target

CONFIGS = Path(__file__).resolve().parent / "model_configs"

# The GPUs the builder's users have, with their SM counts (split-K grids are sized by them):
# A100 (sm_80), RTX 4090 (sm_89), H100 / H200 (sm_90).
TARGETS = {"sm_80": Target("sm_80", 108), "sm_89": Target("sm_89", 128), "sm_90": Target("sm_90", 132)}
PRESETS = ("dense", "3k", "5k")
MODELS = ("llama-3.1-8b", "gemma-3-12b", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "smollm2-135m",
          "qwen2.5-coder-0.5b", "gemma-3-270m", "llama-3.2-1b", "qwen3-next-80b-a3b")
# The targets compiled through TTGIR take the shapes that differ most (head dims 128 / 256 / 64,
# GQA groups 4 / 2 / 3 / 7, sliding layers, biases): enumerating is half their time.
TTGIR_MODELS = ("llama-3.1-8b", "gemma-3-12b", "smollm2-135m", "qwen2.5-coder-0.5b")
# Constexprs that are sizes even with three values or fewer (the rest: more than three integers).
SIZE_CONSTANTS = ("NUM_SPLITS", "TILES", "ROPE_GROUP", "K", "TP", "PAGE_SIZE")


def engine_config(model: str, kv_dtype: str = "bfloat16", preset: str = "dense", token_drop: bool = False,
                  max_batch_size: int = 16, max_seq_len: int = 131072, weight_dtype: str = "bf16",
                  quantize_lm_head: bool = False, target: str = "sm_90", tp: int = 1):
    """The EngineConfig ``infhip-build`` writes for ``model`` (a builder/model_configs name) on a
    GPU target, without a checkpoint. With ``tp`` > 1 it is one rank's (the shard's shapes), as
    the builder compiles it."""
    from infhip.builder.build import _graph_batch_sizes
    from infhip.builder.hf_config import model_config_from_hf
    from infhip.builder.presets import plan_of
    from infhip.config import BuildConfig, EngineConfig

    mcfg, _ = model_config_from_hf(json.loads((CONFIGS / f"{model}.json").read_text()))
    build = BuildConfig(dtype="bfloat16", kv_dtype=kv_dtype, max_seq_len=min(mcfg.max_position_embeddings, max_seq_len)
                        if preset == "dense" else max_seq_len,
                        max_batch_size=max_batch_size, max_num_batched_tokens=32768,
                        cuda_graph_batch_sizes=_graph_batch_sizes(max_batch_size), target=target,
                        weight_dtype=weight_dtype, quantize_lm_head=quantize_lm_head)
    plan = plan_of(mcfg, preset, {"token_drop": True} if token_drop else None)
    if tp > 1:
        from infhip.tensor_parallel import local_model_config, shard_layout
        mcfg = local_model_config(mcfg, shard_layout(mcfg, tp)[0])
    return EngineConfig(model=mcfg, plan=plan, build=build)


def configurations(target: Target, models: tuple[str, ...] = MODELS) -> dict[str, dict]:
    """name -> engine_config keywords: every preset x KV dtype x weight form on each model, token
    drop, past-the-window contexts and TP shards of 2 and 4 where the heads divide."""
    from infhip.plugins.fp8_linear import FP8_MIN_CAPABILITY

    kv_dtypes = ("bfloat16", "fp8") if target.capability >= FP8_MIN_CAPABILITY else ("bfloat16",)
    out: dict[str, dict] = {}
    for model in models:
        for preset in PRESETS:
            for kv in kv_dtypes:
                for weights in ("bf16", "fp8", "fp8-lm-head"):
                    out[f"{model} {preset} kv={kv} w={weights}"] = dict(
                        model=model, preset=preset, kv_dtype=kv, weight_dtype=weights[:4].rstrip("-"),
                        quantize_lm_head=weights == "fp8-lm-head")
                if preset != "dense":  # past the trained window: dynamic RoPE, raw keys, the rotated key bank
                    out[f"{model} {preset} kv={kv} 1M"] = dict(model=model, preset=preset, kv_dtype=kv,
                                                               max_seq_len=1 << 20)
            out[f"{model} {preset} token-drop"] = dict(model=model, preset=preset, token_drop=True)
        for tp in (2, 4):
            if _heads_divide(model, tp):
                out[f"{model} dense tp={tp}"] = dict(model=model, tp=tp)
                out[f"{model} 3k kv={kv_dtypes[-1]} tp={tp}"] = dict(model=model, preset="3k", kv_dtype=kv_dtypes[-1],
                                                                     tp=tp)
    return {name: kw for name, kw in out.items() if _buildable(kw)}


@functools.lru_cache(maxsize=None)
def _model_config(model: str):
    from infhip.builder.hf_config import model_config_from_hf
    return model_config_from_hf(json.loads((CONFIGS / f"{model}.json").read_text()))[0]


def _buildable(kw: dict) -> bool:
    """Whether infhip-build builds this configuration: a family may refuse some (Qwen3-Next:
    dense, bf16 weights, one rank only; builder/qwen3_next.py)."""
    from infhip.builder.qwen3_next import build_problem

    mcfg = _model_config(kw["model"])
    methods = ("token_drop",) if kw.get("token_drop") else ()
    return build_problem(mcfg, kw.get("preset", "dense"), methods, kw.get("weight_dtype", "bf16"), kw.get("tp", 1)) is None


def _heads_divide(model: str, tp: int) -> bool:
    """Whether the model splits over tp ranks (the builder's rule: it refuses the others)."""
    from infhip.builder.hf_config import model_config_from_hf
    from infhip.tensor_parallel import tp_problem

    mcfg, _ = model_config_from_hf(json.loads((CONFIGS / f"{model}.json").read_text()))
    return tp_problem(mcfg, tp) is None


# -- enumeration -----------------------------------------------------------------------------
#
# Enumerating is running every plugin's aot_launches on meta tensors for each configuration:
# ~1 s of the plugins' own Python per configuration, and each launch then goes through Triton's
# binder (what it specializes the arguments to) under plugins/aot.py's recorder. Two savings,
# both exact:
#
# * Within a process, a launch whose arguments specialize alike is bound once (a memo keyed by the
#   kernel, the target and each argument as Triton's specialization reads it: a tensor's dtype
#   and address, a scalar's type and value). Configurations repeat most of their launches.
# * The launches themselves (which kernels, with which arguments) are the project's code and do
#   not depend on the Triton installed; the variants they bind to do (Triton 3.6 and 3.9 key the
#   same launch differently: default num_stages, attributes). The first matrix of a run writes
#   each target's distinct launches to .cache/compile-matrix/ under a fingerprint of the sources
#   that make them (the package's .py and .json files, torch and Python versions, this format); a
#   later matrix with that fingerprint, under any Triton, binds the recorded launches with its own
#   Triton instead of running the plugins again. One configuration per target is still enumerated
#   from scratch and must give exactly the variants its replayed launches give (else: the
#   plugins' run, as without a record).

LAUNCH_FORMAT = 1
# In a checkout (tests/run.sh, CI): the repository's .cache/ (git-ignored); --launch-cache elsewhere.
_ROOT = Path(__file__).resolve().parent.parent
CACHE = _ROOT / ".cache" / "compile-matrix" if (_ROOT / "pyproject.toml").is_file() else None


class _Opaque(Exception):
    """An argument the launch memo cannot key exactly (the launch is bound as usual, not memoized)."""


def _arg_key(a):
    import torch

    if isinstance(a, torch.Tensor):
        ptr, size = a.data_ptr(), a.element_size()
        if a.device.type != "meta" or ptr % size:
            raise _Opaque
        return ("tensor", str(a.dtype).removeprefix("torch."), ptr)
    if type(a) is float:
        return ("float", repr(a))
    if type(a) in (bool, int, str, type(None)):
        return (type(a).__name__, a)
    raise _Opaque


def _arg_value(key):
    """The argument a key stands for: a meta tensor of the dtype at the address (Triton reads
    nothing else of a tensor when it specializes), or the scalar."""
    import torch

    kind, value = key[0], key[1]
    if kind == "tensor":
        dtype = getattr(torch, value)
        n = key[2] // torch.empty(0, dtype=dtype, device="meta").element_size()
        return torch.empty(n + 1, dtype=dtype, device="meta")[n:]
    return float(value) if kind == "float" else value


def launch_key(fn, args, kwargs) -> tuple:
    """What of a launch Triton's binder reads: the kernel, each argument's key (raises _Opaque)."""
    from infhip.plugins.aot import kernel_name

    return (kernel_name(fn), tuple(_arg_key(a) for a in args), tuple((k, _arg_key(v)) for k, v in kwargs.items()))


def replay(key: tuple):
    """(fn, args, kwargs) of a launch key, to launch again under a recorder."""
    from infhip.plugins.aot import resolve_kernel

    name, args, kwargs = key
    return resolve_kernel(name), [_arg_value(a) for a in args], {k: _arg_value(v) for k, v in kwargs}


class _memo_launches:
    """Within: each Recorder binds a launch key once per process and target (a module-level memo,
    kept across configurations); the keys each recorder saw are in ``log`` (None: a launch the
    memo could not key, so the configuration cannot be replayed)."""

    memo: dict = {}

    def __enter__(self):
        from infhip.plugins.aot import Recorder

        self.orig, self.log, memo, orig = Recorder.observe, [], self.memo, Recorder.observe
        log = self.log

        def observe(rec, fn, args, kwargs):
            try:
                key = launch_key(fn, args, kwargs)
            except _Opaque:
                log.append(None)
                return orig(rec, fn, args, kwargs)
            hit = memo.get((rec.target, key))
            if hit is None:
                variant = orig(rec, fn, args, kwargs)
                memo[(rec.target, key)] = hit = (variant, rec.packed[variant])
            rec.packed.setdefault(*hit)
            log.append(key)
            return hit[0]

        Recorder.observe = observe
        return self

    def __exit__(self, *exc):
        from infhip.plugins.aot import Recorder

        Recorder.observe = self.orig


def _enumerate_chunk(args: tuple) -> list[tuple[str, list, list[KernelVariant]]]:
    """Per configuration of the chunk: its name, its distinct launch keys (None where one could
    not be keyed) and the variant of each."""
    from infhip.builder.kernels import enumerate_variants

    target, chunk, memo = args[0], args[1], args[2] if len(args) > 2 else True
    out = []
    for name, kw in chunk:
        config = engine_config(**kw, target=target.name)
        if not memo:
            out.append((name, [None], list(enumerate_variants(config, target))))
            continue
        with _memo_launches() as m:
            variants = enumerate_variants(config, target)
        keys = list(dict.fromkeys(m.log))
        table = _memo_launches.memo
        out.append((name, keys, [table[(target, k)][0] if k is not None else None for k in keys]))
        if None in keys:  # not keyable: its variants as recorded
            out[-1] = (name, [None], list(variants))
    return out


def _replay_chunk(args: tuple) -> list[KernelVariant]:
    """The variant each launch key binds to on target under this process's Triton."""
    from infhip.plugins.aot import record

    target, keys = args
    out = []
    with record(target, launch=False) as rec:
        for key in keys:
            fn, a, kw = replay(key)
            out.append(rec.observe(fn, a, kw))
    return out


@functools.lru_cache(maxsize=None)
def fingerprint() -> str:
    """Of everything the launches of a configuration are made from except Triton: the package's
    sources and data (.py / .json under its folders), torch's and Python's versions, this format."""
    import hashlib
    import importlib.util

    import torch

    h = hashlib.sha256(f"{LAUNCH_FORMAT} {torch.__version__} {sys.version_info[:3]}".encode())
    for pkg in ("infhip", "infhip.builder", "infhip.plugins", "infhip.runtime"):  # found, not imported
        root = Path(importlib.util.find_spec(pkg).origin).resolve().parent
        for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".json") and "__pycache__" not in p.parts):
            h.update(f"{pkg}/{f.relative_to(root).as_posix()}\0".encode() + f.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def _record_path(target: Target, fp: str, cache: Path) -> Path:
    return Path(cache) / f"launches-{target.name}-{target.num_sms}-{fp}.json"


def _load_record(target: Target, configs: dict[str, dict], fp: str, cache: Path) -> dict | None:
    path = _record_path(target, fp, cache)
    try:
        rec = json.loads(path.read_text())
        rec["launches"] = {n: [_tuples(k) for k in keys] for n, keys in rec["launches"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if rec.get("fingerprint") != fp or any(rec["configs"].get(n) != kw or None in rec["launches"].get(n, [None])
                                           for n, kw in configs.items()):
        return None
    return rec


def _tuples(x):
    """A launch key read back from JSON: its lists as the tuples it was made of (keys are hashed)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _save_record(target: Target, configs: dict[str, dict], launches: dict[str, list], fp: str, cache: Path) -> None:
    if any(None in launches[n] for n in configs):
        return
    path = _record_path(target, fp, cache)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fingerprint": fp, "configs": configs, "launches": launches}))
        tmp.replace(path)
        for old in path.parent.glob(f"launches-{target.name}-{target.num_sms}-*"):  # other sources' records
            if old != path:
                old.unlink(missing_ok=True)
    except OSError as e:
        print(f"(launches of {target.name} not recorded: {e})", flush=True)


def _chunks(items: list, jobs: int) -> list[list]:
    """Contiguous runs of about equal length."""
    n = len(items)
    return [c for c in (items[i * n // jobs:(i + 1) * n // jobs] for i in range(jobs)) if c]


def _by_model(items: list[tuple[str, dict]]) -> list[list[tuple[str, dict]]]:
    """One task per model, the most configurations first (a model's configurations share most
    of their launches: one process's memo serves them; the pool hands the tasks out as workers
    free up)."""
    groups: dict[str, list] = {}
    for name, kw in items:
        groups.setdefault(kw["model"], []).append((name, kw))
    return sorted(groups.values(), key=len, reverse=True)


def union_variants(target: Target, configs: dict[str, dict], jobs: int = 1, pool=None, launch_cache: Path | None = None,
                   memo: bool = True) -> dict[KernelVariant, str]:
    """Every variant any configuration launches on ``target`` -> the first configuration (in
    ``configs``' order) that does, enumerated in ``jobs`` processes (or ``pool``'s; ``memo``:
    with the launch memo). With a ``launch_cache`` folder: from the launches a matrix recorded
    for these configurations (the fingerprint's sources unchanged), bound under this Triton,
    where one exists and one configuration enumerated afresh agrees; else enumerated, and the
    launches recorded."""
    with contextlib.ExitStack() as stack:
        pool = pool or stack.enter_context(_pool(jobs))
        fp = fingerprint() if launch_cache else None
        rec = _load_record(target, configs, fp, launch_cache) if launch_cache else None
        if rec is not None:
            seen = _replayed(target, configs, rec, jobs, pool)
            if seen is not None:
                return seen
        items = list(configs.items())
        by_name = {}
        for part in pool.map(_enumerate_chunk, [(target, c, memo) for c in _by_model(items)]):
            by_name.update({name: (keys, variants) for name, keys, variants in part})
        if launch_cache:
            _save_record(target, configs, {n: by_name[n][0] for n in configs}, fp, launch_cache)
    seen: dict[KernelVariant, str] = {}
    for name in configs:
        for v in by_name[name][1]:
            seen.setdefault(v, name)
    return seen


def _replayed(target: Target, configs: dict[str, dict], rec: dict, jobs: int, pool) -> dict[KernelVariant, str] | None:
    """union_variants from recorded launches (None: the check configuration disagreed)."""
    keys = list(dict.fromkeys(k for n in configs for k in rec["launches"][n]))
    check = max(configs, key=lambda n: len(rec["launches"][n]))  # the one with the most launches
    parts = _chunks(keys, jobs)
    fresh = pool.submit(_enumerate_chunk, (target, [(check, configs[check])], False))
    bound = [v for part in pool.map(_replay_chunk, [(target, p) for p in parts]) for v in part]
    variant = dict(zip(keys, bound))
    want = set(fresh.result()[0][2])
    got = {variant[k] for k in rec["launches"][check]}
    if got != want:
        print(f"{target.name}: the recorded launches of {check!r} bind to {len(got)} variants, a fresh enumeration "
              f"gives {len(want)} ({len(got ^ want)} differ): enumerating every configuration again", flush=True)
        return None
    seen: dict[KernelVariant, str] = {}
    for name in configs:
        for k in rec["launches"][name]:
            seen.setdefault(variant[k], name)
    return seen


def _is_size(name: str, values: set[str]) -> bool:
    ints = all(v.lstrip("-").isdigit() for v in values)
    return ints and (name.startswith("BLOCK") or name in SIZE_CONSTANTS or len(values) > 3)


def representatives(variants) -> list[KernelVariant]:
    """A covering subset of ``variants`` (module docstring): per kernel, greedily, until every
    constexpr value and every pair of code-path settings that occurs is in a chosen variant."""
    by_kernel: dict[str, list[KernelVariant]] = {}
    for v in sorted(variants, key=lambda v: v.key):
        by_kernel.setdefault(v.kernel, []).append(v)
    chosen: list[KernelVariant] = []
    for group in by_kernel.values():
        values: dict[str, set[str]] = {}
        for v in group:
            for name, value in v.constants:
                values.setdefault(name, set()).add(value)
        sizes = {n for n, vals in values.items() if _is_size(n, vals)}

        def facts(v: KernelVariant) -> set:
            path = sorted([c for c in v.constants if c[0] not in sizes]
                          + [s for s in v.signature if s[1].startswith("*")] + [("options", repr(v.options))])
            return set(v.constants) | set(itertools.combinations(path, 2)) | {(p,) for p in path}

        todo = {v: facts(v) for v in group}
        missing = set().union(*todo.values())
        while missing:
            best = max(todo, key=lambda v: len(todo[v] & missing))  # ties: the first in key order
            missing -= todo.pop(best)
            chosen.append(best)
    return chosen


class _Stop(Exception):
    """Raised by the first stage after the one compiled through."""


def _compile_one(args: tuple) -> tuple[str, str | None]:
    """(variant key, None or the error) of one compile in a worker, through ``stage``."""
    from infhip.plugins.aot import compile_variant

    variant, target, cache, stage = args
    try:
        with _through(stage):
            compile_variant(variant, None, target, cache)
    except _Stop:
        pass
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the others
        cause = f" (caused by {type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return variant.key, f"{type(e).__name__}: {' | '.join(lines[-3:])[-500:]}{cause[:300]}"
    return variant.key, None


class _through:
    """Within: triton.compile runs its stages up to and including ``stage`` ("ttgir"), then stops
    (raises _Stop); "cubin" runs them all. Wraps the NVIDIA backend's add_stages (Triton 3.6-3.9:
    ``add_stages(self, stages, options, language)``)."""

    def __init__(self, stage: str):
        self.stage = stage

    def __enter__(self):
        from triton.backends.nvidia.compiler import CUDABackend

        self.cls, self.orig = CUDABackend, CUDABackend.add_stages
        if self.stage == "cubin":
            return self
        stop_after, orig = self.stage, self.orig

        def add_stages(backend, stages, *args, **kwargs):
            orig(backend, stages, *args, **kwargs)
            names = list(stages)
            if stop_after not in names:
                raise RuntimeError(f"this Triton has no {stop_after!r} stage (it has {names})")
            for name in names[names.index(stop_after) + 1:]:
                stages[name] = _raise_stop

        CUDABackend.add_stages = add_stages
        return self

    def __exit__(self, *exc):
        self.cls.add_stages = self.orig


def _raise_stop(src, metadata):
    raise _Stop


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # workers compile: the kernels must be JITFunctions


def _pool(jobs: int):
    return concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_worker_init)


def compile_all(variants: list[KernelVariant], target: Target, jobs: int, stage: str = "cubin",
                pool=None) -> dict[str, str]:
    """Compile each variant for target through ``stage`` in worker processes (``jobs`` new ones,
    or ``pool``'s); key -> error, failures only."""
    errors: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        cache = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"infhip-compile-{target.name}-"))
        pool = pool or stack.enter_context(_pool(jobs))
        for key, err in pool.map(_compile_one, [(v, target, cache, stage) for v in variants], chunksize=2):
            if err:
                errors[key] = err
    return errors


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
    with _pool(jobs) as pool:  # one set of workers for every target (each start imports torch and Triton)
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
