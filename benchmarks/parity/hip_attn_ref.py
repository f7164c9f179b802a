"""The authors' InfiniteHiP mask (hip-attention v1_2, `hip_attn.v1_2.attention_extend.
dual_stage_quadratic_hip_attention`), run from a checkout or an installed package given by path.
Used by benchmarks/parity/infinitehip.py; nothing of theirs is copied here.

What is patched, at run time only (their files are never edited):

* `hip_attn/__init__.py` and `hip_attn/v1_2/__init__.py` are not executed (they import the
  v1_0/v1_1 models, SGLang and CUDA-only offloading); the packages are registered bare and only
  the mask modules are imported.
* Their `triton_jit` decorator (v1_2/triton_jit.py) asserts `triton.__version__ == "3.4.0"` and
  refuses TRITON_INTERPRET; it is replaced by plain `triton.jit` (+ `triton.autotune` over their
  configs; under the interpreter only their config with the largest tiles, since autotuning
  times on CUDA; the landmark scores' 512-query window then ends on 128-key tile edges where a
  GPU run may use 64: `_sw_score_sample` averages over a window that depends on its tile).
* Modules the mask path imports but never calls (cv2, numba, tilelang: debug plots, SM count,
  a TileLang attention backend) get inert stand-ins when they are not installed.
* Their contiguous-key branch of `landmark_sample` stores the landmark scores at the *masked*
  queries' positions (`args.position_ids`), which holds only when every query of the prefill is
  masked; the paged branch stores them at the landmark queries' positions (block_table.gather of
  `position_ids_for_landmark`). We mask only the newest query blocks, so for the contiguous
  branch the call sees `position_ids_for_landmark` as its position_ids: the scores land where the
  paged branch puts them (without it: "value tensor of shape [T, H] cannot be broadcast to
  indexing result of shape [num_queries, H]").
* The block-sparse attention after the mask is replaced by a recorder: we keep the mask (indices,
  ks, the args it was called with) and return zeros. On a CPU-only torch, torch.cuda.current_device
  / set_device (called around each stage) and get_device_name / get_device_capability (asked
  at import to pick launch configs) return CPU placeholders while their code runs.

Their defaults come from their own HiPAttentionConfig (hip_config.py): `layer_config(layer)` is
the per-layer config their SGLang path (paged_hip.py, forward_paged_hip) picks for a prefill.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch


class _Inert:
    """Stands in for any attribute, call or decorator of a module the mask path never uses."""

    def __getattr__(self, name):
        return _Inert()

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator
        return _Inert()

    def __iter__(self):
        return iter(())


def _stub_attr(attr: str):
    # Dunder lookups must fail as on a real module: inspect.getmodule (torch.library, reached via
    # transformers -> torchvision on the GPU machine) reads every module's __file__ as a path.
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Inert()


def _stub_module(name: str) -> None:
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
        return
    except Exception:  # noqa: BLE001 - missing or broken (e.g. numba.cuda without CUDA): stand in
        pass
    mod = types.ModuleType(name)
    mod.__getattr__ = _stub_attr  # type: ignore[attr-defined]
    mod.__all__ = []
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, mod)


def find_package(path: str | os.PathLike) -> Path:
    """The `hip_attn` package directory under a checkout (src/hip_attn), a site-packages folder or
    an unpacked wheel (hip_attn/), or the package itself."""
    p = Path(path).expanduser().resolve()
    for cand in (p, p / "hip_attn", p / "src" / "hip_attn"):
        if (cand / "v1_2" / "attention_extend.py").is_file():
            return cand
    raise FileNotFoundError(
        f"no hip_attn package with v1_2/attention_extend.py under {p}: pass a hip-attention checkout "
        "(its src/hip_attn), an unpacked hip-attn wheel or the site-packages folder holding hip_attn "
        "(e.g. `pip download hip-attn==1.2.9 --no-deps` and unzip it)")


def _tile_volume(config) -> int:
    """Product of a config's block sizes: under the interpreter we take their largest tiles
    (fewest programs; a GPU autotuner may pick any of their configs)."""
    volume = 1
    for value in config.kwargs.values():
        volume *= int(value)
    return volume


def _plain_triton_jit(interpret: bool):
    import triton

    def triton_jit(walk_dependency=None, version=None, repr=None, launch_metadata=None,  # noqa: A002
                   do_not_specialize=None, do_not_specialize_on_alignment=None, debug=None,
                   noinline=None, do_autotune=None, configs=None, key=None, restore_value=None):
        def decorator(fn):
            jitted = triton.jit(fn, do_not_specialize=do_not_specialize)
            if configs:
                chosen = [max(configs, key=_tile_volume)] if interpret else list(configs)
                return triton.autotune(configs=chosen, key=key or [], restore_value=restore_value)(jitted)
            return jitted
        return decorator

    return triton_jit


@dataclass
class HipAttn:
    """The loaded mask path: `module` is their attention_extend, `config` their HiPAttentionConfig()."""

    module: types.ModuleType
    metadata: types.ModuleType
    config: object
    version: str
    package: Path

    def layer_config(self, layer: int):
        """Their per-layer prefill config (paged_hip.py forward_paged_hip: prefill_layers[0] for
        dense_layers, else prefill_layers[1])."""
        return self.config.get_layer_config(layer, is_decode=False)


def load(path: str | os.PathLike) -> HipAttn:
    pkg = find_package(path)
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    for name in ("cv2", "numba", "numba.cuda", "tilelang", "tilelang.language", "tilelang.autotuner",
                 "cuda", "cuda.bindings", "cuda.bindings.runtime", "cupy", "nvtx"):
        _stub_module(name)
    for name, folder in (("hip_attn", pkg), ("hip_attn.v1_2", pkg / "v1_2"), ("hip_attn.utils", pkg / "utils")):
        if name in sys.modules and Path(getattr(sys.modules[name], "__path__", [""])[0]) != folder:
            raise RuntimeError(f"another {name} is already imported ({sys.modules[name]}); run in a fresh process")
        mod = types.ModuleType(name)
        mod.__path__ = [str(folder)]  # a bare package: its __init__ is not run
        sys.modules[name] = mod
    tj = importlib.import_module("hip_attn.v1_2.triton_jit")
    tj.triton_jit = _plain_triton_jit(interpret)  # their version check / interpreter refusal
    with _cpu_cuda_calls():  # their launch configs ask the GPU's name at import
        ae = importlib.import_module("hip_attn.v1_2.attention_extend")
    meta = importlib.import_module("hip_attn.v1_2.attention_metadata")
    cfg_mod = importlib.import_module("hip_attn.v1_2.hip_config")
    version = "unknown"
    for info in list(pkg.parent.glob("hip_attn-*.dist-info")) + list(pkg.parent.glob("hip_attn-*.egg-info")):
        version = info.name.split("-")[1].removesuffix(".dist").removesuffix(".egg")
    if version == "unknown" and (pkg.parent.parent / "pyproject.toml").is_file():
        for line in (pkg.parent.parent / "pyproject.toml").read_text().splitlines():
            if line.strip().startswith("version"):
                version = line.split("=")[1].strip().strip('"') + " (checkout)"
                break
    return HipAttn(ae, meta, cfg_mod.HiPAttentionConfig(), version, pkg)


@contextlib.contextmanager
def _cpu_cuda_calls():
    if torch.cuda.is_available():
        yield
        return
    fakes = {"current_device": lambda: 0, "set_device": lambda d: None,
             "get_device_name": lambda *a: "cpu", "get_device_capability": lambda *a: (0, 0),
             "is_current_stream_capturing": lambda: False}
    saved = {name: getattr(torch.cuda, name) for name in fakes}
    for name, fake in fakes.items():
        setattr(torch.cuda, name, fake)
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(torch.cuda, name, real)


@dataclass
class RefMask:
    """The authors' final mask of one layer, as their block-sparse attention receives it.

    indices int64 [Hq, BDST, n]: first key of each kept block of `block_size_k` keys, ascending
    (entries past `ks` are padding); ks int [Hq, BDST]: active entries per row; the attention adds
    the sink [0, sink) and a window of `window` keys before each query block's end (keys of the
    sparse part at or past end - window are masked out there), all causal."""

    indices: torch.Tensor
    ks: torch.Tensor
    block_size_q: int
    block_size_k: int
    sink: int
    window: int

    def keep(self, block: int, end: int, num_keys: int) -> torch.Tensor:
        """bool [Hq, num_keys]: keys the last query of query block `block` (end position `end`) sees."""
        Hq = self.indices.shape[0]
        keep = torch.zeros(Hq, num_keys, dtype=torch.bool)
        keep[:, :min(self.sink, end)] = True
        keep[:, max(0, end - self.window):end] = True
        for h in range(Hq):
            starts = self.indices[h, block, :int(self.ks[h, block])].long().cpu()
            toks = (starts[:, None] + torch.arange(self.block_size_k)).flatten()
            toks = toks[(toks >= 0) & (toks < max(0, end - self.window))]
            keep[h, toks] = True
        return keep


def reference_mask(hip: HipAttn, q: torch.Tensor, k: torch.Tensor, layer: int, num_queries: int, *,
                   model_context_length: int, cos: torch.Tensor, sin: torch.Tensor, scale: float,
                   overrides: dict | None = None, paged: bool | None = None) -> RefMask:
    """Their mask for the newest `num_queries` queries (a multiple of 64, at least 2 blocks: their
    landmark scan runs for prefills of more than one query block) of a T-token prefill of one
    layer. q [T, Hq, D] and k [T, Hkv, D]: the rotated queries and keys of every token 0..T-1;
    every query goes in as `query_for_landmark` (their landmark scan scores each key by the
    queries after it; paged_hip.py passes a prefill's queries the same way when it masks a
    subset), the newest num_queries as the masked ones. The keys go in as their SGLang layout: a
    page-size-1 cache [T', 1, Hkv, D] with an identity block table (T' = T rounded up to 512, the
    landmark table's granule; the pad pages are zeros past the end). cos/sin [max_pos, D]: the
    model's RoPE tables. HiPAttentionArgs are filled as forward_paged_hip fills them for a
    prefill (paged_hip.py); `overrides` replaces fields (e.g. {"using_landmark": False})."""
    lc = hip.layer_config(layer)
    T, Hq, D = q.shape
    if num_queries % 64 or num_queries < 128 or num_queries > T:
        raise ValueError(f"num_queries must be a multiple of 64 in [128, {T}], got {num_queries}")
    padded = -(-T // 512) * 512
    k_cache = torch.zeros(padded, 1, k.shape[1], D, dtype=k.dtype, device=k.device)
    k_cache[:T, 0] = k
    q = (q * scale).to(q.dtype)  # forward_paged_hip passes query * sm_scale
    positions = torch.arange(T, device=q.device)[None]
    # On CUDA their keys go in contiguous (k, v arguments): Triton 3.6 refuses to compile the paged
    # branch of compute_scores_landmark.py:260 ("mask type matches ptr type"); the interpreter runs
    # both (paged=None: paged on the CPU, contiguous on CUDA; CI runs the contiguous one on the CPU
    # too, the branch the GPU takes).
    if paged is None:
        paged = q.device.type != "cuda"
    cache = dict(k_cache=k_cache, v_cache=k_cache, block_table=torch.arange(padded, device=q.device)[None],
                 cache_seq_lens=torch.tensor([T], device=q.device)) if paged else {}
    args = hip.metadata.HiPAttentionArgs(
        **cache,
        position_ids=positions[:, T - num_queries:],
        query_for_landmark=q[None].contiguous(),
        position_ids_for_landmark=positions,
        block_size_k=32 if D > 128 else 64,
        sliding_window_size=lc.sliding_window_size,
        sink_token_size=lc.sink_token_size,
        using_extend=hip.config.using_extend,
        need_apply_rope=hip.config.using_extend,
        rope_cos=cos, rope_sin=sin, rope_range=(0, D), rope_is_neox_style=True,
        second_stage_k=lc.second_stage_k,
        stages=lc.stages,
        model_context_length=model_context_length,
        extend_context_length=padded,
        block_sparse_block_size_q=hip.config.block_sparse_block_size_q,
        scan_extend_backend=lc.scan_extend_backend or ("streaming" if layer in hip.config.dense_layers else "relative"),
        sa_extend_backend=lc.sa_extend_backend,
        require_cache_statistics=False,
        disable_flashdecode=True,
        layer_id=layer,
        is_decode=False,
        landmark_stage_k=lc.landmark_stage_k,
        self_extend_scale=hip.config.self_extend_scale,
    )
    for key, value in (overrides or {}).items():
        setattr(args, key, value)
    seen = {}

    def record_bsa(*, q, indices, ks, args, **_):
        seen.update(indices=indices, ks=ks, args=args)
        return torch.zeros_like(q)

    saved = hip.module.get_block_sparse_backend, hip.module.landmark_sample
    landmark_sample = saved[1]

    def landmark_at_landmark_positions(q, k, state, args, *rest):  # see the module docstring
        if not args.using_paged_cache and args.position_ids_for_landmark is not None:
            args = copy.copy(args)
            args.position_ids = args.position_ids_for_landmark
        return landmark_sample(q, k, state, args, *rest)

    hip.module.get_block_sparse_backend = lambda *a, **kw: record_bsa
    hip.module.landmark_sample = landmark_at_landmark_positions
    try:
        with _cpu_cuda_calls(), torch.no_grad():
            kv = (None, None) if paged else (k[None], k[None])  # [1, T, Hkv, D]; v is never read for the mask
            hip.module.dual_stage_quadratic_hip_attention(q[None, T - num_queries:].contiguous(), *kv, args)
    finally:
        hip.module.get_block_sparse_backend, hip.module.landmark_sample = saved
    a = seen["args"]
    BDST = seen["indices"].shape[1]
    return RefMask(seen["indices"].view(Hq, BDST, -1), seen["ks"].view(Hq, BDST), a.block_size_q,
                   a.block_size_k, a.sink_token_size, a.sliding_window_size)
