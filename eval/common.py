"""Shared helpers of the tasks: length lists, engine loading, the no-tokenizer check, and the
benchmark hooks of token drop (a forced retention, the kept positions).

    >>> parse_lengths("1k,2K,3000")
    [1024, 2048, 3000]
    >>> parse_floats("0.1,0.5,0.9", "depths", 0.0, 1.0)
    [0.1, 0.5, 0.9]
"""

from __future__ import annotations

from pathlib import Path


class EvalError(ValueError):
    """Bad input to a task (unknown engine, impossible length, ...): the CLI prints it and exits 2."""


def parse_lengths(spec: str | list[int]) -> list[int]:
    """'1k,2k,16k' (k = 1024) or a list of ints -> positive token counts, in the given order."""
    if isinstance(spec, (list, tuple)):
        values = [int(v) for v in spec]
    else:
        values = []
        for part in str(spec).split(","):
            part = part.strip().lower()
            if not part:
                continue
            try:
                values.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
            except ValueError:
                raise EvalError(f"bad length {part!r}: use integers or e.g. 4k (= 4096)") from None
    if not values or any(v <= 0 for v in values):
        raise EvalError(f"lengths must be positive token counts, got {spec!r}")
    return values


def parse_floats(spec: str | list[float], what: str, lo: float, hi: float) -> list[float]:
    values = [float(v) for v in spec] if isinstance(spec, (list, tuple)) else \
        [float(p) for p in str(spec).split(",") if p.strip()]
    if not values or any(not lo <= v <= hi for v in values):
        raise EvalError(f"{what} must be in [{lo}, {hi}], got {spec!r}")
    return values


def engine_name(engine_dir: str | Path) -> str:
    return Path(engine_dir).resolve().name


def load_llm(engine_dir: str | Path, device: str | None = None, need_tokenizer: bool = True,
             retention: float | None = None, **llm_kwargs):
    """`LLM` for an engine directory, with a clear error when it is missing, does not fit, or has no
    tokenizer. `llm_kwargs` go to `LLM` (max_num_seqs, kv_cache_memory_bytes, ...; None = its
    default); `retention`: set_forced_retention's (benchmarks)."""
    from infhip import LLM

    path = Path(engine_dir)
    if not (path / "config.json").is_file():
        raise EvalError(f"{path} is not an engine directory (no config.json); build one with infhip-build")
    try:
        llm = LLM(path, device=device, **{k: v for k, v in llm_kwargs.items() if v is not None})
    except MemoryError as e:  # e.g. a 32K-window engine on the CPU's default 2 GiB KV budget
        raise EvalError(f"{e} (infhip-eval: --kv-cache-memory-bytes / --max-num-seqs)") from None
    if need_tokenizer and llm.tokenizer is None:
        raise EvalError(f"engine {path} has no tokenizer (random weights?): these tasks need real text")
    if retention is not None:
        set_forced_retention(llm, retention)
    return llm


def set_forced_retention(llm, rho: float | None):
    """Benchmarks: token drop keeps the share ``rho`` of each dropping chunk's blocks at every
    anchor (the highest-scoring ones) instead of top-p; None restores top-p. Not an engine knob:
    it measures cost and quality at a chosen retention (infhip-eval --retention). It installs the
    selection of this runner's token drop transform (TokenDrop.set_selection), nothing on the
    production path; single-rank engines only (the other ranks of a tensor-parallel engine keep
    their own). Returns llm."""
    drop = llm.runner.transforms["token_drop"]
    if rho is None:
        drop.set_selection(None)  # top-p again
        return llm
    if not 0.0 <= rho <= 1.0:
        raise EvalError(f"retention must be in [0, 1], got {rho}")
    if drop.cfg is None:
        raise EvalError("retention needs token drop: build with --token-drop or load with token_drop=True")
    if llm.runner.tp.size > 1:
        raise EvalError("a forced retention needs a single-rank engine (this one is tensor-parallel)")
    drop.set_selection(_ForcedRetention(rho))
    return llm


def forced_retention(llm) -> float | None:
    """The share set_forced_retention forces on llm, None: top-p."""
    forced = llm.runner.transforms["token_drop"].selection
    return forced.rho if isinstance(forced, _ForcedRetention) else None


def record_kept_positions(llm) -> dict:
    """Benchmarks and tests (production keeps no positions): from now on, collect per sequence id
    and full-attention layer the prompt positions each dropping chunk kept there (int64 tensors,
    one per chunk), as the runner's DropRecords records each dropping step (DropRecords.keep_positions).
    Returns the live dict ``{seq_id: {layer: [positions, ...]}}``; a second call on the same
    engine returns the same dict. Single-rank engines (as set_forced_retention)."""
    return llm.runner.transforms["token_drop"].stats.keep_positions()


class _ForcedRetention:
    """A TokenDrop selection (set_selection) keeping the top share ``rho`` of each chunk's blocks
    (p unused)."""

    def __init__(self, rho: float):
        self.rho = rho

    def __repr__(self) -> str:
        return f"forced_retention(rho={self.rho})"

    def __call__(self, scores, cu_blocks, cu_ext, p: float, **kw):
        from infhip.plugins.token_drop import force_retention

        return force_retention(scores, cu_blocks, cu_ext, self.rho, **kw)


def check_fits(llm, length: int, extra: int = 0) -> None:
    limit = llm.engine.config.build.max_seq_len
    if length + extra > limit:
        raise EvalError(f"length {length} (+{extra} generated) exceeds the engine's max_seq_len {limit}; "
                        "rebuild with --max-seq-len")


def engine_info(llm) -> dict:
    """What a result depends on besides the weights: dtype, plan preset, limits (the prefill
    chunk too: token drop's passes are chunks), device."""
    build = llm.engine.config.build
    return {"dtype": build.dtype, "kv_dtype": build.kv_dtype, "preset": llm.engine.config.plan.preset,
            "max_seq_len": build.max_seq_len, "max_num_batched_tokens": llm.scheduler.max_num_batched_tokens,
            "device": str(llm.runner.device),
            "architecture": llm.engine.config.model.architecture,
            **({"forced_retention": rho} if (rho := forced_retention(llm)) is not None else {})}
