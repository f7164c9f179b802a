"""``build_engine``: checkpoint -> engine directory (format v1, infhip/config.py), written atomically.

Phases: resolve the source, read and normalise its config, convert (or generate) the weights,
then write ``rank0.safetensors``, ``config.json``, ``tokenizer/``, ``kernels/index.json`` and
``build_report.json`` into a temporary sibling ``.<name>.tmp-XXXX`` that is renamed into place only
when complete. Any failure (or Ctrl-C) removes the temporary directory; a build killed outright
leaves it behind, and the next build of the same output removes it (a running build holds a lock
in its own, so it is never taken for such a leftover). An existing engine is replaced only with
``force=True``, only after the new one is complete, and only if it is an infhip engine
(``infhip.config.is_engine_dir``); the output may not be, hold or lie inside the checkpoint.

    >>> from infhip.builder import build_engine
    >>> build_engine("smollm2-135m", "engines/smollm2-135m", dtype="float32", device="cpu")  # doctest: +SKIP
    PosixPath('engines/smollm2-135m')
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from infhip import __version__
from infhip.config import DTYPES, KV_DTYPES, WEIGHT_DTYPES, BuildConfig, EngineConfig, EngineFormatError
from infhip.builder import qwen3_next
from infhip.builder.checkpoint import GGUFCheckpoint, HFDirCheckpoint
from infhip.builder.convert import convert_weights, random_weights, unused_tensors, weight_specs
from infhip.errors import BuildError
from infhip.builder.hf_config import model_config_from_hf, with_rope_scaling
from infhip.output_dir import (TMP_LOCK, check_apart, check_output, dir_size, install_dir, lock_tmp,
                                       remove_leftovers, umask)
from infhip.builder.presets import plan_of, preset_names
from infhip.methods import by_keyword, methods
from infhip.builder.registry import ModelSource, resolve_model
from infhip.builder.tokenizer import save_tokenizer

MAX_DEFAULT_SEQ_LEN = 131072


def _resolve_source(source: str | os.PathLike | ModelSource) -> ModelSource:
    """An existing path is a checkpoint; anything else a model name (alias or HF repo id)."""
    if isinstance(source, ModelSource):
        return source
    path = Path(source).expanduser()
    if path.exists():
        return ModelSource(str(source), path)
    return resolve_model(str(source))


def _device_and_target(device: str | None, target: str | None) -> tuple[str, str]:
    """(device the weights are converted on, engine target). A GPU target can be built without
    a GPU (``--target sm_90``): weights convert on the CPU, kernels compile for the target."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise BuildError(f"--device must be cpu or cuda, got {device!r}")
    if target is not None and target != "cpu" and not (target.startswith("sm_") and target[3:].isdigit()):
        raise BuildError(f"--target must be cpu or sm_XY (e.g. sm_90), got {target!r}")
    if device == "cpu":
        return device, target or "cpu"
    if not torch.cuda.is_available():
        raise BuildError("--device cuda asked for, but no CUDA GPU is visible here; use --device cpu, "
                         "or --target sm_90 to build a GPU engine on this machine")
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    have = f"sm_{major}{minor}"
    if target not in (None, have):
        raise BuildError(f"--target {target} differs from this GPU ({have}); build on a {target} GPU, "
                         f"or with --device cpu --target {target}")
    return device, have


def _check_kv_dtype_on_target(kv_dtype: str, target: str) -> None:
    """An fp8 cache is e4m3 (Triton's fp8e4nv), which Triton compiles for sm_89+ only: on an
    A100 every kernel reading the cache would fail to compile (builder/compile_matrix.py)."""
    from infhip.plugins.fp8_linear import FP8_MIN_CAPABILITY

    if kv_dtype == "fp8" and target != "cpu" and int(target[3:]) < FP8_MIN_CAPABILITY:
        raise BuildError(f"--kv-dtype fp8 needs a GPU of sm_{FP8_MIN_CAPABILITY} or newer (Ada, Hopper): Triton has "
                         f"no e4m3 type for {target}; build {target} engines with the default KV dtype")


def _kernel_target(target: str, device: str):
    """The AOT compile target: the GPU's own SM count when building on it, else an H100/H200's."""
    from infhip.plugins.aot import Target

    if device != "cpu":
        return Target(target, torch.cuda.get_device_properties(torch.device(device)).multi_processor_count)
    return Target(target)


