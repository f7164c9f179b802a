"""The in-process API: `LLM(engine_dir).generate(...)`, `.chat(...)` and `.generate_stream(...)`.

    >>> from infhip import LLM, SamplingParams                       # doctest: +SKIP
    >>> llm = LLM("engines/smollm2-135m")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].text, out[0].finish_reason
    >>> for delta in llm.generate_stream("Once upon a time", SamplingParams(max_tokens=32)):
    ...     print(delta.text, end="", flush=True)
    >>> llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=16))[0].text

`LLM` is a thin wrapper for one caller over `llm.core`, the `EngineCore`
(runtime/engine_core.py: requests, steps, deltas, and the rule that a fault stays with the
request that has it). Frontends (`infhip-serve`, the Triton model, `infhip-run`) drive the same
core from one engine thread, `EngineLoop(llm)` (runtime/engine_loop.py), and reach nothing
else (docs/design/engine_interface.md). Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from infhip.runtime.chat_template import is_one_conversation, render_chat
from infhip.runtime.engine_core import EngineCore
from infhip.runtime.options import LoadOptions
from infhip.runtime.outputs import EngineStats, RequestOutput, StreamDelta
from infhip.runtime.requests import normalise
from infhip.runtime.sampling_params import SamplingParams


class LLM:
    """Load an engine and serve it in-process.

    Args:
        engine_dir: a directory written by `infhip-build`.
        options: a :class:`~infhip.runtime.options.LoadOptions`; or its fields as keywords
            (``LLM(engine, max_num_seqs=4, token_drop=False)``), laid over ``options`` when both
            are given. Every option, its meaning and default: runtime/options.py (the flags of
            infhip-run / infhip-serve have the same names). ``overrides`` and each plan method's
            keyword (``infinitehip_overrides={...}``, ``token_drop=False``) change the engine's
            plan for this load (docs/knobs.md, "Plan methods").
    """

    def __init__(self, engine_dir: str | Path, options: LoadOptions | None = None, **kwargs):
        self.options = LoadOptions.of(options, **kwargs)
        self.core = core = EngineCore(engine_dir, self.options)
        self.tokenizer = core.tokenizer  # the engine's (a transformers tokenizer); None: --random-weights
        self.load_report = core.load_report  # where LLM() spent its time (runtime/load.py)
        # The core's loaded parts, for tests, benchmarks and eval probes (EngineCore documents
        # them): the LoadedEngine (runtime/engine.py), the ModelRunner, the Scheduler.
        self.engine, self.runner, self.scheduler = core.engine, core.runner, core.scheduler

    def stats(self) -> EngineStats:
        """Requests and KV pages now (read-only; safe to call between steps)."""
        return self.core.stats()

    def debug_view(self) -> dict:
        """What the engine holds now: live requests, queues, stats (`EngineCore.debug_view`)."""
        return self.core.debug_view()

    def step(self):
        """One engine step (`EngineCore.step`): for callers that add requests through `llm.core`."""
        return self.core.step()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix page (pages held by requests stay theirs)."""
        self.core.reset_prefix_cache()

    def close(self) -> None:
        """Stop a tensor-parallel engine's worker processes (also at interpreter exit); a no-op
        for a one-rank engine. The LLM cannot run steps afterwards."""
        if getattr(self, "core", None) is not None:
            self.core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: list[str] | str | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        """Generate completions for a batch of prompts (continuous batching); outputs in input order.
        A bad prompt or params raise ValueError and run none of them; a request that fails while
        running comes back with finish_reason "error" and its `error`, the others complete."""
        return self._run(normalise(prompts, prompt_token_ids, sampling_params))

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Reply to one conversation (a list of OpenAI messages, ``{"role", "content"}``) or to a
        list of them, through the engine's chat template, as vLLM's ``LLM.chat``: each rendered
        (runtime/chat_template.py, what POST /v1/chat/completions renders), then run by
        `generate`'s path. ``tools``: OpenAI function tools, written into the prompt as the
        template writes them; ``chat_template_kwargs``: the template's extra keywords
        (``add_generation_prompt=False``, ``enable_thinking=...``). One output per conversation.
        ValueError (nothing runs) when the engine has no template or a conversation is refused."""
        conversations = [messages] if is_one_conversation(messages) else messages
        if not isinstance(conversations, list) or not conversations:
            raise ValueError("chat takes one conversation (a list of message dicts) or a non-empty list of them")
        rendered = [render_chat(self.tokenizer, c, tools, chat_template_kwargs) for c in conversations]
        items = normalise(None, [ids for _, ids in rendered], sampling_params)
        return self._run([(text, ids, sp) for (text, _), (_, ids, sp) in zip(rendered, items)])

    def _run(self, items) -> list[RequestOutput]:
        """Queue (prompt, token ids, params) triples, step until all finish: generate's and chat's
        one path. One bad request rejects the whole call: nothing stays queued."""
        core, reqs = self.core, []
        try:
            for p, ids, sp in items:
                reqs.append(core.add_request(p, ids, sp))
        except Exception:
            for r in reqs:
                core.abort(r)
            raise
        while not all(r.is_finished for r in reqs):
            core.step()
        return [core.output(r) for r in reqs]

    def generate_stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                        prompt_token_ids: list[int] | None = None) -> Iterator[StreamDelta]:
        """Yield the completion of one prompt piece by piece as it is generated (if it fails, the
        last delta has finish_reason "error" and its `error`). With n > 1 the completions'
        deltas interleave (StreamDelta.index); with best_of > n they come whole at the end."""
        core = self.core
        [(p, ids, sp)] = normalise(prompt, prompt_token_ids, sampling_params)
        req = core.add_request(p, ids, sp)
        try:
            while not req.is_finished:
                if req in core.step() or req.is_finished:
                    yield from core.deltas(req)
        finally:  # also when the caller stops iterating early: free the request's pages
            core.abort(req)
