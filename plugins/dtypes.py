"""The engine's dtype names as torch dtypes, in one place: the build dtypes (infhip/config.py
DTYPES: weights and activations) and the KV cache's (KV_DTYPES: those, or "fp8"). Here, in the
plugins, because the plugins' AOT launch space (aot.py) needs them and plugins never import the
runtime; the runtime imports them from here.
"""

from __future__ import annotations

import torch

# e4m3 (largest value 448): fp8 KV cache rows (kv_quant.py) and fp8 weights (fp8_linear.py)
FP8_DTYPE = torch.float8_e4m3fn

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_DTYPES = {**DTYPES, "fp8": FP8_DTYPE}

__all__ = ["FP8_DTYPE", "DTYPES", "KV_DTYPES"]
