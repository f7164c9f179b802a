"""Per-request sampling parameters: how many tokens to generate and how to pick each one.

    >>> from infhip import SamplingParams
    >>> p = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, stop="\\n\\n", seed=1)
    >>> p.stop, p.greedy
    (['\\n\\n'], False)
    >>> SamplingParams(temperature=0).greedy
    True
    >>> SamplingParams(top_p=1.5)
    Traceback (most recent call last):
        ...
    ValueError: SamplingParams.top_p must be in (0, 1], got 1.5

Checks that need the engine (top_k, stop_token_ids, logit_bias and bad words inside its
vocabulary, max_tokens lowered to the room max_seq_len leaves after the prompt, bad_words
tokenized) are `SamplingParams.for_engine`'s, which `LLM` applies to every request before it
is queued. How each field is applied on the device, and in which order: runtime/sampler.py.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from infhip.runtime.structured_output import StructuredOutputsParams

# torch.Generator.manual_seed takes any 64-bit value, signed or not (seed s < 0 acts as 2**64 + s).
SEED_RANGE = (-(1 << 63), 1 << 64)  # [lo, hi)
MAX_LOGPROBS = 20  # top-k logprobs per token at most (OpenAI's top_logprobs limit)
MAX_N = 128  # completions per prompt (n, best_of) at most
MAX_LOGIT_BIAS = 100.0  # |bias| at most (OpenAI's range)


def _is_int(x: object) -> bool:
    # bool is a subclass of int; `top_k=True` is a bug in the caller, not a 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How one request generates.

    max_tokens      tokens to generate at most (finish_reason "length" when reached); an engine
                    lowers it to what its max_seq_len leaves after the prompt (for_engine)
    temperature     0 = greedy (argmax); otherwise logits are divided by it before softmax
    top_p           nucleus sampling: keep the fewest most-likely tokens whose mass >= top_p
    top_k           keep the k most-likely tokens; 0 or -1 = off
    stop            strings that end generation (matched on detokenised text; not included)
    stop_token_ids  token ids that end generation (besides the model's EOS tokens)
    ignore_eos      keep generating past EOS (benchmarks)
    seed            per-request RNG seed, 64 bits: the same seed gives the same tokens; with
                    n / best_of > 1, completion i uses seed + i (mod 2**64), so it equals a
                    separate request with that seed
    n               completions to return for the prompt (forks after the prompt: they share
                    its KV pages through the prefix cache)
    best_of         completions to generate (>= n); the n with the highest sum of token
                    logprobs are returned. None = n
    logprobs        per generated token, its logprob and the `logprobs` most likely tokens'
                    (0 = the chosen token's only; None = off); raw model log-softmax, before
                    penalties / temperature (like vLLM's default and OpenAI)
    prompt_logprobs per prompt token (the first has none), its logprob and the top-k (None = off;
                    such a prompt is computed in full: the prefix cache is not read for it)
    presence_penalty   subtract it from the logit of every token already generated, in [-2, 2]
    frequency_penalty  subtract it times the token's count in the output so far, in [-2, 2]
    repetition_penalty > 0; a token seen in the prompt or the output has its logit divided
                    by it when positive, multiplied when negative (1 = off; CTRL / HF / vLLM)
    min_p           drop tokens whose probability is below min_p x the top token's, in [0, 1]
    min_tokens      EOS and stop_token_ids cannot be sampled before this many tokens
    logit_bias      {token id: bias in [-100, 100]} added to the logits
    bad_words       strings never generated: each is tokenized (as given and with a leading
                    space); its last token is banned where the output ends with the others
    priority        scheduling priority: lower values are admitted and prefilled first
                    (vLLM's convention); equal priorities are first come, first served
    structured_outputs  a StructuredOutputsParams (or a dict of its fields): the output must match
                    a JSON schema, any JSON object, a regex, a choice list or an EBNF grammar
                    (runtime/structured_output.py; None = free)
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    # Token-id sequences of bad_words (for_engine fills it with the engine's tokenizer); may
    # also be given directly (an engine without a tokenizer).
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None

    def __post_init__(self) -> None:
        def bad(field: str, need: str, got: object) -> ValueError:
            return ValueError(f"SamplingParams.{field} must be {need}, got {got!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1", self.max_tokens)
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0 (0 = greedy)", self.temperature)
        self.temperature = float(self.temperature)
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise bad("top_p", "in (0, 1]", self.top_p)
        self.top_p = float(self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an int >= 1, or 0 / -1 for off", self.top_k)

        # stop: None | str | list[str]  ->  list[str]
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise bad("stop", "a string or a list of strings", self.stop)
        if any(s == "" for s in stop):
            raise bad("stop", "non-empty strings (an empty stop string would match at once)",
                      self.stop)
        self.stop = list(stop)

        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise bad("stop_token_ids", "a list of token ids (ints >= 0)", self.stop_token_ids)
        self.stop_token_ids = list(ids)

        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool", self.ignore_eos)
        lo, hi = SEED_RANGE
        if self.seed is not None and not (_is_int(self.seed) and lo <= self.seed < hi):
            raise bad("seed", "an int or None, of 64 bits: in [-2**63, 2**64)", self.seed)
        self._check_sampling_features(bad)

    def _check_sampling_features(self, bad) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an int in [1, {MAX_N}]", self.n)
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_N):
            raise bad("best_of", f"None or an int in [n, {MAX_N}] (n = {self.n})", self.best_of)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, f"None or an int in [0, {MAX_LOGPROBS}]", v)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise bad(name, "a number in [-2, 2] (0 = off)", v)
            setattr(self, name, float(v))
        if not _is_number(self.repetition_penalty) or not (0 < self.repetition_penalty < math.inf):
            raise bad("repetition_penalty", "a finite number > 0 (1 = off)", self.repetition_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1] (0 = off)", self.min_p)
        self.min_p = float(self.min_p)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"an int in [0, max_tokens = {self.max_tokens}]", self.min_tokens)
        if self.logit_bias is not None:
            lb = self.logit_bias
            if not isinstance(lb, dict) or not all(
                    _is_int(t) and t >= 0 and _is_number(b) and abs(b) <= MAX_LOGIT_BIAS for t, b in lb.items()):
                raise bad("logit_bias", f"a dict {{token id (int >= 0): bias in [-{MAX_LOGIT_BIAS:g}, "
                                        f"{MAX_LOGIT_BIAS:g}]}}", lb)
            self.logit_bias = {int(t): float(b) for t, b in lb.items()} or None
        words = [] if self.bad_words is None else self.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
            raise bad("bad_words", "a list of non-blank strings", self.bad_words)
        self.bad_words = list(words) or None
        seqs = [] if self.bad_words_token_ids is None else self.bad_words_token_ids
        if not isinstance(seqs, (list, tuple)) or not all(
                isinstance(q, (list, tuple)) and q and all(_is_int(t) and t >= 0 for t in q) for q in seqs):
            raise bad("bad_words_token_ids", "a list of non-empty lists of token ids", self.bad_words_token_ids)
        self.bad_words_token_ids = [list(q) for q in seqs] or None
        if not _is_int(self.priority):
            raise bad("priority", "an int (lower = sooner)", self.priority)
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise bad("structured_outputs", "a dict of StructuredOutputsParams' fields (json, json_object, "
                                                "regex, choice, grammar, structural_tag)", self.structured_outputs) from e
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "a StructuredOutputsParams, a dict of its fields, or None",
                      self.structured_outputs)

    def for_engine(self, vocab_size: int, max_new_tokens: int, encode=None) -> SamplingParams:
        """A checked copy for one request on an engine with ``vocab_size`` tokens, where the
        prompt leaves room for ``max_new_tokens`` more. Every field is checked again (the
        dataclass is mutable; the copy shares no list with self), top_k, stop_token_ids,
        logit_bias and bad words must lie in the vocabulary (ValueError), and max_tokens above
        the room is lowered to it: the request then ends with finish_reason "length" there, as
        it would at max_seq_len. encode(text) -> token ids (no special tokens) tokenizes
        bad_words; without it, bad_words is an error."""
        p = dataclasses.replace(self)
        if p.bad_words:
            if encode is None:
                raise ValueError("SamplingParams.bad_words needs a tokenizer; this engine has none: give "
                                 "bad_words_token_ids instead")
            seqs = list(p.bad_words_token_ids or [])
            for w in p.bad_words:  # as given and after a space: a word mid-text is tokenized with one
                for form in dict.fromkeys((w, w if w.startswith(" ") else " " + w)):
                    ids = list(encode(form))
                    if ids and ids not in seqs:
                        seqs.append(ids)
            p.bad_words_token_ids = seqs or None
        for name, ids in (("logit_bias", list(p.logit_bias or ())),
                          ("bad_words_token_ids", [t for q in p.bad_words_token_ids or () for t in q])):
            if any(t >= vocab_size for t in ids):
                raise ValueError(f"SamplingParams.{name} must name token ids of this engine, in "
                                 f"[0, {vocab_size}); got {max(ids)}")
        if p.top_k > vocab_size:
            raise ValueError(f"SamplingParams.top_k must be at most the vocabulary size {vocab_size} "
                             f"(or 0 / -1 for off), got {p.top_k}")
        outside = [t for t in p.stop_token_ids if t >= vocab_size]
        if outside:
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids of this engine, in "
                             f"[0, {vocab_size}); got {outside[:3]}{' ...' if len(outside) > 3 else ''}")
        p.max_tokens = min(p.max_tokens, max_new_tokens)
        p.min_tokens = min(p.min_tokens, p.max_tokens)
        return p

    @property
    def num_forks(self) -> int:
        """Completions generated for the prompt (best_of, else n)."""
        return self.best_of or self.n

    @property
    def needs_logprobs(self) -> bool:
        """Whether the sampler computes the chosen token's logprob (asked for, or best_of ranks
        the completions by it)."""
        return self.logprobs is not None or self.num_forks > self.n

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        """Deterministic argmax decoding (temperature 0); top_k / top_p / seed do not matter."""
        return self.temperature == 0
