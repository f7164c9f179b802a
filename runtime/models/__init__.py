"""Model blocks, one module per family, Hugging Face names."""

from infhip.runtime.models.gemma3 import Gemma3ForCausalLM
from infhip.runtime.models.llama import LlamaForCausalLM
from infhip.runtime.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
}
