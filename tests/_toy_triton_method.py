"""The engine-format side of the toy backend "sink_window_triton" (tests/_toy_triton_backend.py):
knobs, a preset, and what it declares to the shared machinery: its runtime module, the module of
its kernel (tests/_toy_triton_kernel.py, whose ``aot_launches`` the builder and the compile matrix
ask) and when an engine may move KV pages to the host (``moves_pages``: the offload's page copies
get compiled). Torch-free, as every plan method. docs/design/adding.md counts what it took.
"""

from __future__ import annotations

from dataclasses import dataclass

from infhip.methods import BACKEND, Method, knob, require


@dataclass(frozen=True)
class SinkWindowTritonKnobs:
    sink: int = knob(4, "first tokens every query sees", runtime=True)
    window: int = knob(8, "last tokens every query sees (itself included)", runtime=True)
    offload_from: int = knob(64, "with kv_offload_bytes, a request's pages move to the host from this context on",
                             runtime=True)

    def __post_init__(self) -> None:
        require(self.sink >= 0 and self.window >= 1, f"sink >= 0 and window >= 1, got {self.sink}, {self.window}")
        require(self.offload_from >= 1, f"offload_from must be >= 1, got {self.offload_from}")


class SinkWindowTriton(Method):
    """StreamingLLM's pattern as a Triton kernel over paged, possibly offloaded, KV (a test's toy)."""

    name = "sink_window_triton"
    kind = BACKEND
    knobs = SinkWindowTritonKnobs
    title = "Sink-window, Triton (toy)"
    summary = "each query attends to the first sink tokens and its last window, in Triton (a test's toy)"
    presets = {"sink-window-triton": {}}
    runtime_module = "tests._toy_triton_backend"
    plugin_modules = ("tests._toy_triton_kernel",)

    @classmethod
    def moves_pages(cls, knobs: SinkWindowTritonKnobs, build) -> bool:
        return knobs.offload_from <= build.max_seq_len
