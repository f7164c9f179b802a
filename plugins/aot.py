"""Ahead-of-time kernels: what a launch specializes to, recording launches, compiling for a target.

Triton compiles one binary per *variant* of a kernel: the argument types, the constexpr values,
the integer arguments it specializes (== 1 becomes a constant, % 16 an alignment hint; pointers
16-byte aligned or not) and the launch options. :class:`KernelVariant` names one variant with a
canonical key that is the same whether it comes from a recorded launch (build time, tests) or
from Triton's pre-compile hook (serve time, runtime/kernel_store.py).

Recording (:func:`record`) intercepts every Triton launch in the process, JIT or interpreted,
and computes the variant the launch would compile for the recorder's target, without a GPU:

    >>> with record(launch=False) as rec:                       # doctest: +SKIP
    ...     rms_norm_triton(fake_x, fake_w, 1e-6)                # meta tensors: nothing runs
    >>> sorted(v.kernel for v in rec.variants)
    ['infhip.plugins.rms_norm:_rms_norm_kernel']

``launch=False`` (the builder's enumeration) skips the kernel; ``launch=True`` (the coverage
tests) records and then runs it as usual. While recording, :func:`recording_target` tells the
dispatch helpers (plugins/_triton_utils.py) to take the Triton launchers on any device and to
size grids for the target's SM count, so a launcher called on meta tensors picks exactly what it
picks on the GPU.

:func:`compile_variant` compiles one recorded variant with ``triton.compile`` into Triton's own
cache layout (``<dir>/<hash>/<kernel>.json + .cubin``), which is what an engine's ``kernels/``
holds and what the runtime's cache manager serves back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

# Launch options that select a binary (the rest of Triton's options are left at their defaults).
_OPTION_NAMES = ("num_warps", "num_stages", "num_ctas")
# The most shared memory one block may take, by compute capability (CUDA programming guide,
# "Technical specifications per compute capability"): a binary over it compiles but never launches.
MAX_SHARED_BYTES = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}


@dataclass(frozen=True)
class Target:
    """A compile target: ``sm_90`` and its SM count (launchers size split-K grids by it)."""

    name: str = "sm_90"
    num_sms: int = 132  # H100 SXM / H200

    @property
    def capability(self) -> int:
        if not self.name.startswith("sm_") or not self.name[3:].isdigit():
            raise ValueError(f"GPU target must look like sm_90, got {self.name!r}")
        return int(self.name[3:])

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", self.capability, 32)


@dataclass(frozen=True)
class KernelVariant:
    """One compiled binary of one kernel: everything Triton keys a compile on, as plain data.

    kernel      "module:qualname" of the @triton.jit function
    signature   per parameter: Triton type ("*bf16", "i32", "constexpr", ...)
    constants   per constexpr (or ==1-specialized) parameter: repr of its value
    attrs       per parameter: alignment attributes, e.g. "tt.divisibility=16"
    options     (num_warps, num_stages, num_ctas)
    """

    kernel: str
    signature: tuple[tuple[str, str], ...]
    constants: tuple[tuple[str, str], ...]
    attrs: tuple[tuple[str, str], ...]
    options: tuple[int, int, int]

    @property
    def key(self) -> str:
        """Canonical text of the variant (the index's lookup key)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

    @property
    def name(self) -> str:
        return self.kernel.rsplit(":", 1)[1]

    def describe(self) -> str:
        """One line for error messages: the kernel and what it was specialized on."""
        consts = ", ".join(f"{k}={v}" for k, v in self.constants)
        attrs = ", ".join(f"{k}:{v}" for k, v in self.attrs if v)
        return (f"{self.kernel} [{consts}] [{attrs}] num_warps={self.options[0]} num_stages={self.options[1]}")

    @classmethod
    def from_packed(cls, fn, signature: dict, constexprs: dict, attrs: dict, options) -> "KernelVariant":
        """From what Triton's JITFunction._pack_args returns (also what its compile hooks see)."""
        names = [p.name for p in fn.params]
        const = tuple(sorted((names[path[0]] if len(path) == 1 else repr(path), _value_repr(v))
                             for path, v in constexprs.items()))
        # every entry, empty ones too: Triton hashes the attrs dict as text
        attr = tuple(sorted((names[path[0]] if len(path) == 1 else repr(path),
                             ",".join(f"{a}={b}" for a, b in vals))
                            for path, vals in attrs.items()))
        return cls(kernel=kernel_name(fn), signature=tuple((k, str(v)) for k, v in signature.items()),
                   constants=const, attrs=attr, options=tuple(int(getattr(options, o)) for o in _OPTION_NAMES))


def _value_repr(v) -> str:
    return repr(getattr(v, "value", v)) if not hasattr(v, "primitive_bitwidth") else str(v)


def kernel_name(fn) -> str:
    """ "module:qualname" of a JITFunction / InterpretedFunction."""
    inner = getattr(fn, "fn", fn)
    return f"{inner.__module__}:{inner.__qualname__}"


def resolve_kernel(name: str):
    """The JITFunction called ``name`` ("module:qualname")."""
    module, qualname = name.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# -- recording ---------------------------------------------------------------------------------

class Recorder:
    """The variants launched while record() is active, with what triton.compile needs for each."""

    @property
    def variants(self) -> set[KernelVariant]:
        return set(self.packed)

    def __init__(self, target: Target, launch: bool):
        self.target, self.launch = target, launch
        self.packed: dict[KernelVariant, tuple] = {}  # variant -> (fn, signature, constexprs, attrs, options)
        self._binders: dict[str, tuple] = {}
        self._backend = None

    def observe(self, fn, args, kwargs) -> KernelVariant:
        """The variant a launch of fn(*args, **kwargs) compiles to on the target."""
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        name = kernel_name(fn)
        if name not in self._binders:
            # an InterpretedFunction keeps @triton.jit's options in .kwargs: the same binder as
            # the compiled kernel's needs its do_not_specialize lists
            opts = {k: v for k, v in getattr(fn, "kwargs", {}).items()
                    if k in ("do_not_specialize", "do_not_specialize_on_alignment")}
            jit = fn if isinstance(fn, JITFunction) else JITFunction(fn.fn, **opts)
            if self._backend is None:
                self._backend = make_backend(self.target.gpu_target())
            self._binders[name] = (jit, create_function_from_signature(jit.signature, jit.params, self._backend))
        jit, binder = self._binders[name]
        bound, specialization, options = binder(*args, **kwargs)
        parsed, signature, constexprs, attrs = jit._pack_args(self._backend, options, bound, specialization,
                                                              self._backend.parse_options(options))
        variant = KernelVariant.from_packed(jit, signature, constexprs, attrs, parsed)
        self.packed.setdefault(variant, (jit, signature, constexprs, attrs, parsed))
        return variant


_active = threading.local()
# Recorders active in any thread: while 0, `use_triton` (plugins/_triton_utils.py) skips the
# per-thread lookup, so AOT recording is off the request path of a serving engine.
ACTIVE = 0
_active_lock = threading.Lock()


def recording_target() -> Target | None:
    """The target of the recorder active in this thread (None when not recording)."""
    rec = getattr(_active, "recorder", None)
    return rec.target if rec is not None else None


@contextlib.contextmanager
def record(target: Target = Target(), launch: bool = False):
    """Record the variant of every Triton launch in this thread (see the module docstring)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if getattr(_active, "recorder", None) is not None:
        raise RuntimeError("record() does not nest")
    rec = Recorder(target, launch)
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def wrap(cls):
        original = originals[cls]

        def run(self, *args, grid, warmup, **kwargs):
            recorder = getattr(_active, "recorder", None)
            if recorder is None:  # another thread
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            recorder.observe(self, args, kwargs)
            if recorder.launch:
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            return None
        return run

    global ACTIVE
    _active.recorder = rec
    with _active_lock:
        ACTIVE += 1
    for cls in originals:
        cls.run = wrap(cls)
    try:
        yield rec
    finally:
        for cls, run in originals.items():
            cls.run = run
        _active.recorder = None
        with _active_lock:
            ACTIVE -= 1


# -- compiling ---------------------------------------------------------------------------------

def compile_variant(variant: KernelVariant, packed: tuple | None, target: Target, cache_dir: str | Path,
                    load: bool = False) -> dict:
    """Compile one variant for ``target`` into ``cache_dir`` (Triton's cache layout: one folder
    per Triton hash, binaries only). Returns its index entry: the variant, Triton's hash and the
    files with their sha256 and size. ``packed`` is what :class:`Recorder` kept for the variant
    (None: re-derived from the variant, for worker processes). ``load`` (on a GPU of the target)
    also loads it, which builds Triton's host-side launcher for its signature into cache_dir."""
    import triton
    from triton.compiler import ASTSource

    fn, signature, constexprs, attrs, options = packed if packed is not None else _unpack(variant, target)
    with _cache_dir(cache_dir):
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target.gpu_target(),
                                options=options.__dict__)
        if load:
            kernel._init_handles()
    limit = MAX_SHARED_BYTES.get(target.capability)
    if limit is not None and kernel.metadata.shared > limit:
        raise ValueError(f"{variant.describe()} needs {kernel.metadata.shared} bytes of shared memory on {target.name}, "
                         f"over the {limit} a block may take there: it would never launch; make its tiles, "
                         "num_stages or num_warps smaller (benchmarks/speed/kernel_resources.py shows each variant's)")
    folder = Path(cache_dir) / Path(next(iter(kernel.metadata_group.values()))).parent.name
    files = folder_files(folder)  # the binaries, the metadata and Triton's group file
    return {"kernel": variant.kernel, "variant": variant.key, "hash": kernel.hash, "target": target.name,
            "triton": triton.__version__, "files": files}


