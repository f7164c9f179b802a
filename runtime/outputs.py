"""What `LLM.generate` and `LLM.generate_stream` hand back, and `LLM.stats()`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """One token's raw logprob (the model's log-softmax, before penalties and temperature), its
    rank among the vocabulary (1 = most likely) and the ``top`` most likely tokens as
    (token id, logprob), best first (SamplingParams.logprobs / prompt_logprobs of them)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One of a request's n completions."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None  # per token, with SamplingParams.logprobs
    cumulative_logprob: float | None = None  # sum of the tokens' logprobs, when computed
    error: str | None = None


@dataclass
class RequestOutput:
    """One finished request: `token_ids`, `text`, `finish_reason`, `logprobs` are the first
    completion's (`outputs[0]`), the completion only; `outputs` holds all n (SamplingParams.n;
    with best_of, the n of highest cumulative logprob, best first)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # with finish_reason "error": what failed (the other requests went on)
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (not recomputed)
    logprobs: list[TokenLogprobs] | None = None
    # per prompt token (SamplingParams.prompt_logprobs): None for the first, which has no context
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class StreamDelta:
    """A piece of a streamed completion: the tokens produced since the last delta and the text
    they completed (text may lag tokens by an incomplete UTF-8 character). With n > 1, each
    completion streams its own deltas, told apart by `index`."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # set on the last delta
    error: str | None = None  # on the last delta, with finish_reason "error": what failed
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (0 before admission)
    index: int = 0  # which of the n completions
    logprobs: list[TokenLogprobs] | None = None  # of token_ids, with SamplingParams.logprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on a request's first delta only


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load: counters only, cheap enough to read every scrape.
    Page counts are per KV group ("global", and "sliding" for Gemma-3); the null page is not
    counted, pages set aside for the offload page cache count as used."""

    num_running: int  # requests holding KV pages (prefilling or decoding)
    num_waiting: int  # queued: new, or preempted and to be recomputed
    kv_pages_used: dict[str, int]
    kv_pages_free: dict[str, int]
    host_pages_used: dict[str, int]  # groups with a host pool (kv_offload_bytes) only
    host_pages_free: dict[str, int]
    # Prefix caching (zero when off): cached pages held by no request (counted in kv_pages_free),
    # and since start: prompt tokens looked up at admission, of them found cached, pages evicted.
    kv_pages_cached: dict[str, int] = field(default_factory=dict)
    host_pages_cached: dict[str, int] = field(default_factory=dict)  # (counted in host_pages_free)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    num_preemptions: int = 0  # requests preempted (their KV freed, recomputed later) since start


@dataclass(frozen=True)
class EngineInfo:
    """What a frontend may know of a loaded engine (fixed at load; EngineLoop.info): its limits,
    the KV capacity that admission counts prompts against, and the counters of finished requests
    that the attention backends and step transforms it loaded with add to /metrics."""

    vocab_size: int
    max_seq_len: int
    max_num_seqs: int  # sequences in one step (the batch)
    kv_capacity_tokens: int  # tokens the smallest full-attention KV group holds
    kv_pages_total: dict[str, int] = field(default_factory=dict)  # per group, the null page left out
    host_pages_total: dict[str, int] = field(default_factory=dict)  # groups with a host pool only
    request_counters: tuple = ()  # RequestCounter (runtime/attention/backend.py) of each method on
