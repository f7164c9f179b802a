"""How the generating routes turn a request's StreamDeltas into OpenAI's shapes: the choices of a
whole response, or one chunk per delta when streaming (responses.py builds the JSON).

A completions request may hold several prompts (each its own engine request) and each may ask
n completions: choice ``prompt_index * n + delta.index``. With `echo` the prompt's text (and its
logprobs) go before the completion, in the first chunk of each choice when streaming. A request
with `max_tokens` 0 runs one token (the engine always generates one) and drops it here: its
choices hold the echoed prompt only, finish_reason "length". On chat streams the first chunk of
each choice carries ``{"role": "assistant"}`` together with its first token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from infhip.runtime.serving import responses as R
from infhip.runtime.serving.tool_calls import ToolCallPlan


def token_strings(tokenizer):
    """token id -> its text (cached; the logprobs objects name tokens by text)."""
    if tokenizer is None:  # an engine built with random weights
        return lambda t: f"token_id:{t}"
    return functools.lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))


@dataclass
class _Acc:
    """One choice being collected (whole responses) or streamed (its offsets, its first chunk)."""

    choice: R.Choice
    pieces: list[str] = field(default_factory=list)
    started: bool = False  # a chunk of it went out (streams)
    offset: int = 0  # characters of it sent so far (completions' text_offset)
    whole: R.Choice | None = None  # all of it so far (whole responses)


class Shape:
    """One request's response shape. prompts: per prompt (its text, its token ids); n: choices
    per prompt; echo: prompts go before completions; discard: max_tokens was 0."""

    chunk_object = ""

    def __init__(self, meta: dict, token_str, prompts: list[tuple[str, list[int]]], n: int,
                 echo: bool = False, discard: bool = False):
        self.meta, self.token_str, self.prompts, self.n = meta, token_str, prompts, n
        self.echo, self.discard = echo, discard
        self._acc: dict[int, _Acc] = {}
        self.num_tokens = 0  # completion tokens (usage)

    def _take(self, delta, prompt_index: int) -> _Acc:
        """Fold a delta into its choice; the piece it adds is left in acc.choice."""
        index = prompt_index * self.n + delta.index
        acc = self._acc.get(index)
        if acc is None:
            acc = self._acc[index] = _Acc(R.Choice(index, "", [], None))
        text, ids, lps = delta.text, list(delta.token_ids), delta.logprobs
        if self.discard:
            text, ids, lps = "", [], ([] if lps is not None else None)
        self.num_tokens += len(ids)
        c = R.Choice(index, text, ids, "length" if self.discard and delta.finish_reason not in (None, "error", "abort")
                     else delta.finish_reason, lps)
        if self.echo and not acc.started:
            prompt_text, prompt_ids = self.prompts[prompt_index]
            c.text = prompt_text + c.text
            c.prompt_ids = prompt_ids
            c.prompt_logprobs = delta.prompt_logprobs or [None] * len(prompt_ids)
            if c.logprobs is None and delta.prompt_logprobs is not None:
                c.logprobs = []
        acc.started = True
        acc.choice = c
        return acc

    # -- whole responses --------------------------------------------------------------------
    def add(self, delta, prompt_index: int) -> None:
        """Collect a delta of a whole (non-streamed) response."""
        acc = self._take(delta, prompt_index)
        piece, w = acc.choice, acc.whole
        if w is None:
            acc.whole = piece
            return
        w.text += piece.text
        w.token_ids += piece.token_ids
        w.finish_reason = piece.finish_reason
        if piece.logprobs is not None:
            w.logprobs = (w.logprobs or []) + piece.logprobs

    @property
    def choices(self) -> list[R.Choice]:
        return [self._acc[i].whole for i in sorted(self._acc)]

    # -- streams -----------------------------------------------------------------------------
    def chunk(self, delta, prompt_index: int = 0) -> dict:
        raise NotImplementedError


class CompletionShape(Shape):
    chunk_object = "text_completion"

    def chunk(self, delta, prompt_index: int = 0) -> dict:
        acc = self._take(delta, prompt_index)
        out = R.completion_chunk(self.meta, acc.choice, self.token_str, acc.offset)
        acc.offset += len(acc.choice.text)
        return out

    def whole(self, use: dict) -> dict:
        return R.completion(self.meta, self.choices, self.token_str, use)


class ChatShape(Shape):
    """tools: the request's ToolCallPlan (runtime/serving/tool_calls.py) or None: with one, each
    choice's text is read for tool calls (content and `tool_calls`; streams: delta items)."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, *args, tools: ToolCallPlan | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tools = tools
        self._streams = {}  # choice index -> its ToolCallStream

    def chunk(self, delta, prompt_index: int = 0) -> dict:
        first = (prompt_index * self.n + delta.index) not in self._acc
        c = self._take(delta, prompt_index).choice
        if self.tools is not None:
            return R.chat_chunk(self.meta, c, self._tool_delta(c, first), self.token_str)
        d = {"role": "assistant", "content": c.text} if first else {"content": c.text} if c.text else {}
        return R.chat_chunk(self.meta, c, d, self.token_str)

    def _tool_delta(self, c: R.Choice, first: bool) -> dict:
        """The delta of choice c's new text through its streaming tool-call parser (its
        finish_reason becomes "tool_calls" when it called tools)."""
        stream = self._streams.setdefault(c.index, self.tools.stream())
        content, items = stream.feed(c.text)
        if c.finish_reason is not None:
            more, last = stream.finish()
            content, items = content + more, items + last
            c.finish_reason = self.tools.finish_reason([None] * stream.calls, c.finish_reason)
        d = {"role": "assistant"} if first else {}
        if content or first:
            d["content"] = content
        if items:
            d["tool_calls"] = items
        return d

    def whole(self, use: dict) -> dict:
        out = R.chat_completion(self.meta, self.choices, self.token_str, use)
        if self.tools is not None:
            for ch in out["choices"]:
                content, calls = self.tools.parse(ch["message"]["content"])
                ch["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                ch["finish_reason"] = self.tools.finish_reason(calls, ch["finish_reason"])
        return out
