"""The plugin modules whose kernels every engine may launch, by who launches them (names relative to
infhip.plugins). The builder's AOT enumeration (plugins/aot_engine.py) asks each of these, and each
plan method's ``plugin_modules`` (infhip/methods/, full module names), for its
``aot_launches(space)``: the kernel variants the engine's plan allows."""

MODEL_BLOCKS = ("rms_norm", "activation", "skinny_gemm", "fp8_skinny_gemm", "fp8_linear",  # runtime/models/
                "causal_conv", "gated_delta", "gated_delta_chunked", "moe")  # (Qwen3-Next: linear attention, MoE)
DENSE_ATTENTION = ("rope", "dense_attention", "kv_quant")  # runtime/attention/dense.py: every unclaimed layer
SAMPLER = ("sampling",)  # runtime/sampler.py
OFFLOAD = ("kv_offload",)  # runtime/offload/policy.py: page copies, when a plan method moves pages
