"""Serving an engine's ahead-of-time kernels: Triton loads them, never compiles them.

An engine built for a GPU holds every kernel variant its plan can launch in ``kernels/``
(builder/kernels.py), in Triton's own cache layout: one folder per Triton hash with the cubin,
its metadata and Triton's group file. Loading an engine (:func:`open_store`) checks the index
(target, Triton version, every file's sha256) and registers the folder with a Triton cache
manager (:class:`EngineKernelCache`), so a launch that Triton has not seen in this process looks
its binary up in the engine first: the compile step finds it there and only loads it. Nothing
is read from or written to ``~/.triton`` for those kernels.

Triton launches through one small C launcher per kernel *signature* (host code, gcc, about 0.5 s
each to build). An engine built on a GPU of its target holds them too (for the builder's Python
version); otherwise they are built on first use into Triton's cache dir (``TRITON_CACHE_DIR`` or
``~/.triton/cache``), or into a private temporary folder when that is not writable
(plugins/_triton_utils.py arranges that when the plugins are imported).

JIT policy (``LLM(jit=...)`` or ``INFHIP_JIT``): before any compile Triton calls our hook with the
variant it is about to compile (plugins/aot.py's KernelVariant). Inside an engine's load and
steps (:func:`serving`), a variant the engine does not hold is
  - ``"forbid"``: refused — :class:`JitForbidden` names the kernel and its specialization;
  - ``"warn"`` (default): compiled, logged once per kernel;
  - ``"allow"``: compiled silently (also lets an engine run on a GPU other than its target).

Load-time options (:func:`compile_at_load`): a load that changes the engine's plan (a method's
runtime knobs, a step transform turned on: ``LLM(engine, token_drop=True)``) may launch variants
the builder never enumerated. The load enumerates its plan as the builder does
(plugins/aot_engine.py, builder/kernels.py's too) and compares it with the index: what is
missing is compiled then, before the first request, with one line naming the kernels
(``"forbid"``: refused at load instead), so nothing compiles while serving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import threading
import types
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from infhip.config import EngineFormatError
from infhip.plugins.aot import KernelVariant

log = logging.getLogger("infhip.kernels")

JIT_MODES = ("forbid", "warn", "allow")


class JitForbidden(RuntimeError):
    """A kernel would compile while serving, and the engine was loaded with jit="forbid"."""


@dataclass
class KernelStore:
    """One engine's kernels/ folder, verified."""

    root: Path
    target: str
    triton_version: str
    mode: str
    variants: set[str] = field(default_factory=set)  # KernelVariant.key
    hashes: set[str] = field(default_factory=set)  # folder names (Triton's base32 hashes)
    num_sms: int | None = None  # the index's: the SM count the variants were enumerated for
    num_files: int = 0
    num_bytes: int = 0
    load_seconds: float = 0.0


_stores: list[KernelStore] = []  # the stores of live engines (usually one)
_lock = threading.Lock()
_warned: set[str] = set()


def jit_mode(value: str | None) -> str:
    """The JIT policy: the argument, else $INFHIP_JIT, else "warn"."""
    mode = value if value is not None else os.environ.get("INFHIP_JIT", "warn")
    if mode not in JIT_MODES:
        raise ValueError(f"jit must be one of {', '.join(JIT_MODES)}, got {mode!r}")
    return mode


