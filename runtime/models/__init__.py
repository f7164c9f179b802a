"""Model blocks, one module per family, Hugging Face names."""

from infhip.runtime.models.gemma3 import Gemma3ForCausalLM
from infhip.runtime.models.llama import LlamaForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}
