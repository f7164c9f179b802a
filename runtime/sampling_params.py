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

Checks that need the engine (top_k and stop_token_ids inside its vocabulary, max_tokens lowered
to the room max_seq_len leaves after the prompt) are `SamplingParams.for_engine`'s, which
`LLM` applies to every request before it is queued.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# torch.Generator.manual_seed takes any 64-bit value, signed or not (seed s < 0 acts as 2**64 + s).
SEED_RANGE = (-(1 << 63), 1 << 64)  # [lo, hi)


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
    seed            per-request RNG seed, 64 bits: the same seed gives the same tokens
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

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

    def for_engine(self, vocab_size: int, max_new_tokens: int) -> SamplingParams:
        """A checked copy for one request on an engine with ``vocab_size`` tokens, where the
        prompt leaves room for ``max_new_tokens`` more. Every field is checked again (the
        dataclass is mutable; the copy shares no list with self), top_k and stop_token_ids must
        lie in the vocabulary (ValueError), and max_tokens above the room is lowered to it: the
        request then ends with finish_reason "length" there, as it would at max_seq_len."""
        p = dataclasses.replace(self)
        if p.top_k > vocab_size:
            raise ValueError(f"SamplingParams.top_k must be at most the vocabulary size {vocab_size} "
                             f"(or 0 / -1 for off), got {p.top_k}")
        outside = [t for t in p.stop_token_ids if t >= vocab_size]
        if outside:
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids of this engine, in "
                             f"[0, {vocab_size}); got {outside[:3]}{' ...' if len(outside) > 3 else ''}")
        p.max_tokens = min(p.max_tokens, max_new_tokens)
        return p

    @property
    def greedy(self) -> bool:
        """Deterministic argmax decoding (temperature 0); top_k / top_p / seed do not matter."""
        return self.temperature == 0
