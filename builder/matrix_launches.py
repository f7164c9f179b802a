"""Enumerating a compile matrix (builder/compile_matrix.py): every kernel variant its engine
configurations launch, once per launch, recorded across runs.

Enumerating is running every plugin's aot_launches on meta tensors for each configuration:
~1 s of the plugins' own Python per configuration, and each launch then goes through Triton's
binder (what it specializes the arguments to) under plugins/aot.py's recorder. Two savings,
both exact:

* Within a process, a launch whose arguments specialize alike is bound once (a memo keyed by the
  kernel, the target and each argument as Triton's specialization reads it: a tensor's dtype
  and address, a scalar's type and value). Configurations repeat most of their launches.
* The launches themselves (which kernels, with which arguments) are the project's code and do
  not depend on the Triton installed; the variants they bind to do (Triton 3.6 and 3.9 key the
  same launch differently: default num_stages, attributes). The first matrix of a run writes
  each target's distinct launches to .cache/compile-matrix/ under a fingerprint of the sources
  that make them (the package's .py and .json files, torch and Python versions, this format); a
  later matrix with that fingerprint, under any Triton, binds the recorded launches with its own
  Triton instead of running the plugins again. One configuration per target is still enumerated
  from scratch and must give exactly the variants its replayed launches give (else: the
  plugins' run, as without a record).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from pathlib import Path

from infhip.builder.matrix_compile import worker_pool
from infhip.plugins.aot import KernelVariant, Target

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
    from infhip.builder.matrix_configs import engine_config

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
        pool = pool or stack.enter_context(worker_pool(jobs))
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
