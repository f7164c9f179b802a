"""The engine-format side of the toy attention backend "sink_window" (tests/_toy_backend.py): its
knobs, its preset and its registration, torch-free as every plan method (infhip/methods/). With
this file and the backend's, the toy is built into engines (``--preset sink-window``), saved,
loaded with its knobs changed per load, and served: tests/test_attention_backend_registry.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from infhip.methods import BACKEND, Method, knob, require


@dataclass(frozen=True)
class SinkWindowKnobs:
    layers: tuple[int, ...] = knob((), "the full-attention layers it runs; () = every one")
    sink: int = knob(4, "first tokens every query sees", runtime=True)
    window: int = knob(8, "last tokens every query sees (itself included)", runtime=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))  # config.json's lists
        require(self.sink >= 0 and self.window >= 1, f"sink >= 0 and window >= 1, got {self.sink}, {self.window}")


class SinkWindow(Method):
    """StreamingLLM's pattern: each query attends to the first ``sink`` tokens and its last ``window``."""

    name = "sink_window"
    kind = BACKEND
    knobs = SinkWindowKnobs
    title = "Sink-window (toy)"
    summary = "each query attends to the first sink tokens and its last window (a test's toy)"
    presets = {"sink-window": {}}

    @classmethod
    def claims(cls, layer, knobs: SinkWindowKnobs) -> bool:
        return cls.runs(layer) and (not knobs.layers or layer.index in knobs.layers)