def _graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two up to max_batch_size, plus max_batch_size itself."""
    sizes = {1 << k for k in range(max_batch_size.bit_length()) if 1 << k <= max_batch_size}
    return tuple(sorted(sizes | {max_batch_size}))


def build_engine(
    source: str | os.PathLike | ModelSource | None = None,
    output_dir: str | os.PathLike | None = None,
    preset: str = "dense",
    dtype: str = "bfloat16",
    max_seq_len: int | None = None,
    max_batch_size: int = 16,
    device: str | None = None,
    random_weights: bool = False,
    page_size: int = 16,
    max_num_batched_tokens: int | None = None,
    kv_dtype: str | None = None,
    force: bool = False,
    seed: int = 0,
    progress: bool = True,
    *,
    checkpoint: str | os.PathLike | None = None,
    model: str | None = None,
    knobs: dict[str, Any] | None = None,
    target: str | None = None,
    weight_dtype: str = "bf16",
    quantize_lm_head: bool = False,
    tp: int = 1,
    rope_scaling: str | None = None,
    **method_keywords: Any,
) -> Path:
    """Build an engine from ``source`` (a checkpoint path, a model alias or a cached HF repo id;
    or say which with ``checkpoint=PATH`` / ``model=NAME``, as the CLI does) into ``output_dir``
    and return its path. Raises :class:`BuildError` for anything the user can fix.
    ``max_seq_len`` defaults to the model's trained window capped at 131072;
    ``max_num_batched_tokens`` to 32768 on a GPU target (one long-context prefill chunk: the
    InfiniteHiP query-chunk size) and 8192 on the CPU, at least max_batch_size; ``kv_dtype`` to ``dtype``; ``device`` to cuda when a GPU is visible (the target then is its ``sm_XY``), else cpu;
    ``target`` ("sm_90") builds a GPU engine from the CPU. GPU engines get every kernel their
    plan can launch compiled into ``kernels/`` (builder/kernels.py).
    ``preset`` is ``dense`` or a registered backend's preset (builder/presets.py); ``knobs`` maps
    a method's name to its build value (builder/presets.py plan_of): the preset's backend's knob
    changes (e.g. tiny stages for tests), a transform's knobs or True for its defaults. Each
    method's keyword is an alias (``infinitehip_overrides={...}``, ``token_drop=True``:
    infhip/methods/). ``weight_dtype="fp8"`` stores the linear
    layers' weights in float8_e4m3fn with per-output-channel scales (plugins/fp8_linear.py), the
    LM head too with ``quantize_lm_head``; "bf16" (default) keeps them in ``dtype``. ``tp`` > 1
    writes a tensor-parallel engine: the weights cut into ``rank0..rank{tp-1}.safetensors``
    (builder/shard.py), the kernels compiled for one rank's shapes. ``rope_scaling`` ("yarn:4",
    "linear:2") scales RoPE as a model card's long-context recipe does (hf_config.with_rope_scaling)."""
    given = [x for x in (source, checkpoint, model) if x is not None]
    if len(given) != 1 or output_dir is None:
        raise TypeError("build_engine needs output_dir and exactly one of source, checkpoint=, model=")
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    warnings: list[str] = []

    def lap(phase: str, t0: float) -> float:
        now = time.perf_counter()
        timings[phase] = round(now - t0, 3)
        return now

    knobs = {**(knobs or {}), **by_keyword(method_keywords)}
    if method_keywords:
        raise TypeError(f"build_engine() got unexpected keyword(s) {', '.join(sorted(method_keywords))}; the "
                        f"methods' are {', '.join(m.keyword() for m in methods())}")
    if preset not in preset_names():
        raise BuildError(f"unknown preset {preset!r}; available: {', '.join(preset_names())}")
    for flag, value, allowed in (("--dtype", dtype, DTYPES), ("--kv-dtype", kv_dtype or dtype, KV_DTYPES),
                                 ("--weight-dtype", weight_dtype, WEIGHT_DTYPES)):
        if value not in allowed:
            raise BuildError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    for flag, value in (("--max-seq-len", max_seq_len), ("--max-batch-size", max_batch_size),
                        ("--page-size", page_size), ("--max-num-batched-tokens", max_num_batched_tokens)):
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise BuildError(f"{flag} must be a positive integer, got {value!r}")
    device, target = _device_and_target(device, target)
    _check_kv_dtype_on_target(kv_dtype or dtype, target)
    out = Path(output_dir).expanduser()

    t = time.perf_counter()
    if checkpoint is not None:  # a path, never an alias: a typo must say "does not exist"
        src = ModelSource(str(checkpoint), Path(checkpoint).expanduser())
    else:
        src = resolve_model(str(model)) if model is not None else _resolve_source(source)
    check_apart(out, src.path)
    check_output(out, force)
    ckpt = src.open()
    warnings.extend(ckpt.notes)
    t = lap("open_source", t)
    try:
        if not ckpt.has_weights and not random_weights:
            raise BuildError(src.weights_hint or f"{src.path} holds no weights; pass --random-weights "
                             "to build a random-weight engine of its shape")
        where = str(src.path / "config.json") if src.path.is_dir() else str(src.path)
        hf = ckpt.config
        if rope_scaling is not None:
            hf, note = with_rope_scaling(hf, rope_scaling, where)
            warnings.append(note)
        mcfg, inv_freqs = model_config_from_hf(hf, where)
        t = lap("read_config", t)
        _check_tp(mcfg, tp, preset)

        if max_seq_len is None:
            max_seq_len = min(mcfg.max_position_embeddings, MAX_DEFAULT_SEQ_LEN)
        elif max_seq_len > mcfg.max_position_embeddings:
            warnings.append(f"max_seq_len {max_seq_len} exceeds the trained window "
                            f"({mcfg.max_position_embeddings} tokens)")
        try:
            build = BuildConfig(
                dtype=dtype, kv_dtype=kv_dtype or dtype, max_seq_len=max_seq_len,
                max_batch_size=max_batch_size, page_size=page_size,
                max_num_batched_tokens=max_num_batched_tokens or max(8192 if target == "cpu" else 32768, max_batch_size),
                cuda_graph_batch_sizes=_graph_batch_sizes(max_batch_size), target=target,
                created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                random_weights=random_weights, weight_dtype=weight_dtype, quantize_lm_head=quantize_lm_head, tp=tp)
        except ValueError as e:
            raise BuildError(str(e)) from e
        try:
            plan = plan_of(mcfg, preset, knobs)
        except (TypeError, ValueError) as e:
            raise BuildError(str(e)) from e
        qwen3_next.check_build(mcfg, preset, plan, weight_dtype, tp)
        engine = EngineConfig(model=mcfg, plan=plan, build=build, infhip_version=__version__)

        out.parent.mkdir(parents=True, exist_ok=True)
        remove_leftovers(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        lock = None
        try:
            lock = lock_tmp(tmp)
            os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it 0700; the engine is a normal folder
            _write_engine(tmp, engine, ckpt, src, inv_freqs, device, seed, progress, warnings, timings, t)
            timings["total"] = round(time.perf_counter() - t_start, 3)
            _finish_report(tmp, timings)
            os.unlink(tmp / TMP_LOCK)  # not part of the engine; the fd keeps the lock until the end
            install_dir(tmp, out, lambda o: check_output(o, force))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if lock is not None:
                os.close(lock)
    finally:
        ckpt.close()
    return out


def _check_tp(model, tp, preset: str) -> None:
    """--tp must split the heads and the MLP evenly; a sparse preset needs whole kv heads per rank
    (InfiniteHiP's chunk scores take a max over each kv head's query heads:
    docs/design/tensor_parallel.md)."""
    from infhip.tensor_parallel import replicates_kv_heads, tp_problem

    problem = tp_problem(model, tp)
    if problem is not None:
        raise BuildError(problem)
    if preset != "dense" and replicates_kv_heads(model, tp):
        raise BuildError(f"--tp {tp} replicates the model's {model.num_kv_heads} kv heads, which --preset {preset} "
                         f"does not support yet (a kv head's query heads would be scored on different ranks); "
                         f"use --tp {model.num_kv_heads} or less with --preset {preset}, or --preset dense")


def _save_weights(tmp: Path, engine: EngineConfig, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """rank{r}.safetensors for every rank (one file unless tensor-parallel); {file: bytes}."""
    from safetensors.torch import save_file
    from infhip.builder.shard import shard_weights

    tp = engine.build.tp
    parts = [tensors] if tp == 1 else shard_weights(tensors, engine.model, tp)
    sizes = {}
    for rank, part in enumerate(parts):
        path = tmp / f"rank{rank}.safetensors"
        save_file(part, str(path), metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~umask())  # save_file creates it 0600
        sizes[path.name] = path.stat().st_size
    return sizes


def _write_engine(tmp: Path, engine: EngineConfig, ckpt, src: ModelSource, inv_freqs: dict[str, torch.Tensor],
                  device: str, seed: int, progress: bool, warnings: list[str], timings: dict[str, float],
                  t: float) -> None:
    from tqdm.auto import tqdm

    model, build = engine.model, engine.build
    desc = "random weights" if build.random_weights else "converting"
    wrap = lambda specs: tqdm(specs, desc=desc, unit="tensor", disable=not progress)  # noqa: E731
    fp8 = frozenset(engine.fp8_linears())
    if build.random_weights:
        stream = random_weights(model, build.dtype, device=device, seed=seed, wrap=wrap, fp8=fp8)
    else:
        stream = convert_weights(ckpt, model, build.dtype, wrap=wrap, fp8=fp8)
    tensors = dict(stream)
    if not build.random_weights:
        unused = unused_tensors(ckpt, weight_specs(model))
        if unused:
            warnings.append(f"ignored {len(unused)} checkpoint tensor(s) not used by the decoder: "
                            + ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else ""))
    # the model's parameters: not the fp8 scales, nor a quantized tied LM head's own copy
    num_parameters = sum(v.numel() for k, v in tensors.items() if not k.endswith(".weight_scale")
                         and not (k == "lm_head.weight" and model.tie_word_embeddings))
    for layer_type, inv_freq in inv_freqs.items():
        tensors[f"rope.{layer_type}.inv_freq"] = inv_freq
    t_now = time.perf_counter()
    timings["weights"] = round(t_now - t, 3)

    weight_sizes = _save_weights(tmp, engine, tensors)
    del tensors
    engine.save(tmp)
    t = time.perf_counter()
    timings["save"] = round(t - t_now, 3)

    has_tokenizer = False
    try:
        tok = ckpt.load_tokenizer()
        if tok is None:
            warnings.append("no tokenizer in the source: the engine takes and returns token ids only")
        else:
            warnings.extend(save_tokenizer(tok, tmp / "tokenizer"))
            has_tokenizer = True
    except Exception as e:  # a broken tokenizer should not cost the weights; say so loudly
        shutil.rmtree(tmp / "tokenizer", ignore_errors=True)
        warnings.append(f"tokenizer not saved ({type(e).__name__}: {e})")
    timings["tokenizer"] = round(time.perf_counter() - t, 3)

    t = time.perf_counter()
    kernels = _write_kernels(tmp / "kernels", engine, device, progress)
    timings["kernels"] = round(time.perf_counter() - t, 3)

    try:  # what the runtime will do first; fail here rather than there
        reloaded = EngineConfig.load(tmp)
    except EngineFormatError as e:
        raise RuntimeError(f"infhip bug: the engine config does not load back ({e})") from e
    if reloaded != engine:
        raise RuntimeError("infhip bug: config.json does not round-trip to the same EngineConfig")

    kind = ("gguf" if isinstance(ckpt, GGUFCheckpoint) else "hf_dir" if isinstance(ckpt, HFDirCheckpoint)
            else "config")
    report: dict[str, Any] = {
        "infhip_version": __version__,
        "source": {"name": src.name, "path": str(src.path), "kind": kind,
                   "hf_model_type": model.hf_model_type, "random_weights": build.random_weights},
        "architecture": model.architecture,
        "preset": engine.plan.preset,
        "dtype": build.dtype,
        "weight_dtype": build.weight_dtype,
        "target": build.target,
        "num_parameters": num_parameters,
        "tp": build.tp,
        "sizes_bytes": {**weight_sizes,
                        "tokenizer": dir_size(tmp / "tokenizer") if has_tokenizer else 0},
        "kernels": kernels,
        "timings_s": timings,
        "warnings": warnings,
    }
    (tmp / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")


def _write_kernels(folder: Path, engine: EngineConfig, device: str, progress: bool) -> dict:
    """kernels/: every kernel variant of the plan compiled for a GPU target; for the CPU an empty
    index (torch and Triton's interpreter run there, nothing is compiled)."""
    from infhip.builder.kernels import compile_kernels

    if engine.build.target == "cpu":
        folder.mkdir()
        (folder / "index.json").write_text(json.dumps(
            {"format": 1, "target": "cpu", "kernels": [],
             "note": "CPU engine: torch references and Triton's interpreter, nothing compiled"}, indent=2) + "\n")
        return {"count": 0, "bytes": 0, "seconds": 0.0, "target": "cpu"}
    if engine.build.tp > 1:  # every rank launches the same kernels, on its shard's shapes
        from infhip.tensor_parallel import local_model_config, shard_layout
        local = local_model_config(engine.model, shard_layout(engine.model, engine.build.tp)[0])
        engine = dataclasses.replace(engine, model=local, build=dataclasses.replace(engine.build, tp=1))
    try:
        return compile_kernels(engine, _kernel_target(engine.build.target, device), folder, progress=progress)
    except Exception as e:  # a kernel that does not compile for the target is a bug, said plainly
        raise BuildError(f"compiling the engine's kernels for {engine.build.target} failed "
                         f"({type(e).__name__}: {e})") from e


def _finish_report(tmp: Path, timings: dict[str, float]) -> None:
    """Add the total time and size once everything else is written."""
    path = tmp / "build_report.json"
    report = json.loads(path.read_text())
    report["timings_s"] = timings
    report["sizes_bytes"]["total"] = dir_size(tmp)
    path.write_text(json.dumps(report, indent=2) + "\n")
