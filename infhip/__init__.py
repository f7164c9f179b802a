"""infhip: a long-context LLM inference engine for one GPU.

    from infhip import LLM, SamplingParams
    llm = LLM("engines/smollm2-135m")
    print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].text)
"""

__version__ = "0.1.0"

__all__ = ["LLM", "LoadOptions", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # Lazy: `import infhip` (e.g. by the builder CLI) must not pull in the runtime.
    if name == "LLM":
        from infhip.runtime.llm import LLM
        return LLM
    if name == "LoadOptions":
        from infhip.runtime.options import LoadOptions
        return LoadOptions
    if name == "SamplingParams":
        from infhip.runtime.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from infhip.runtime.structured_output import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(f"module 'infhip' has no attribute {name!r}")
