"""The OpenAI-compatible request bodies (pydantic, strict: `"stream": "yes"` is an error, not
True) and their translation into `SamplingParams`; the response and stream-chunk shapes.

OpenAI fields this engine cannot honour are accepted only at their neutral value (`n` 1,
`logprobs` null, `echo` false, penalties 0, ...) and otherwise rejected with the reason, never
silently ignored. Our extensions: `top_k`, `stop_token_ids`, `ignore_eos`, and `token_ids` in
every choice.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from infhip.runtime.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16  # each stop string is searched for on every new token's text
MAX_STOP_TOKEN_IDS = 1024  # checked against every sampled token
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


class BadRequest(ValueError):
    """Answered with 400 and this message."""


@dataclass(frozen=True)
class EngineLimits:
    """What the engine bounds a request by (from its config)."""

    vocab_size: int
    max_seq_len: int


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """Fields of both endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # any name is accepted: this server runs one model
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored (an end-user id for abuse tracking)
    # Our extension: seconds from the request's arrival after which it is aborted (queue time
    # counts); capped by the server's --request-timeout. docs/serving.md, "Lifecycle".
    timeout: float | None = None

    @field_validator("timeout")
    @classmethod
    def _positive_timeout(cls, v):
        if v is not None and not (0 < v < float("inf")):
            raise ValueError(f"timeout must be a number of seconds > 0, got {v}")
        return v

    def _unsupported(self) -> dict[str, bool]:
        """Field -> whether it was given at a value this engine cannot honour."""
        return {"n": self.n not in (None, 1), "presence_penalty": self.presence_penalty not in (None, 0),
                "frequency_penalty": self.frequency_penalty not in (None, 0), "logit_bias": bool(self.logit_bias)}

    def sampling_params(self, max_tokens: int | None, limits: EngineLimits) -> SamplingParams:
        """SamplingParams of this body; BadRequest names the first field out of bounds."""
        bad = [name for name, is_bad in self._unsupported().items() if is_bad]
        if bad:
            hint = " (send n separate requests)" if bad[0] == "n" else ""
            raise BadRequest(f"{bad[0]}={getattr(self, bad[0])!r} is not supported by this server{hint}")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true")
        if max_tokens is not None and max_tokens > limits.max_seq_len:
            raise BadRequest(f"max_tokens={max_tokens} exceeds the engine's max_seq_len {limits.max_seq_len}")
        if self.top_k is not None and self.top_k > limits.vocab_size:
            raise BadRequest(f"top_k={self.top_k} exceeds the vocabulary size {limits.vocab_size}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise BadRequest(f"seed={self.seed} is outside [-2**63, 2**64 - 1]")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise BadRequest(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}")
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise BadRequest(f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
        if any(not 0 <= t < limits.vocab_size for t in ids):
            raise BadRequest(f"stop_token_ids must be in [0, {limits.vocab_size})")
        given = dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                     stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed)
        try:
            return SamplingParams(**{k: v for k, v in given.items() if v is not None})
        except ValueError as e:
            raise BadRequest(str(e)) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Any  # one prompt: text or token ids (checked below with our own message)
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, str) or (isinstance(v, list) and v and all(type(t) is int for t in v)):
            return v
        raise ValueError("\"prompt\" must be a string or a non-empty list of token ids (one prompt per request)")

    def _unsupported(self) -> dict[str, bool]:
        return {**super()._unsupported(), "echo": self.echo, "logprobs": self.logprobs is not None,
                "best_of": self.best_of not in (None, 1), "suffix": self.suffix is not None}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("\"messages\" must hold at least one message")
        return v

    def _unsupported(self) -> dict[str, bool]:
        return {**super()._unsupported(), "logprobs": self.logprobs, "top_logprobs": self.top_logprobs is not None,
                "tools": bool(self.tools), "tool_choice": self.tool_choice not in (None, "none"),
                "response_format": self.response_format not in (None, {"type": "text"})}

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over max_tokens (deprecated)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize: a completion prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for prompt (the chat template writes its own)

    @model_validator(mode="after")
    def _one_source(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of \"prompt\" (text) or \"messages\" (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def parse_body(model: type[BaseModel], body: bytes):
    """The validated body; BadRequest with one readable line per problem."""
    try:
        return model.model_validate_json(body or b"null")
    except ValidationError as e:
        raise BadRequest(_describe(e)) from None


def _describe(e: ValidationError) -> str:
    errors = e.errors(include_url=False)
    if any(err["type"] == "json_invalid" for err in errors):
        return f"the body is not JSON ({errors[0]['msg']})"
    if any(err["type"] == "model_type" and not err["loc"] for err in errors):
        return "the body must be a JSON object"
    unknown = sorted(".".join(map(str, err["loc"])) for err in errors if err["type"] == "extra_forbidden")
    if unknown:
        return f"unknown field(s) {', '.join(unknown)}"
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in errors)


# -- responses ----------------------------------------------------------------------------------
def new_meta(kind: Literal["cmpl", "chatcmpl"], model: str) -> dict:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens reused from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _text_choice(text: str, token_ids: list[int], finish_reason: str | None) -> dict:
    return {"index": 0, "text": text, "token_ids": token_ids, "logprobs": None, "finish_reason": finish_reason}


def completion(meta: dict, text: str, token_ids: list[int], finish_reason: str | None, use: dict) -> dict:
    return {**meta, "object": "text_completion", "choices": [_text_choice(text, token_ids, finish_reason)],
            "usage": use}


def completion_chunk(meta: dict, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
    return {**meta, "object": "text_completion", "choices": [_text_choice(text, token_ids, finish_reason)]}


def chat_completion(meta: dict, text: str, token_ids: list[int], finish_reason: str | None, use: dict) -> dict:
    return {**meta, "object": "chat.completion", "usage": use,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "token_ids": token_ids,
                         "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(meta: dict, delta: dict, token_ids: list[int], finish_reason: str | None) -> dict:
    return {**meta, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "token_ids": token_ids, "logprobs": None,
                         "finish_reason": finish_reason}]}


def usage_chunk(meta: dict, obj: str, use: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {**meta, "object": obj, "choices": [], "usage": use}
