"""What `LLM.generate` and `LLM.generate_stream` hand back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    """One finished request: `token_ids` and `text` are the completion only."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # with finish_reason "error": what failed (the other requests went on)
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not recomputed)


@dataclass
class StreamDelta:
    """A piece of a streamed completion: the tokens produced since the last delta and the text
    they completed (text may lag tokens by an incomplete UTF-8 character)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # set on the last delta
    error: str | None = None  # on the last delta, with finish_reason "error": what failed
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (0 before admission)
