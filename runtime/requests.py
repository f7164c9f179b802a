"""A request inside the engine: its completions (forks), how its prompt becomes token ids, what
it hands out (`Request.output()` when done, `Request.deltas()` while streaming), and each
fork's incremental detokenizer with its stop strings (`Detokenizer`).

A request of n (best_of) > 1 completions starts with fork 0, which computes the prompt; once its
prompt is done the others join the queue with the same prompt and start on its KV pages through
the prefix cache (`EngineCore`, runtime/engine_core.py).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch

from infhip.runtime.outputs import CompletionOutput, RequestOutput, StreamDelta, TokenLogprobs
from infhip.runtime.sampler import make_generator
from infhip.runtime.sampling_params import SEED_RANGE, SamplingParams
from infhip.runtime.sequence import Sequence


@dataclass(eq=False)
class Fork:
    """One completion of a request."""

    req: "Request"
    index: int
    seq: Sequence
    detok: Detokenizer
    generator: torch.Generator | None
    emitted_tokens: int = 0
    error: str | None = None  # why it failed (finish_reason "error"), else None
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # per output token, if computed
    emitted_logprobs: int = 0
    cumulative_logprob: float = 0.0
    final_sent: bool = False  # its last delta (with finish_reason) went out


@dataclass(eq=False)
class Request:
    """What `EngineCore.add_request` returns: the handle for `step`'s result, `deltas`, `abort`."""

    prompt: str | None
    params: SamplingParams  # as checked by for_engine (n, best_of, logprobs as asked)
    forks: list[Fork] = dataclasses.field(default_factory=list)
    spawned: bool = False  # forks 1.. exist (or never will: n = 1, or fork 0 ended first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def seq(self) -> Sequence:
        """Fork 0's sequence: the prompt, its admission, its cached tokens."""
        return self.forks[0].seq

    @property
    def request_id(self) -> int:
        return self.seq.seq_id

    @property
    def error(self) -> str | None:
        return next((f.error for f in self.forks if f.error), None)

    @property
    def is_finished(self) -> bool:
        return self.spawned and all(f.seq.is_finished for f in self.forks)

    def new_fork(self, index: int, seq_id: int, token_ids: list[int], tokenizer, device) -> Fork:
        """Fork `index`: its own params (seed + index; logprobs computed when best_of ranks by
        them; the prompt's logprobs are fork 0's), sequence, detokenizer, generator."""
        p = self.params
        seed = None if p.seed is None else p.seed + index
        if seed is not None and seed >= SEED_RANGE[1]:
            seed -= 1 << 64  # the same 64-bit seed, in range
        logprobs = p.logprobs if p.logprobs is not None else (0 if p.needs_logprobs else None)
        fp = dataclasses.replace(p, n=1, best_of=None, seed=seed, logprobs=logprobs,
                                 prompt_logprobs=p.prompt_logprobs if index == 0 else None)
        seq = Sequence(seq_id=seq_id, prompt_token_ids=token_ids, params=fp)
        return Fork(self, index, seq, Detokenizer(tokenizer, fp.stop), make_generator(seed, device))

    def completions(self) -> list[Fork]:
        """The forks the request returns: all n in index order, or with best_of the n of highest
        cumulative logprob, best first."""
        if self.params.num_forks == self.params.n:
            return self.forks
        return sorted(self.forks, key=lambda f: -f.cumulative_logprob)[:self.params.n]

    def output(self) -> RequestOutput:
        keep_lp = self.params.logprobs is not None
        outs = [CompletionOutput(i, list(f.seq.output_token_ids), f.detok.text, f.seq.finish_reason,
                                 list(f.logprobs) if keep_lp else None,
                                 f.cumulative_logprob if f.seq.params.needs_logprobs else None, f.error)
                for i, f in enumerate(self.completions())]
        first = outs[0]
        return RequestOutput(request_id=self.seq.seq_id, prompt=self.prompt,
                             prompt_token_ids=self.seq.prompt_token_ids, token_ids=first.token_ids,
                             text=first.text, finish_reason=first.finish_reason, error=self.error,
                             num_cached_tokens=self.seq.num_cached_tokens or 0, logprobs=first.logprobs,
                             prompt_logprobs=self.prompt_logprobs, outputs=outs)

    def deltas(self) -> list[StreamDelta]:
        """What the forks produced since their last deltas (each fork's last one carries its
        finish reason, and with "error" the error); the request's first delta carries the prompt
        logprobs. best_of > n: nothing until every fork is done, then the n kept, whole."""
        whole = self.params.num_forks > self.params.n
        if whole:
            if not self.is_finished or self.forks[0].final_sent:
                return []
            forks = list(enumerate(self.completions()))
            for f in self.forks:
                f.final_sent = True
                f.emitted_tokens = f.emitted_logprobs = 0
        else:
            forks = [(f.index, f) for f in self.forks]
        deltas = []
        for index, f in forks:
            seq = f.seq
            new_tokens = seq.output_token_ids[f.emitted_tokens:]
            f.emitted_tokens = len(seq.output_token_ids)
            text = f.detok.text if whole else f.detok.delta(final=seq.is_finished)
            done = seq.is_finished and not (f.final_sent and not whole)
            if not (new_tokens or text or done):
                continue
            f.final_sent = f.final_sent or seq.is_finished
            lps = None
            if self.params.logprobs is not None:
                lps, f.emitted_logprobs = f.logprobs[f.emitted_logprobs:], len(f.logprobs)
            deltas.append(StreamDelta(new_tokens, text, seq.finish_reason, f.error, self.seq.num_cached_tokens or 0,
                                      index, lps))
        if deltas and self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            deltas[0].prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return deltas


