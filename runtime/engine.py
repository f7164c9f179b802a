"""Engine loader: check format and target, build the model on the meta device, assign weights
straight from the safetensors file onto the target device (no pickle, no second copy)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from infhip.config import EngineConfig, EngineFormatError
from infhip.plugins.dtypes import DTYPES
from infhip.runtime.distributed.group import SINGLE, TPGroup
from infhip.runtime.kernel_store import KernelStore, jit_mode, open_store
from infhip.runtime.models import MODEL_CLASSES
from infhip.runtime.models.common import use_fp8_linears

logger = logging.getLogger("infhip.engine")



def gpu_target(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def resolve_device(config: EngineConfig, device: str | torch.device | None, jit: str = "warn") -> torch.device:
    """The engine's target decides the device unless one is given; mismatches are refused (a GPU
    other than the target runs only with jit="allow": its kernels then compile here)."""
    target = config.build.target
    if device is None:
        device = "cpu" if target == "cpu" else "cuda"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineFormatError(
                f"engine targets {target} but no CUDA GPU is available here; run it on a GPU, or "
                "rebuild for the CPU with: infhip-build ... --device cpu")
        have = gpu_target(device)
        if target != "cpu" and target != have and jit != "allow":
            raise EngineFormatError(
                f"engine was built for {target} but this GPU is {have}; rebuild it on this machine "
                "with: infhip-build ... --device cuda (or load with jit='allow' to compile its kernels here)")
    elif target != "cpu":
        raise EngineFormatError(
            f"engine was built for GPU target {target}; load it on a GPU (device='cuda') or rebuild "
            "for the CPU with: infhip-build ... --device cpu")
    return device


def _check_fp8_device(config: EngineConfig, device: torch.device) -> None:
    """An fp8-weight engine on a GPU without fp8 tensor cores (below sm_89) runs, on the
    dequantizing reference path (each call widens its weight to bf16 first: correct, and slower
    than a bf16 engine); say so once per load."""
    from infhip.plugins.fp8_linear import FP8_MIN_CAPABILITY, device_has_fp8

    if config.build.weight_dtype == "fp8" and device.type == "cuda" and not device_has_fp8(device):
        logger.warning("engine has fp8 weights but this GPU (%s) has no fp8 tensor cores (sm_%d+): its "
                       "linear layers run the dequantizing reference path, slower than a bf16 engine; "
                       "rebuild with --weight-dtype bf16 for speed on this GPU", gpu_target(device),
                       FP8_MIN_CAPABILITY)


@dataclass
class LoadedEngine:
    config: EngineConfig
    model: torch.nn.Module
    tokenizer: object | None  # a transformers tokenizer, None for random-weights engines
    device: torch.device
    dtype: torch.dtype
    kernels: KernelStore | None = None  # the engine's compiled kernels, served to Triton
    # Tensor parallelism (runtime/distributed/): this rank's group, SINGLE for a one-rank engine;
    # set by the launcher once the ranks have joined. config.model is then this rank's view
    # (its head counts and MLP width, infhip/tensor_parallel.py).
    tp: TPGroup = SINGLE


def load_tokenizer(engine_dir: Path):
    tok_dir = engine_dir / "tokenizer"
    if not tok_dir.is_dir():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tok_dir))


def load_engine(engine_dir: str | Path, device: str | torch.device | None = None,
                jit: str | None = None, rank: int = 0) -> LoadedEngine:
    """jit: what to do when a kernel would compile while serving (runtime/kernel_store.py).
    rank: of a tensor-parallel engine, the shard to load (its file, its GPU cuda:rank, its view
    of the model); the ranks' group is attached afterwards (runtime/distributed/)."""
    engine_dir = Path(engine_dir)
    config = EngineConfig.load(engine_dir)
    jit = jit_mode(jit)
    device = resolve_device(config, device, jit)
    if config.build.tp > 1:
        from infhip.tensor_parallel import local_model_config, shard_layout
        config = dataclasses.replace(config, model=local_model_config(config.model,
                                                                      shard_layout(config.model, config.build.tp)[rank]))
        if device.type == "cuda":
            device = torch.device("cuda", rank)
    weights_path = engine_dir / f"rank{rank}.safetensors"
    if not weights_path.is_file():
        raise EngineFormatError(f"{weights_path} is missing; rebuild the engine")
    model = MODEL_CLASSES[config.model.architecture](config.model, config.plan.layers)
    use_fp8_linears(model, config.fp8_linears())  # fp8 engines: those layers' weights are fp8
    _check_fp8_device(config, device)
    try:
        state = load_file(str(weights_path), device=str(device))
    except Exception as e:  # safetensors raises several types for damaged files
        raise EngineFormatError(f"{weights_path} cannot be read ({e}); rebuild the engine") from e
    if device.type == "cpu":
        # On the CPU the tensors are views into the file's mmap, at the file's offsets, so some
        # start off 16-byte alignment; on the GPU each is a fresh (aligned) allocation. Copy those:
        # kernels then see aligned weights everywhere, and the Triton variants recorded on CPU
        # are the GPU's (tests/test_aot_coverage.py).
        state = {name: t.clone() if t.data_ptr() % 16 else t for name, t in state.items()}
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise EngineFormatError(f"{weights_path} does not match config.json ({e}); rebuild the engine") from e
    model.eval().requires_grad_(False)
    loaded = LoadedEngine(config=config, model=model, tokenizer=load_tokenizer(engine_dir),
                          device=device, dtype=DTYPES[config.build.dtype])
    if device.type == "cuda":
        loaded.kernels = open_store(engine_dir, config.build.target, jit, owner=loaded,
                                    num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
    return loaded
