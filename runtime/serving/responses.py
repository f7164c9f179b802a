"""The JSON of OpenAI's responses and stream chunks (completions and chat), built from the
choices shapes.py collects; `usage` and the response ids."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Literal

def new_meta(kind: Literal["cmpl", "chatcmpl"], model: str) -> dict:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens reused from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Choice:
    """One choice of a response or a stream chunk, as the app collected it: `text` and
    `token_ids` are what is sent in this piece (with echo, the prompt is put before them in the
    first piece); `logprobs`: TokenLogprobs of token_ids (or None: not asked)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # echo: TokenLogprobs | None per prompt token
    prompt_ids: list[int] | None = None  # echo: the prompt's tokens (text already in `text`)


def completion_logprobs(c: Choice, token_str, offset: int) -> dict | None:
    """OpenAI's completions logprobs object of choice c (tokens, token_logprobs, top_logprobs,
    text_offset), its text starting at character ``offset`` of the choice; token_str(id) -> the
    token's text. With echo the prompt's tokens come first (the first has logprob null). The
    chosen token is in its top_logprobs too (vLLM's shape; lm-eval reads greediness from it)."""
    if c.logprobs is None:
        return None
    recs = list(zip(c.prompt_ids, c.prompt_logprobs)) if c.prompt_ids is not None else []
    recs += [(r.token_id, r) for r in c.logprobs]
    tokens, lps, tops, offsets = [], [], [], []
    for tok, r in recs:
        text = token_str(tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        lps.append(None if r is None else r.logprob)
        if r is None:
            tops.append(None)
        else:
            top = {}
            for t, lp in [*r.top, (tok, r.logprob)]:  # best first: a text two tokens share keeps the better
                top.setdefault(token_str(t), lp)
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: Choice, token_str) -> dict | None:
    """OpenAI's chat logprobs object of choice c: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if c.logprobs is None:
        return None

    def entry(tok: int, lp: float) -> dict:
        text = token_str(tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(r.token_id, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                        for r in c.logprobs]}


def _text_choice(c: Choice, token_str, offset: int) -> dict:
    return {"index": c.index, "text": c.text, "token_ids": c.token_ids,
            "logprobs": completion_logprobs(c, token_str, offset), "finish_reason": c.finish_reason}


def completion(meta: dict, choices: list[Choice], token_str, use: dict) -> dict:
    return {**meta, "object": "text_completion", "choices": [_text_choice(c, token_str, 0) for c in choices],
            "usage": use}


def completion_chunk(meta: dict, c: Choice, token_str, offset: int) -> dict:
    return {**meta, "object": "text_completion", "choices": [_text_choice(c, token_str, offset)]}


def chat_completion(meta: dict, choices: list[Choice], token_str, use: dict) -> dict:
    return {**meta, "object": "chat.completion", "usage": use,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "token_ids": c.token_ids, "logprobs": chat_logprobs(c, token_str),
                         "finish_reason": c.finish_reason} for c in choices]}


def chat_chunk(meta: dict, c: Choice, delta: dict, token_str) -> dict:
    return {**meta, "object": "chat.completion.chunk",
            "choices": [{"index": c.index, "delta": delta, "token_ids": c.token_ids,
                         "logprobs": chat_logprobs(c, token_str), "finish_reason": c.finish_reason}]}


def usage_chunk(meta: dict, obj: str, use: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {**meta, "object": obj, "choices": [], "usage": use}