def prompt_ids(prompt: str | None, token_ids, tokenizer, vocab_size: int) -> list[int]:
    """The prompt as a list of token ids of the engine's vocabulary; ValueError says what is off."""
    if token_ids is None:
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer (built with --random-weights from a config); "
                             "pass prompt_token_ids instead of prompts")
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt must be a string, got {type(prompt).__name__}; "
                             "pass token ids as prompt_token_ids")
        token_ids = tokenizer(prompt)["input_ids"]
    ids = _int_list(token_ids)
    if ids is None:
        raise ValueError(f"prompt token ids must be a list of ints, got {token_ids!r:.80}")
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}); got {min(ids)}..{max(ids)}")
    return ids


def normalise(prompts, prompt_token_ids, sampling_params) -> list[tuple[str | None, list[int] | None, SamplingParams]]:
    """`LLM.generate`'s arguments as one (prompt, token ids, params) per request."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("pass exactly one of prompts or prompt_token_ids")
    if isinstance(prompts, str):
        prompts = [prompts]
    if prompt_token_ids is not None and prompt_token_ids and isinstance(prompt_token_ids[0], int):
        prompt_token_ids = [prompt_token_ids]
    n = len(prompts) if prompts is not None else len(prompt_token_ids)
    params = sampling_params if sampling_params is not None else SamplingParams()
    params = params if isinstance(params, list) else [params] * n
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return [(prompts[i] if prompts is not None else None,
             prompt_token_ids[i] if prompt_token_ids is not None else None, params[i]) for i in range(n)]


def _int_list(x) -> list[int] | None:
    """x as a list of ints (numpy's and torch's integers too), or None if it is not a sequence of
    integers (a string, a float, a bool)."""
    if isinstance(x, (str, bytes)) or not hasattr(x, "__iter__"):
        return None
    ids = []
    for t in x:
        if isinstance(t, bool):
            return None
        try:
            ids.append(operator.index(t))
        except TypeError:
            return None
    return ids


class Detokenizer:
    """A fork's text, decoded incrementally with its stop strings: the completion is re-decoded
    from its token ids (decoding a suffix alone mis-renders sentencepiece spaces); text is
    released only up to the last complete character and never past the start of a possible stop
    string, so a streamed delta is never taken back."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""  # full decoded completion so far (possibly cut at a stop string)
        self.emitted = 0  # characters of self.text already handed out

    def update(self, token_ids: list[int]) -> bool:
        """Decode the completion tokens; returns True when a stop string was found (text cut there)."""
        if self.tokenizer is None:
            return False
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more tokens
            text = text.rstrip("\ufffd")
        self.text = text
        for s in self.stop:
            # Search only where a new match can start: before the emitted text plus one stop length.
            at = text.find(s, max(0, self.emitted - len(s) + 1))
            if at >= 0:
                self.text = text[:at]
                return True
        return False

    def delta(self, final: bool) -> str:
        """New text safe to emit: hold back a tail that could still become a stop string."""
        safe = len(self.text) if final else max(self.emitted, len(self.text) - max(0, self.max_stop_len - 1))
        out = self.text[self.emitted:safe]
        self.emitted = safe
        return out