def open_store(engine_dir: Path, target: str, mode: str, owner: object, num_sms: int | None = None) -> KernelStore | None:
    """Verify ``engine_dir/kernels`` and serve it to Triton for as long as ``owner`` lives.
    ``num_sms``: the GPU's (launchers size split-K grids by it, so it is part of the target).
    None for CPU engines (no compiled kernels: torch and the interpreter run there)."""
    import time

    import triton

    if target == "cpu":
        return None
    t0 = time.perf_counter()
    root = engine_dir / "kernels"
    index_path = root / "index.json"
    rebuild = "rebuild the engine with this infhip and Triton: infhip-build ... --device cuda --force"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as e:
        raise EngineFormatError(f"{index_path} cannot be read ({e}); {rebuild}") from None
    entries = index.get("kernels", [])
    if not entries or "format" not in index:
        if mode == "forbid":
            raise EngineFormatError(f"{engine_dir} holds no compiled kernels (built before AOT kernels existed), "
                                    f"and jit='forbid' refuses to compile them here; {rebuild}")
        log.warning("%s holds no compiled kernels: they compile on first use (%s)", engine_dir, rebuild)
        return None
    if index["target"] != target:
        raise EngineFormatError(f"{index_path} is for {index['target']} but config.json says {target}; {rebuild}")
    if index["triton"] != triton.__version__ and mode != "allow":
        raise EngineFormatError(f"the engine's kernels were compiled by Triton {index['triton']} but this is "
                                f"Triton {triton.__version__}; {rebuild} (or load with jit='allow' to compile here)")
    if num_sms is not None and index.get("num_sms") != num_sms and mode != "allow":
        raise EngineFormatError(f"the engine's kernels were enumerated for a {index.get('num_sms')}-SM {target}, this "
                                f"GPU has {num_sms} SMs; {rebuild} (or load with jit='allow')")
    store = KernelStore(root=root, target=index["target"], triton_version=index["triton"], mode=mode,
                        num_sms=index.get("num_sms"))
    files = [(rel, meta) for entry in entries for rel, meta in entry["files"].items()]
    files += list(index.get("launchers", {}).items())
    for rel, meta in files:
        path = root / rel
        try:
            data = path.read_bytes()
        except OSError:
            raise EngineFormatError(f"kernel file {path} is missing; {rebuild}") from None
        if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
            raise EngineFormatError(f"kernel file {path} is corrupt (sha256 mismatch); {rebuild}")
        store.num_files += 1
        store.num_bytes += len(data)
        store.hashes.add(rel.split("/", 1)[0])
    store.variants = {entry["variant"] for entry in entries}
    store.load_seconds = time.perf_counter() - t0
    _install()
    with _lock:
        _stores.append(store)
    weakref.finalize(owner, _release, store)
    return store


def _release(store: KernelStore) -> None:
    with _lock:
        if store in _stores:
            _stores.remove(store)


_serving = threading.local()  # .store: the engine whose step (or load) this thread is running


@contextlib.contextmanager
def serving(store: KernelStore | None):
    """Launches in this block are the engine's: the store's JIT policy applies to them. (Kernels
    a test or a benchmark launches directly, outside any engine, compile as Triton always does.)"""
    outer = getattr(_serving, "store", None)
    _serving.store = store
    try:
        yield
    finally:
        _serving.store = outer


# -- load-time options -----------------------------------------------------------------------

def enumeration_config(config):
    """The EngineConfig the builder enumerates for a loaded engine's config: a tensor-parallel
    rank's (its shard's shapes, already local in a loaded config) with tp=1, as
    builder/build.py's _write_kernels hands it to compile_kernels."""
    if config.build.tp > 1:
        return dataclasses.replace(config, build=dataclasses.replace(config.build, tp=1))
    return config


def load_time_variants(store: KernelStore, config) -> dict[KernelVariant, tuple]:
    """variant -> what triton.compile needs, for every variant the loaded ``config``'s plan can
    launch (the builder's enumeration: every plugin's aot_launches on the load's plan, all
    of its methods' knobs) that the engine's index lacks."""
    from infhip.plugins.aot import Target
    from infhip.plugins.aot_engine import enumerate_variants

    target = Target(store.target, store.num_sms) if store.num_sms else Target(store.target)
    variants = enumerate_variants(enumeration_config(config), target)
    return {v: packed for v, packed in variants.items() if v.key not in store.variants}


