"""A step transform registered once and named nowhere else (runtime/step_transform.py): the runner
attaches it beside token drop and configures it by name (set_transform), the decoder layers hand a
routing transform the stream at the seam of DecoderLayer (before the layer, between attend and
feed_forward) and the layer loop at the end, and the engine core asks it keeps_prompt."""

from __future__ import annotations

import pytest

from infhip import LLM, SamplingParams
from infhip.runtime.step_transform import StepTransform, TransformStep, register, transforms, unregister
from tests._tiny import API_ENGINE

PROMPTS = [[(7 * i + 5 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((23, 9))]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class Tracing(TransformStep):
    """Routes every row through unchanged and writes down where the stream was handed to it."""

    routes = True

    def __init__(self, calls: list):
        self.calls = calls

    def enter_layer(self, i, hidden, residual):
        self.calls.append(("enter", i, hidden.shape[0]))
        return hidden, residual

    def after_attention(self, i, hidden, residual):
        self.calls.append(("after_attention", i, hidden.shape[0]))
        return hidden, residual

    def reconstitute(self, hidden, residual):
        self.calls.append(("reconstitute", None, hidden.shape[0]))
        return hidden, residual


class TraceTransform(StepTransform):
    """Knobs: the longest prompt it leaves whole (None: off); on, it traces every step."""

    name = "trace"

    @classmethod
    def attach(cls, config):
        t = cls()
        t.knobs, t.calls, t.after = None, [], 0
        return t

    def configure(self, knobs, env):
        if knobs is not None and knobs < 0:
            raise ValueError("trace: knobs must be >= 0")
        self.knobs = knobs

    def keeps_prompt(self, seq):
        return self.knobs is None or seq.num_prompt_tokens <= self.knobs

    def plan(self, p, chunks):
        return len(p.input_ids) if self.knobs is not None else None

    def upload(self, host, p, ctx):
        return Tracing(self.calls)

    def after_step(self, seqs, step):
        self.after += 1

    def debug_view(self):
        return {"knobs": self.knobs, "calls": [list(c) for c in self.calls], "after": self.after}


@pytest.fixture
def trace():
    register(TraceTransform)
    yield TraceTransform
    unregister(TraceTransform.name)


def tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def test_registered_transform_is_attached_configured_and_handed_the_stream(tiny_engine, trace):
    engine = tiny_engine(**API_ENGINE)
    plain = tokens(LLM(engine, enforce_eager=True))
    llm = LLM(engine, enforce_eager=True)
    assert [cls.name for cls in transforms()] == ["token_drop", "trace"]  # built-in first
    def view():  # the attached TraceTransform's read-out (EngineCore.debug_view gathers it by name)
        return llm.debug_view()["transforms"]["trace"]

    assert view() == {"knobs": None, "calls": [], "after": 0}
    assert tokens(llm) == plain and view() == {"knobs": None, "calls": [], "after": 0}  # off: every step untouched

    with pytest.raises(KeyError, match="no step transform 'nope'"):
        llm.runner.set_transform("nope", 1)
    with pytest.raises(ValueError, match="knobs must be >= 0"):
        llm.runner.set_transform("trace", -1)
    llm.runner.set_transform("trace", 1000)
    assert tokens(llm) == plain  # a transform that routes rows unchanged changes nothing
    num_layers, t = len(llm.engine.config.plan.layers), view()
    assert t["knobs"] == 1000
    steps, step = [], []
    for call in t["calls"]:
        step.append(call)
        if call[0] == "reconstitute":
            steps.append(step)
            step = []
    assert not step and len(steps) >= t["after"] > 0  # after_step: eager steps of execute (prefills)
    for step in steps:  # per layer: enter, then after its attention, then the end, all rows each time
        assert [(kind, i) for kind, i, _ in step] == [
            (kind, i) for i in range(num_layers) for kind in ("enter", "after_attention")] + [("reconstitute", None)]
        assert len({rows for _, _, rows in step}) == 1

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    llm.runner.set_transform("trace", 10)
    llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=params)  # kept whole: 9 <= 10
    with pytest.raises(ValueError, match="prompt_logprobs needs every prompt position.*'trace'.*turn it off"):
        llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=params)  # 23 > 10


def test_a_second_transform_of_a_name_is_refused(trace):
    class Other(StepTransform):
        name = "trace"

    with pytest.raises(ValueError, match="already registered"):
        register(Other)
    assert TraceTransform in transforms() and Other not in transforms()
