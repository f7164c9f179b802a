"""The OpenAI-compatible request bodies (pydantic, strict: `"stream": "yes"` is an error, not
True) and their translation into `SamplingParams` (the response JSON: responses.py).

Every field of OpenAI's two endpoints and every field `vllm bench serve` and
`sglang.bench_serving` send is accepted (the table in docs/serving.md): the sampling ones map to
`SamplingParams` (`n`, `best_of`, `logprobs`, `top_logprobs`, `echo`, penalties, `min_p`,
`min_tokens`, `logit_bias`, `bad_words`, `seed`, `priority`, ...); those this engine does not
implement (`NEUTRAL_ONLY`) are accepted at their neutral value and otherwise refused with a 400
that names the field, never silently ignored; `IGNORED` ones change nothing whatever their value.
A field nobody sends is an error (a typo must not pass). Our extensions: `token_ids` in every
choice, and vLLM's `top_k`, `stop_token_ids`, `ignore_eos`, ... (they mean what they mean there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from infhip.runtime.sampling_params import SamplingParams
from infhip.runtime.serving.tool_calls import template_messages
from infhip.runtime.structured_output import StructuredOutputsParams

MAX_STOP_STRINGS = 16  # each stop string is searched for on every new token's text
MAX_STOP_TOKEN_IDS = 1024  # checked against every sampled token
MAX_PROMPTS = 64  # prompts in one completions request (a batch: lm-eval sends them)
MAX_BAD_WORDS = 64

# Fields this engine does not implement, accepted only at a value that changes nothing.
NEUTRAL_ONLY: dict[str, tuple] = {
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "allowed_token_ids": (), "return_tokens_as_token_ids": (False,), "store": (False,), "suffix": ("",),
    "audio": (), "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "web_search_options": (),
    "function_call": ("none",), "functions": ([],), "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (), "documents": ([],), "verbosity": (),
    # vLLM's extensions this engine does not implement (vllm/entrypoints/openai/protocol.py)
    "prompt_logprobs": (), "logits_processors": ([],), "guided_whitespace_pattern": (), "structural_tag": (),
    "prompt_embeds": (),
}
# Fields that change nothing here whatever their value (routing hints, tags, ids).
# vLLM's: cache_salt (this server's prefix cache is not shared across tenants by name; docs/serving.md
# says so), kv_transfer_params (disaggregated serving), vllm_xargs (its plugins'), guided_decoding_backend
# (one backend here), mm_processor_kwargs (text only), include_reasoning (no reasoning parser: the
# text is returned as written), return_token_ids (every choice has token_ids already).
IGNORED = ("user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "request_id",
           "cache_salt", "kv_transfer_params", "vllm_xargs", "guided_decoding_backend", "mm_processor_kwargs",
           "include_reasoning", "return_token_ids")
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes


class BadRequest(ValueError):
    """Answered with 400 and this message."""


@dataclass(frozen=True)
class EngineLimits:
    """What the engine bounds a request by (from its config)."""

    vocab_size: int
    max_seq_len: int


class StreamOptions(BaseModel):
    """include_usage: a last chunk with the usage (OpenAI). continuous_usage_stats: every chunk
    carries the usage so far (vLLM's; guidellm and aiperf's --per-chunk-usage send it).
    include_obfuscation: OpenAI's random padding field, which this server never adds."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    include_obfuscation: bool | None = None


