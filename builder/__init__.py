"""infhip.builder: ahead-of-time engine builder (``infhip-build``).

    from infhip.builder import build_engine
    build_engine("smollm2-135m", "engines/smollm2-135m", dtype="float32", device="cpu")

Modules: registry (model names -> sources), checkpoint (HF dir / GGUF / config readers),
hf_config (HF config -> ModelConfig + RoPE), convert (name map, fusions, random weights),
build (atomic engine writer), cli (``infhip-build``).
"""

from infhip.builder.build import build_engine
from infhip.builder.presets import preset_names
from infhip.errors import BuildError
from infhip.builder.registry import ModelSource, resolve_model

__all__ = ["BuildError", "ModelSource", "build_engine", "preset_names", "resolve_model"]