def folder_files(folder: Path) -> dict:
    """{"<folder>/<file>": {"sha256", "size"}} of one cache folder."""
    files = {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != "lock":
            data = p.read_bytes()
            files[f"{folder.name}/{p.name}"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    return files


@contextlib.contextmanager
def _cache_dir(path):
    """Triton's cache dir and binary-only storage for the duration (compiles of this process)."""
    from triton import knobs

    old = (knobs.cache.dir, knobs.compilation.store_binary_only, knobs.cache.manager_class)
    knobs.cache.dir, knobs.compilation.store_binary_only, knobs.cache.manager_class = str(path), True, None
    try:
        yield
    finally:
        knobs.cache.dir, knobs.compilation.store_binary_only, knobs.cache.manager_class = old


def _unpack(variant: KernelVariant, target: Target) -> tuple:
    """(fn, signature, constexprs, attrs, options) of a variant, for triton.compile."""
    import ast

    from triton.compiler import make_backend

    fn = resolve_kernel(variant.kernel)
    index = {p.name: (p.num,) for p in fn.params}
    signature = dict(variant.signature)
    constexprs = {index[k]: _parse_value(v) for k, v in variant.constants}
    texts = dict(variant.attrs)
    attrs = {}  # in parameter order, as Triton's _pack_args makes it (its text is hashed)
    for p in fn.params:
        if p.name in texts:
            text = texts[p.name]
            attrs[index[p.name]] = [[a, ast.literal_eval(b)] for a, b in (x.split("=") for x in text.split(","))] \
                if text else []
    backend = make_backend(target.gpu_target())
    options = backend.parse_options(dict(zip(_OPTION_NAMES, variant.options)))
    return fn, signature, constexprs, attrs, options


def _parse_value(text: str):
    import ast

    import triton.language as tl
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return tl.str_to_ty(text, None) if hasattr(tl, "str_to_ty") else getattr(tl, text)


# -- the launch space an engine's plan allows ----------------------------------------------------

@dataclass(frozen=True)
class LaunchSpace:
    """What a plugin's ``aot_launches(space)`` enumerates over: one engine's model dims, dtypes,
    page size, plan and limits, for one target. Each plugin calls its own launchers on
    :meth:`fake` tensors (meta device: nothing is allocated or run) under :func:`record`, for
    every shape class the runtime can pass it, so the builder compiles exactly what serving
    launches (tests/test_aot_coverage.py checks it against real runs)."""

    config: object  # infhip.config.EngineConfig
    target: Target = Target()

    @property
    def model(self):
        return self.config.model

    @property
    def plan(self):
        return self.config.plan

    @property
    def build(self):
        return self.config.build

    @property
    def act_dtype(self):
        from .dtypes import DTYPES
        return DTYPES[self.build.dtype]

    @property
    def kv_dtype(self):
        """The KV cache's storage dtype (float8_e4m3fn for fp8 engines)."""
        from .dtypes import KV_DTYPES
        return KV_DTYPES[self.build.kv_dtype]

    # -- what the plan's methods declare (infhip/methods/): shared kernels ask these, never a name --
    def methods(self, kind: str | None = None) -> list[tuple[type, object]]:
        """(method, its knobs) of every registered method (of ``kind``) the plan uses."""
        from infhip.methods import methods

        return [(m, knobs) for m in methods(kind) if (knobs := self.plan.knobs_of(m.name)) is not None]

    @property
    def has_backend_layers(self) -> bool:
        """Whether some layer runs a registered attention backend (its steps' dense decode rows may be
        bounded by the block-table width: runtime/cuda_graphs.py step_len_bucket)."""
        from infhip.methods import BACKEND

        return bool(self.methods(BACKEND))

    @property
    def moves_pages(self) -> bool:
        """Whether a load with ``kv_offload_bytes`` may move KV pages to the host: some method of the
        plan says so (``Method.moves_pages``)."""
        return any(m.moves_pages(knobs, self.build) for m, knobs in self.methods())

    @staticmethod
    def fake(*shape: int, dtype) -> "torch.Tensor":  # noqa: F821
        """A tensor of this shape and dtype on the meta device (16-byte aligned like the GPU's)."""
        import torch
        return torch.empty(shape, dtype=dtype, device="meta")