class _Common(BaseModel):
    """Fields of both endpoints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # one of the served names (--served-model-name), else 404
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    priority: int | None = None
    # Structured output (runtime/structured_output.py), one source per request: OpenAI's
    # response_format, vLLM's structured_outputs object, or vLLM's older guided_* fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Our extension: seconds from the request's arrival after which it is aborted (queue time
    # counts); capped by the server's --request-timeout. docs/serving.md, "Lifecycle".
    timeout: float | None = None
    # NEUTRAL_ONLY and IGNORED fields: any JSON here, checked in sampling_params
    use_beam_search: Any = None
    length_penalty: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    store: Any = None
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    request_id: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    guided_decoding_backend: Any = None
    mm_processor_kwargs: Any = None
    include_reasoning: Any = None
    return_token_ids: Any = None
    prompt_logprobs: Any = None
    logits_processors: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None
    prompt_embeds: Any = None

    @field_validator("timeout")
    @classmethod
    def _positive_timeout(cls, v):
        if v is not None and not (0 < v < float("inf")):
            raise ValueError(f"timeout must be a number of seconds > 0, got {v}")
        return v

    def _unsupported(self) -> dict[str, bool]:
        """Field -> whether it was given at a value this engine cannot honour (subclasses add)."""
        return {name: getattr(self, name, None) is not None and getattr(self, name) not in neutral
                for name, neutral in NEUTRAL_ONLY.items()}

    def _logprobs(self) -> dict:
        """SamplingParams' logprobs / prompt_logprobs / best_of of this body (per endpoint)."""
        return {}

    def sampling_params(self, max_tokens: int | None, limits: EngineLimits) -> SamplingParams:
        """SamplingParams of this body; BadRequest names the first field out of bounds."""
        bad = [name for name, is_bad in self._unsupported().items() if is_bad]
        if bad:
            raise BadRequest(f"{bad[0]}={getattr(self, bad[0])!r} is not supported by this server "
                             f"(only its neutral value is accepted)")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true")
        if max_tokens is not None and max_tokens > limits.max_seq_len:
            raise BadRequest(f"max_tokens={max_tokens} exceeds the engine's max_seq_len {limits.max_seq_len}")
        if max_tokens is not None and max_tokens < 0:
            raise BadRequest(f"max_tokens={max_tokens} must be >= 0")
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
        if len(self.bad_words or ()) > MAX_BAD_WORDS:
            raise BadRequest(f"bad_words has {len(self.bad_words)} words; at most {MAX_BAD_WORDS}")
        bias = None
        if self.logit_bias:
            if len(self.logit_bias) > MAX_STOP_TOKEN_IDS:
                raise BadRequest(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_STOP_TOKEN_IDS}")
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise BadRequest("logit_bias keys must be token ids (strings of integers)") from None
            if any(not 0 <= t < limits.vocab_size for t in bias):
                raise BadRequest(f"logit_bias keys must be token ids in [0, {limits.vocab_size})")
        given = dict(max_tokens=max(max_tokens, 1) if max_tokens is not None else None, temperature=self.temperature,
                     top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, stop=self.stop,
                     stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, seed=self.seed, n=self.n,
                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                     repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens, logit_bias=bias,
                     bad_words=self.bad_words, priority=self.priority, structured_outputs=self._structured(),
                     **self._logprobs())
        try:
            return SamplingParams(**{k: v for k, v in given.items() if v is not None})
        except ValueError as e:
            raise BadRequest(str(e).replace("SamplingParams.", "")) from None

    def _structured(self) -> StructuredOutputsParams | None:
        """The body's output constraint: response_format (text | json_object | json_schema),
        structured_outputs {json | json_object | regex | choice | grammar | structural_tag}, or
        guided_json / guided_regex / guided_choice / guided_grammar; at most one of them."""
        guided = {k: getattr(self, "guided_" + k) for k in ("json", "regex", "choice", "grammar")
                  if getattr(self, "guided_" + k) is not None}
        rf = self.response_format if self.response_format not in (None, {"type": "text"}) else None
        given = [n for n, v in (("response_format", rf), ("structured_outputs", self.structured_outputs),
                                *((f"guided_{k}", v) for k, v in guided.items())) if v is not None]
        if len(given) > 1:
            raise BadRequest(f"give one output constraint, not {', '.join(given)}")
        try:
            if rf is not None:
                return _response_format(rf)
            if self.structured_outputs is not None:
                return StructuredOutputsParams(**self.structured_outputs)
            return StructuredOutputsParams(**guided) if guided else None
        except TypeError:
            raise BadRequest(f"structured_outputs takes json, json_object, regex, choice, grammar or structural_tag; "
                             f"got {sorted(self.structured_outputs)}") from None
        except ValueError as e:
            raise BadRequest(str(e).replace("StructuredOutputsParams.", f"{given[0]}: ")) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every stream chunk carries the usage so far (stream_options.continuous_usage_stats)."""
        return self.stream_options is not None and bool(self.stream_options.continuous_usage_stats)


def _response_format(rf: dict) -> StructuredOutputsParams:
    """OpenAI's response_format (not "text") as a constraint; BadRequest for other shapes."""
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise BadRequest("response_format json_schema needs {\"type\": \"json_schema\", \"json_schema\": "
                             "{\"name\": ..., \"schema\": {JSON schema}}}")
        return StructuredOutputsParams(json=js["schema"])
    raise BadRequest(f"response_format type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}")


class CompletionRequest(_Common):
    """POST /v1/completions. `prompt`: a text, token ids, or a batch of either (choices
    ``prompt_index * n + i``; not with stream). `echo` puts the prompt (and with `logprobs` its
    logprobs) before each completion; `max_tokens` 0 with `echo` scores a prompt without
    generating (lm-eval's loglikelihood)."""

    prompt: Any  # checked below with our own message
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: Any = None
    add_special_tokens: bool = True  # tokenizing a text prompt (vLLM's field)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        def one(p):
            return isinstance(p, str) or (isinstance(p, list) and p and all(type(t) is int for t in p))
        if one(v) or (isinstance(v, list) and v and len(v) <= MAX_PROMPTS and all(one(p) for p in v)):
            return v
        raise ValueError(f"\"prompt\" must be a string, a non-empty list of token ids, or a list of up to "
                         f"{MAX_PROMPTS} of either")

    @property
    def prompts(self) -> list:
        """The prompts of this body: each a str or a list of token ids."""
        v = self.prompt
        return [v] if isinstance(v, str) or type(v[0]) is int else list(v)

    def _logprobs(self) -> dict:
        if self.best_of is not None and self.best_of > 1 and self.stream:
            raise BadRequest("best_of > 1 cannot stream (the best completions are known only at the end)")
        if len(self.prompts) > 1 and self.stream:
            raise BadRequest("prompt: a batch of prompts cannot stream; send one request per prompt")
        echo_lp = self.logprobs if self.echo else None
        return dict(logprobs=self.logprobs, prompt_logprobs=echo_lp, best_of=self.best_of)

class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A chat message; an assistant's may hold tool_calls instead of content, a "tool" message
    answers one (tool_call_id)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's with tool_calls may omit it)")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it (tool-call arguments as objects)."""
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        m = {"role": self.role, "content": text}
        m.update({k: v for k, v in (("name", self.name), ("tool_calls", self.tool_calls),
                                    ("tool_call_id", self.tool_call_id)) if v is not None})
        return template_messages([m])[0] if self.tool_calls else m


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    function_call: Any = None
    functions: Any = None
    verbosity: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # the template's extra keywords (runtime/chat_template.py)
    documents: Any = None
    echo: bool = False  # vLLM's chat extension; only false
    add_special_tokens: bool = False  # vLLM's; only false (the chat template writes the special tokens)

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v):
        if not v:
            raise ValueError("\"messages\" must hold at least one message")
        return v

    def _unsupported(self) -> dict[str, bool]:
        return {**super()._unsupported(), "echo": self.echo, "add_special_tokens": self.add_special_tokens}

    def _logprobs(self) -> dict:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true")
        return dict(logprobs=(self.top_logprobs or 0) if self.logprobs else None)

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
