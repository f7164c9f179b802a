"""One request as the scheduler sees it: its token ids, how far its KV cache is computed,
and whether it is waiting, running or finished.

A sequence's tokens are ``prompt_token_ids + output_token_ids``. ``num_computed_tokens`` of
them (a prefix) have their keys/values in the KV cache; the rest are computed by the next
scheduled chunks. Every token but the newest sampled one is computed before the next token is
sampled, so a decoding sequence has exactly one uncomputed token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from infhip.runtime.sampling_params import SamplingParams

# "error": the engine failed this request alone (LLM: the request's `error` says why).
FINISH_REASONS = ("stop", "length", "abort", "error")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted: its KV was dropped and is recomputed)
    RUNNING = "running"  # holds KV pages; gets a chunk most steps
    FINISHED = "finished"


# eq=False: sequences are compared by identity (two requests with equal tokens are different
# requests), which also keeps `seq in list` / `list.remove(seq)` O(1) per comparison.
@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (a prefix of all_token_ids)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    arrival: int = 0  # admission order, stamped by Scheduler.add (FIFO key; newest is preempted first)
    # Prefix caching: prompt tokens found in the cache at the first admission (None: not admitted yet).
    num_cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.seq_id, bool) or not isinstance(self.seq_id, int):
            raise ValueError(f"Sequence.seq_id must be an int, got {self.seq_id!r}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"Sequence.params must be a SamplingParams, got {type(self.params).__name__}")
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.output_token_ids = [int(t) for t in self.output_token_ids]
        if not 0 <= self.num_computed_tokens <= self.num_tokens:
            raise ValueError(f"Sequence.num_computed_tokens must be in [0, {self.num_tokens}], "
                             f"got {self.num_computed_tokens}")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Sequence.finish_reason must be one of {FINISH_REASONS} or None, "
                             f"got {self.finish_reason!r}")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens}, finish_reason={self.finish_reason!r})")


def check_stop_token(seq: Sequence, token_id: int, eos_token_ids: tuple[int, ...]) -> str | None:
    """Why ``seq`` stops after ``token_id`` (already appended to its output), or None.

    "stop": an EOS token (unless ``params.ignore_eos``) or one of ``params.stop_token_ids``;
    "length": ``params.max_tokens`` outputs reached. Stop *strings* need detokenised text and are
    checked by the caller, which then calls ``Scheduler.finish(seq, "stop")``.
    """
    p = seq.params
    if (token_id in eos_token_ids and not p.ignore_eos) or token_id in p.stop_token_ids:
        return "stop"
    if seq.num_output_tokens >= p.max_tokens:
        return "length"
    return None