def compile_at_load(store: KernelStore | None, config, built_plan) -> list[KernelVariant]:
    """Before serving a load whose plan differs from the engine's (``built_plan``): compile the
    variants the load's plan needs and the engine lacks (load_time_variants) into Triton's
    cache, with one line naming them, and count them as the engine's; JitForbidden under
    jit="forbid" (before anything runs). Returns the variants compiled (sorted by key)."""
    if store is None or config.plan == built_plan:
        return []
    missing = sorted(load_time_variants(store, config), key=lambda v: v.key)
    if not missing:
        return []
    names = ", ".join(sorted({v.name for v in missing}))
    if store.mode == "forbid":
        raise JitForbidden(f"this load's options need {len(missing)} kernel variant(s) the engine was not built "
                           f"with ({names}); jit='forbid' refuses to compile them: rebuild the engine with these "
                           "options (infhip-build ...), or load with jit='warn'")
    if store.mode == "warn":
        log.warning("compiling %d kernel variant(s) at load for this load's options (the engine was not built "
                    "with them): %s", len(missing), names)
    _compile_into_triton_cache(missing, store)
    with _lock:
        store.variants |= {v.key for v in missing}
    return missing


def _compile_into_triton_cache(variants: list[KernelVariant], store: KernelStore) -> None:
    """Compile variants for the store's target into Triton's own cache dir, where the first
    launch finds them (EngineKernelCache falls back to it for hashes the engine lacks)."""
    from triton import knobs

    from infhip.plugins.aot import Target
    from infhip.plugins.aot_engine import compile_variants

    target = Target(store.target, store.num_sms) if store.num_sms else Target(store.target)
    compile_variants(variants, target, Path(knobs.cache.dir))


# -- Triton integration ------------------------------------------------------------------------

_installed = False


def _install() -> None:
    """Point Triton's cache manager and pre-compile hook at the stores (once per process)."""
    global _installed
    from triton import knobs

    if _installed:
        return
    knobs.cache.manager_class = EngineKernelCache
    previous = knobs.runtime.jit_cache_hook

    def before_compile(*args, **kwargs):
        _check_variant(kwargs["fn"], kwargs["compile"])
        return previous(*args, **kwargs) if previous is not None else None
    knobs.runtime.jit_cache_hook = before_compile
    _installed = True


def _check_variant(fn_info, compile_args: dict) -> None:
    """Triton is about to compile (it missed its in-process cache): is the variant an engine's?"""
    store = getattr(_serving, "store", None)
    if store is None or store.mode == "allow":
        return
    options = types.SimpleNamespace(**compile_args)
    variant = KernelVariant.from_packed(fn_info.jit_function, compile_args["signature"],
                                        compile_args["constants"], compile_args["configs"][0], options)
    if variant.key in store.variants:
        return
    mode = store.mode
    if mode == "forbid":
        raise JitForbidden(f"kernel not in the engine (jit='forbid' refuses to compile while serving): "
                           f"{variant.describe()}; rebuild the engine with this plan, or load with jit='warn'")
    if variant.kernel not in _warned:
        _warned.add(variant.kernel)
        log.warning("compiling %s while serving: the engine has no binary for %s", variant.name, variant.describe())


class EngineKernelCache:
    """Triton cache manager: a loaded engine's kernels/ first, then Triton's own file cache.

    Triton makes one per cache key (a folder name); reads of a key an engine holds come from the
    engine, everything else (and every write) goes to the file cache."""

    def __init__(self, key, override=False, dump=False):
        self.key, self._override, self._dump, self._file_cache = key, override, dump, None
        with _lock:
            store = next((s for s in _stores if key in s.hashes), None) if not (override or dump) else None
        self._engine_dir = store.root / key if store is not None else None

    @property
    def _files(self):
        """Triton's file cache for this key, made on first use (it creates the key's folder)."""
        if self._file_cache is None:
            from triton.runtime.cache import FileCacheManager
            self._file_cache = FileCacheManager(self.key, override=self._override, dump=self._dump)
        return self._file_cache

    def get_file(self, filename: str) -> str | None:
        if self._engine_dir is not None and (self._engine_dir / filename).is_file():
            return str(self._engine_dir / filename)
        return self._files.get_file(filename)

    def get_group(self, filename: str) -> dict[str, str] | None:
        if self._engine_dir is not None:
            group = self._engine_dir / f"__grp__{filename}"
            if group.is_file():
                children = json.loads(group.read_text())["child_paths"]
                return {name: str(self._engine_dir / Path(path).name) for name, path in children.items()}
        return self._files.get_group(filename)

    def put(self, data, filename: str, binary: bool = True) -> str:
        return self._files.put(data, filename, binary)

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        return self._files.put_group(filename, group)
