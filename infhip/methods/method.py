"""Plan methods: the engine format's side of every attention backend and step transform, and their
registry. Torch-free: the builder and the runtime both import it, neither imports the other.

A method is a class registered under its ``name`` (``@register``), which is its key everywhere:

* ``config.json``: ``plan.knobs[name]`` holds its knobs (absent: no layer runs the backend / the
  transform is off); a backend's layers say ``"backend": name``;
* the builder: a backend's ``presets`` (preset name -> knob changes from ``knobs()``), which layers
  a plan may name it at (``runs``) and a preset gives it (``claims``), the flag ``--<name>-overrides KEY=VALUE,...``; a transform's
  flag ``--<name> [KEY=VALUE,...]``; the modules whose kernels it launches (``plugin_modules``, AOT:
  plugins/aot_engine.py compiles what their ``aot_launches(space)`` enumerate);
* the kernels shared by every method ask it, never its name: whether an engine with its knobs may
  move KV pages to the host (``moves_pages``: the page copies' AOT launches, plugins/kv_offload.py);
  the compile matrix builds its ``matrix_presets`` (builder/compile_matrix.py);
* a load: ``LoadOptions(overrides={name: ...})`` (alias keywords ``<name>_overrides=`` for a
  backend, ``<name>=`` for a transform; the same flags as the build's) changes the knobs its
  ``knobs`` dataclass marks ``runtime`` (:func:`knob`);
* docs/knobs.md: a table per method from the same field metadata (infhip/knobs_doc.py).

The runtime's side of a method (its attention backend or step transform class) registers
separately under the same name (runtime/attention/backend.py, runtime/step_transform.py), in its
``runtime_module``, which those registries import for the built-in methods (:func:`runtime_modules`).
A built-in method is a folder, the same shape for each (infhip/methods/infinitehip/,
infhip/methods/token_drop/): its declaration in ``__init__.py``, ``knobs.py``, its runtime side in
``runtime/``, its kernels under plugins/ (docs/design/adding.md).

    >>> from infhip.methods import method
    >>> method("infinitehip").kind, method("token_drop").kind
    ('backend', 'transform')
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, ClassVar

from infhip.cli_args import parse_knobs
from infhip.registry import Registry

BACKEND, TRANSFORM = "backend", "transform"

# the modules of the built-in methods, each of which registers its method on import
BUILTIN = ("infhip.methods.infinitehip", "infhip.methods.token_drop")


def require(cond: bool, msg: str) -> None:
    """ValueError(msg) unless cond: the engine format's checks (methods' knobs, infhip/config.py)."""
    if not cond:
        raise ValueError(msg)


def knob(default: Any, doc: str, *, runtime: bool = False, measured: str = "") -> Any:
    """A knob field of a method's knobs dataclass. Its metadata is the one description of the knob
    (docs/knobs.md is generated from it: ``python -m infhip.knobs_doc``): ``doc`` its meaning in
    one line; ``runtime`` whether a load may change it or only a rebuild; ``measured`` the
    measurement behind its value, with markdown links relative to docs/ ("not measured" when none
    chose it)."""
    return field(default=default, metadata={"doc": doc, "runtime": runtime, "measured": measured})


NOT_MEASURED = "not measured (paper)"  # a knob taken from the paper, not measured here


class Method:
    """Base class of the registered methods. ``knobs`` is a frozen dataclass whose fields are
    made with :func:`knob`; ``knobs.from_dict(d)`` and ``knobs_instance.replace(**changes)`` are
    used when it defines them (an older engine's names, list values), else the dataclass'
    own constructor and ``dataclasses.replace``."""

    name: ClassVar[str]
    kind: ClassVar[str]  # BACKEND or TRANSFORM
    knobs: ClassVar[type]
    title: ClassVar[str]  # as docs/knobs.md names it ("InfiniteHiP": the section "InfiniteHiP knobs")
    summary: ClassVar[str] = ""  # one line: --help and docs/knobs.md
    knobs_doc: ClassVar[str] = ""  # docs/knobs.md: the paragraph above its knob table
    # the module that registers its runtime side (AttentionBackend / StepTransform of the same name)
    runtime_module: ClassVar[str] = ""
    # modules (full dotted names) whose ``aot_launches(space)`` enumerate the kernels it launches
    plugin_modules: ClassVar[tuple[str, ...]] = ()
    # backends: the presets the compile matrix builds (None: every one); a preset that differs from
    # another only in knobs no kernel specializes on may be left to that one
    matrix_presets: ClassVar[tuple[str, ...] | None] = None
    presets: ClassVar[dict[str, dict[str, Any]]] = {}  # backends: preset -> changes from knobs()
    preset_measured: ClassVar[dict[str, str]] = {}  # docs/knobs.md: the measurement behind a preset
    # how to get an engine that has it (the error of a load that overrides a method the engine lacks)
    build_hint: ClassVar[str] = ""
    # flags it once had -> what to use instead (giving one is a usage error that says so)
    renamed_flags: ClassVar[dict[str, str]] = {}

    # -- names ---------------------------------------------------------------------------------------
    @classmethod
    def keyword(cls) -> str:
        """Its keyword in build_engine, LLM and LoadOptions.of: ``<name>_overrides`` (a backend's
        knobs laid over its preset's) or ``<name>`` (a transform: off / on / knobs)."""
        return f"{cls.name}_overrides" if cls.kind == BACKEND else cls.name

    @classmethod
    def flag(cls) -> str:
        """Its flag in infhip-build, infhip-run, infhip-serve and infhip-eval."""
        return "--" + cls.keyword().replace("_", "-")

    @classmethod
    def load_keys(cls) -> tuple[str, ...]:
        """The knobs a load may change (those made with ``knob(..., runtime=True)``)."""
        return tuple(f.name for f in dataclasses.fields(cls.knobs) if f.metadata.get("runtime"))

    # -- knobs ---------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        """Its knobs as ``config.json`` stores them (``dataclasses.asdict``)."""
        reader = getattr(cls.knobs, "from_dict", None)
        return reader(d) if reader is not None else cls.knobs(**d)

    @classmethod
    def replace(cls, knobs, changes: dict[str, Any]):
        """``knobs`` with ``changes`` laid over them, validated; an unknown name is a ValueError."""
        names = [f.name for f in dataclasses.fields(cls.knobs)]
        if getattr(knobs, "replace", None) is not None:
            return knobs.replace(**changes)
        unknown = sorted(set(changes) - set(names))
        require(not unknown, f"unknown {cls.name} knob(s): {', '.join(unknown)}; known: {', '.join(names)}")
        return dataclasses.replace(knobs, **changes)

    @classmethod
    def parse(cls, text: str) -> dict[str, Any]:
        """``KEY=VALUE,...`` from a command line -> knob changes (values as JSON where they parse,
        else strings); a method with typed parsing (token drop's ``5:8:11``) overrides it."""
        return parse_knobs(text, what=f"{cls.name} knobs")

    @classmethod
    def check(cls, knobs, plan) -> None:
        """ValueError when ``knobs`` cannot apply to ``plan`` (e.g. layers it names that the plan
        lacks); the plan's own checks (which layers a backend runs) come first."""

    @classmethod
    def presets_doc(cls) -> str:
        """docs/knobs.md: what its presets share, in a sentence or two ("" for none)."""
        return ""

    # -- build ---------------------------------------------------------------------------------------
    @classmethod
    def runs(cls, layer) -> bool:
        """Whether a plan may name this backend at LayerPlan ``layer``: full-attention layers by
        default (a sliding layer's window already bounds its work; a linear layer has no keys)."""
        return layer.window is None and layer.attention != "linear"

    @classmethod
    def claims(cls, layer, knobs) -> bool:
        """Whether a preset of this backend, with ``knobs``, gives it ``layer`` (the others stay
        dense): every layer it ``runs`` by default."""
        return cls.runs(layer)

    @classmethod
    def preset_knobs(cls, preset: str, model, changes: dict[str, Any] | None = None):
        """A backend's knobs for preset ``preset`` on ModelConfig ``model``, ``changes`` laid over."""
        return cls.replace(cls.knobs(), {**cls.presets[preset], **(changes or {})})

    @classmethod
    def build_knobs(cls, value):
        """A transform's knobs as given to the build (``--<name> [SPEC]`` / build_engine's keyword):
        None or False = off, True or "" = the defaults, a spec string, a dict of knobs, or knobs."""
        if value is None or value is False:
            return None
        if isinstance(value, cls.knobs):
            return value
        if value is True:
            value = {}
        if isinstance(value, str):
            value = cls.parse(value)
        if not isinstance(value, dict):
            raise TypeError(f"{cls.keyword()} must be None, a bool, a spec string, a dict or a "
                            f"{cls.knobs.__name__}; got {type(value).__name__}")
        return cls.replace(cls.knobs(), value)

    @classmethod
    def moves_pages(cls, knobs, build) -> bool:
        """Whether an engine with these knobs and BuildConfig ``build``, loaded with
        ``kv_offload_bytes``, may move KV pages to the host (its layers read them in place: its
        runtime side's ``offload_window``). The default: never."""
        return False

    # -- load ----------------------------------------------------------------------------------------
    @classmethod
    def check_load_value(cls, value) -> None:
        """ValueError / TypeError for a load override that no engine could take: a backend's is a
        dict of its load knobs; a transform's a bool (off / on) or such a dict."""
        if cls.kind == TRANSFORM and isinstance(value, bool):
            return
        if not isinstance(value, dict):
            form = "a dict of knobs" if cls.kind == BACKEND else "a bool or a dict of knobs"
            raise TypeError(f"{cls.keyword()} must be {form}, got {type(value).__name__}")
        names = [f.name for f in dataclasses.fields(cls.knobs)]
        if any(k not in names for k in value):
            cls.replace(cls.knobs(), value)  # the knobs' own error for an unknown (or renamed) name
        bad = sorted(set(value) - set(cls.load_keys()))
        require(not bad, f"{cls.keyword()} may change {', '.join(cls.load_keys())} only; {', '.join(bad)} "
                f"needs a rebuild (infhip-build ... {cls.flag()} ...)")
        if cls.kind == TRANSFORM:  # a transform's knobs do not depend on the engine: ranges now
            cls.replace(cls.knobs(), value)

    @classmethod
    def at_load(cls, built, value, plan):
        """The knobs a load runs with: ``value`` (check_load_value's forms) over the engine's
        ``built`` knobs (None: the engine lacks the method)."""
        cls.check_load_value(value)
        if cls.kind == TRANSFORM and isinstance(value, bool):
            return (built or cls.knobs()) if value else None
        if built is None and cls.kind == BACKEND:
            raise ValueError(f"{cls.keyword()} given, but this engine has no {cls.name} layers (preset "
                             f"{plan.preset!r}); {cls.build_hint or 'rebuild it with a preset of ' + cls.name}")
        return cls.replace(built if built is not None else cls.knobs(), value)


_REGISTRY = Registry("a plan method", BUILTIN)
register = _REGISTRY.register  # a decorator: the class under its ``name``; the built-in ones come first
unregister = _REGISTRY.unregister  # (tests)


def methods(kind: str | None = None) -> list[type[Method]]:
    """The registered methods (of one kind), in registration order (the built-in ones first)."""
    return [m for m in _REGISTRY.classes() if kind is None or m.kind == kind]


def method(name: str) -> type[Method]:
    """The method registered under ``name``; ValueError names the registered ones."""
    found = _REGISTRY.get(name)
    if found is None:
        raise ValueError(f"no plan method {name!r} is registered (registered: "
                         f"{', '.join(m.name for m in methods())}); import the module that registers it first")
    return found


def runtime_modules(kind: str) -> tuple[str, ...]:
    """The runtime modules of the built-in methods of ``kind``, in BUILTIN's order: what the runtime's
    registries (attention backends, step transforms) import on first use."""
    rank = {module: i for i, module in enumerate(BUILTIN)}
    return tuple(m.runtime_module for m in sorted(methods(kind), key=lambda m: rank.get(m.__module__, len(rank)))
                 if m.__module__ in rank and m.runtime_module)


def presets() -> dict[str, type[Method] | None]:
    """Every preset name -> the backend method it runs (``dense``: None); a name two backends
    declare is an error."""
    table: dict[str, type[Method] | None] = {"dense": None}
    for m in methods(BACKEND):
        for p in m.presets:
            if p in table:
                raise ValueError(f"preset {p!r} is declared by {m.name} and by "
                                 f"{table[p].name if table[p] else 'the dense plan'}")
            table[p] = m
    return table


def renamed_flags() -> dict[str, str]:
    """Every registered method's former flags -> what to use instead (Method.renamed_flags)."""
    return {old: hint for m in methods() for old, hint in m.renamed_flags.items()}


def by_keyword(kwargs: dict[str, Any]) -> dict[str, Any]:
    """{method name: value} of the keyword arguments that name a method (``infinitehip_overrides=``,
    ``token_drop=``: :meth:`Method.keyword`); the others are left in ``kwargs`` (popped)."""
    out = {}
    for m in methods():
        if m.keyword() in kwargs:
            value = kwargs.pop(m.keyword())
            if value is not None:
                out[m.name] = value
    return out
