"""The options of one engine load: :class:`LoadOptions`, the one typed object behind
``LLM(engine_dir, options)`` / ``LLM(engine_dir, **kwargs)`` and the flags of infhip-run,
infhip-serve and infhip-eval (``--max-num-seqs`` is ``max_num_seqs``: same names, dashes for
underscores; :func:`add_load_options` makes the flags from the fields).

    >>> LoadOptions(max_num_seqs=4).max_num_seqs
    4
    >>> parse_size("1.5GiB"), parse_size("512M"), parse_size("4096")
    (1610612736, 536870912, 4096)
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from infhip.cli_args import add_renamed_flag
from infhip.methods import TRANSFORM, by_keyword, method, methods, renamed_flags

JIT_POLICIES = ("forbid", "warn", "allow")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _option(default: Any, doc: str, kind: str, metavar: str | None = None, measured: str = "—") -> Any:
    """A field of LoadOptions; ``kind`` says how its flag reads a value (int, size, flag, ...);
    ``measured``: the measurement behind its default (docs/knobs.md, links relative to docs/)."""
    return field(default=default, metadata={"doc": doc, "kind": kind, "metavar": metavar, "measured": measured})


@dataclass(frozen=True)
class LoadOptions:
    """How to load and serve an engine (the engine itself fixes the model and its plan)."""

    device: str | None = _option(None, "`cpu` / `cuda` (default: the engine's target)", "str", "DEVICE")
    max_num_seqs: int | None = _option(None, "most sequences in one step (default: the engine's max batch size)",
                                       "int", "N")
    max_num_batched_tokens: int | None = _option(
        None, "token budget of one step, i.e. the prefill chunk (default: the engine's)", "int", "N",
        "see the build flag")
    kv_cache_memory_bytes: int | None = _option(
        None, "KV cache size (default on GPU: free memory - (1 - `gpu_memory_utilization`) x total - other buffers (activations, key "
        "bank, raw-keys scratch, staging) - 1 GiB; CPU: 2 GiB)", "size", "SIZE")
    kv_offload_bytes: int = _option(
        0, "pinned host memory for the KV pages of a request between the head and tail tokens that its attention "
        "backend keeps on the GPU, once its context passes the backend's offload window ([design](design/"
        "long_context_memory.md)). Engines whose full-attention layers all run a backend that reads host pages in "
        "place, and no step transform on; 0: off", "size", "SIZE",
        "1M: decode 0.77×, prefill 0.95× of resident ([benchmarks](benchmarks.md#kv-offload-pinned-host-memory))")
    gpu_memory_utilization: float = _option(
        0.9, "share of GPU memory the default KV budget plans for (not read with `kv_cache_memory_bytes`, nor on CPU)", "float",
        "F", "not measured")
    enforce_eager: bool = _option(False, "never use CUDA graphs", "flag")
    num_decode_steps: int | None = _option(
        None, "decode steps run back to back on the device before the host reads tokens, when a step is all "
        "decodes and nobody waits (up to N - 1 tokens past a stop are computed and dropped; default 8 on GPU, "
        "1 on CPU)", "int", "N", "dense batch 1: 217.8 / 218.9 / 222.0 tok/s at 8 / 16 / 32 "
        "([benchmarks](benchmarks.md#decode-dense-engine-vs-transformers))")
    overrides: dict | None = _option(
        None, "plan methods' knobs changed for this load, by method name: a dict of the knobs marked *load* in "
        "docs/knobs.md, laid over the engine's, or for a transform `True` / `False` (on as built or with its "
        "defaults / off). Each method's keyword and flag is an alias ([methods](#plan-methods)): "
        "`<backend>_overrides={...}` / `--<backend>-overrides KEY=VALUE,...`, `<transform>=False` / "
        "`--<transform> off|on|KEY=VALUE,...`", "methods", None)
    prefix_caching: bool = _option(
        True, "reuse the KV pages of a prompt prefix an earlier request computed (whole pages), where reuse is "
        "exact for the plan: every backend's prefix granule, fp8 KV, sliding layers, KV offloaded to host memory "
        "(cached there too); with a step transform on, only prompts it keeps whole (design doc); "
        "`--no-prefix-caching` turns it off", "bool", None,
        "exactness tests only ([design/prefix_caching.md](design/prefix_caching.md))")
    jit: str | None = _option(
        None, "a kernel the engine has no binary for: `forbid` raises, `warn` compiles and logs, `allow` compiles "
        "silently (and runs on a GPU other than the target); default `$INFHIP_JIT`, else `warn`", "choice",
        "|".join(JIT_POLICIES), "[design/aot.md](design/aot.md)")

    # num_decode_steps when none is given, per device type (the GPU's: the measurement above).
    DEFAULT_DECODE_STEPS: ClassVar[dict[str, int]] = {"cuda": 8, "cpu": 1}

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_decode_steps", "kv_cache_memory_bytes"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        if not _is_int(self.kv_offload_bytes) or self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be an integer >= 0, got {self.kv_offload_bytes!r}")
        for name in ("enforce_eager", "prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.device is not None and not isinstance(self.device, str):
            raise ValueError(f"device must be a string (cpu, cuda), got {self.device!r}")
        if self.jit is not None and self.jit not in JIT_POLICIES:
            raise ValueError(f"jit must be one of {', '.join(JIT_POLICIES)}, got {self.jit!r}")
        if self.overrides is not None:
            if not isinstance(self.overrides, dict):
                raise TypeError(f"overrides must be a dict (method name -> its knobs), got "
                                f"{type(self.overrides).__name__}")
            for name, value in self.overrides.items():
                method(name).check_load_value(value)  # type, names a load may change, ranges

    def decode_steps_on(self, device_type: str) -> int:
        """Decode steps run back to back on a device of this type (`num_decode_steps` or the
        device's default)."""
        return self.num_decode_steps or self.DEFAULT_DECODE_STEPS.get(device_type, 1)

    def override(self, name: str):
        """The load's override of method ``name`` (a dict of knobs, or a transform's bool); None:
        as built."""
        return (self.overrides or {}).get(name)

    @classmethod
    def of(cls, options: "LoadOptions | None" = None, **kwargs: Any) -> "LoadOptions":
        """``options`` with ``kwargs`` laid over it (LLM's keyword form); a method's keyword
        (``<backend>_overrides=``, ``<transform>=``: Method.keyword) joins ``overrides``, laid over
        the others'. TypeError names an unknown keyword."""
        if options is not None and not isinstance(options, LoadOptions):
            raise TypeError(f"options must be a LoadOptions, got {type(options).__name__} "
                            "(pass the others by keyword, e.g. device='cuda')")
        by_method = by_keyword(kwargs)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            known = sorted(names | {m.keyword() for m in methods()})
            raise TypeError(f"unknown load option(s) {', '.join(unknown)}; known: {', '.join(known)}")
        if by_method:
            base = kwargs.get("overrides", options.overrides if options is not None else None)
            kwargs["overrides"] = {**(base or {}), **by_method}
        return dataclasses.replace(options, **kwargs) if options is not None else cls(**kwargs)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_size(text: str) -> int:
    """Bytes from '8GiB', '8G', '512MiB', '1.5g', '4096' (binary units K, M, G, T; 'iB' / 'B'
    optional). ValueError for anything else, or a negative size."""
    t = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in "kmgt" else ""
    try:
        value = float(t[:len(t) - len(unit)])
    except ValueError:
        raise ValueError(f"{text!r} is not a size: use bytes or e.g. 8GiB, 512MiB") from None
    if value < 0:
        raise ValueError(f"a size must be >= 0, got {text!r}")
    return int(value * _UNITS[unit])


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_load_options(parser: argparse.ArgumentParser) -> None:
    """A flag per LoadOptions field (its name with dashes), read as strings: load_options()
    converts and validates them, so a bad value is a ValueError the command reports (exit 2)."""
    group = parser.add_argument_group("load options (LLM(...) keywords of the same names)")
    for f in dataclasses.fields(LoadOptions):
        kind, metavar = f.metadata["kind"], f.metadata["metavar"]
        doc = f.metadata["doc"].replace("`", "").replace("%", "%%")  # argparse formats help with %
        if kind == "flag":
            group.add_argument(flag_of(f.name), action="store_true", help=doc)
        elif kind == "bool":  # on by default: --name / --no-name
            group.add_argument(flag_of(f.name), action=argparse.BooleanOptionalAction, default=None, help=doc)
        elif kind == "choice":
            group.add_argument(flag_of(f.name), choices=JIT_POLICIES, default=None, help=doc)
        elif kind == "methods":  # a flag per registered method (its build flag's name)
            for m in methods():
                form = "off|on|KEY=VALUE,..." if m.kind == TRANSFORM else "KEY=VALUE,..."
                group.add_argument(m.flag(), dest="method_" + m.name, default=None, metavar=form,
                                   help=f"{m.name} knobs marked load in docs/knobs.md, changed for this load"
                                   + (" (off / on: as built or the defaults)" if m.kind == TRANSFORM else ""))
        else:
            group.add_argument(flag_of(f.name), default=None, metavar=metavar, help=doc)
    add_renamed_flag(parser, "--kv-offload-gib", "use --kv-offload-bytes SIZE (e.g. 8GiB)")
    add_renamed_flag(parser, "--kv-cache-gib", "use --kv-cache-memory-bytes SIZE (e.g. 16GiB)")
    for old, hint in renamed_flags().items():
        add_renamed_flag(parser, old, hint)


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The LoadOptions of parsed flags (add_load_options); ValueError names the flag at fault."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(LoadOptions):
        if f.metadata["kind"] == "methods":
            try:
                overrides = {m.name: _method_value(m, getattr(args, "method_" + m.name)) for m in methods()
                             if getattr(args, "method_" + m.name, None) is not None}
            except ValueError as e:
                raise ValueError(str(e)) from None
            if overrides:
                values[f.name] = overrides
            continue
        raw, kind = getattr(args, f.name), f.metadata["kind"]
        if raw is None or (raw is False and kind != "bool"):
            continue
        try:
            if kind == "int":
                values[f.name] = int(raw)
            elif kind == "float":
                values[f.name] = float(raw)
            elif kind == "size":
                values[f.name] = parse_size(raw)
            else:
                values[f.name] = raw
        except ValueError as e:
            raise ValueError(f"{flag_of(f.name)}: {e}") from None
    try:
        return LoadOptions(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(str(e)) from None


def _method_value(m, spec: str):
    """A method's load flag: ``off`` / ``on`` for a transform, else its KEY=VALUE,... knobs."""
    if m.kind == TRANSFORM and spec.strip().lower() in ("off", "on"):
        return spec.strip().lower() == "on"
    try:
        return m.parse(spec)
    except ValueError as e:
        raise ValueError(f"{m.flag()}: {e}") from None


__all__ = ["JIT_POLICIES", "LoadOptions", "add_load_options", "flag_of", "load_options", "parse_size"]
