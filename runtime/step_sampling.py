"""The batched half of a step: the runner's forward, the sampler's draw for the rows that need a
token (one batch, or back-to-back decode steps on the device), the step's one host read of the
tokens and their logprobs, and the prompt's logprobs from the forward's hidden rows.

Its boundary: `StepSampler` is handed the engine's parts once, at load (runner, sampler, penalty
slots, kernel store, vocabulary size, end-of-sequence ids) and, per call, the step's rows: the
scheduler's output and each chunk's `Fork` (runtime/requests.py: its sequence, generator and
request), and the structured-output runtime when one exists. It returns tokens, logprob records
and the rows whose sampling raised; it commits nothing and calls back into nothing: the engine
core (runtime/engine_core.py `EngineCore.step`) hands the results to the scheduler and the
detokenizers, and fails the rows that raised.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from infhip.plugins.sampling import logprobs
from infhip.runtime.kernel_store import serving
from infhip.runtime.outputs import TokenLogprobs
from infhip.runtime.penalty_slots import PenaltySlots
from infhip.runtime.requests import Fork
from infhip.runtime.sampler import Sampler, SamplerOutput, SamplingBatch
from infhip.runtime.scheduler import SchedulerOutput
from infhip.runtime.sequence import Sequence
from infhip.runtime.structured_output import GrammarRuntime

_log = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 512  # prompt positions per LM-head slice ([rows, vocab] float32 at a time)


class StepSampler:
    """A core's forward and sampling (the module docstring gives its boundary)."""

    def __init__(self, runner, sampler: Sampler, penalty_slots: PenaltySlots, kernels, vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        self.runner, self.sampler, self.penalty_slots = runner, sampler, penalty_slots
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids
        # the engine's JIT policy over the sampler's launches; an engine without a kernel store
        # (a CPU engine) has none to apply, and kernel_store is not called per step
        self.launches = functools.partial(serving, kernels) if kernels is not None else contextlib.nullcontext

    def forward(self, out: SchedulerOutput, forks: list[Fork]) -> torch.Tensor:
        """The step's logits (rows: the chunks with needs_logits; forks: each chunk's); the
        prompt logprobs of the requests that ask, from the hidden rows the runner keeps for them."""
        rows, spans = _prompt_rows(out, forks)
        # (hidden_rows only when asked: tools and tests wrap execute(out))
        logits = self.runner.execute(out, hidden_rows=rows) if rows else self.runner.execute(out)
        if spans:
            _record_prompt_logprobs(self.runner.model.compute_logits, self.runner.hidden_out, spans)
        return logits

    def batch(self, forks: list[Fork], grammars: GrammarRuntime | None) -> SamplingBatch:
        """The sampler's view of these forks' rows for this step (runtime/sampler.py: penalized
        rows keep their counts on the device in penalty_slots), with the token bitmask of those
        under a grammar (runtime/structured_output.py)."""
        seqs = [f.seq for f in forks]
        batch = SamplingBatch([s.params for s in seqs], [f.generator for f in forks], self.runner.device,
                              self.vocab_size, [(s.prompt_token_ids, s.output_token_ids) for s in seqs],
                              self.eos_token_ids, self.penalty_slots, seqs)
        if grammars is not None:
            grammars.apply(batch, seqs)
        return batch

    def sample(self, logits: torch.Tensor, forks: list[Fork], grammars: GrammarRuntime | None
               ) -> tuple[dict[int, int], dict[int, TokenLogprobs], list[tuple[Fork, Exception]]]:
        """(seq_id -> token, seq_id -> its logprobs where asked, the (fork, exception) of each row
        that failed) for the rows of ``forks`` (logits rows in that order), sampled as one batch;
        if that raises, row by row, so that only the rows that raise fail. (A seeded row may then
        draw different noise than it would have: the failed batch call may have advanced its
        generator.)"""
        if not forks:
            return {}, {}, []
        try:
            with self.launches():  # the sampler's kernels are the engine's too
                so = self.sampler.sample(logits, self.batch(forks, grammars))
            [tokens], [lps] = read_samples([so])  # the step's one host read
            seqs = [f.seq for f in forks]
            return {s.seq_id: t for s, t in zip(seqs, tokens)}, logprob_records(so, seqs, tokens, lps), []
        except Exception:  # noqa: BLE001 - find the request(s) at fault below
            _log.warning("batched sampling failed; sampling each request alone", exc_info=True)
        sampled, lps, failed = {}, {}, []
        for i, f in enumerate(forks):
            try:
                with self.launches():
                    so = self.sampler.sample(logits[i:i + 1], self.batch([f], grammars))
                [tokens], [flat] = read_samples([so])
                sampled[f.seq.seq_id] = tokens[0]
                lps.update(logprob_records(so, [f.seq], tokens, flat))
            except Exception as e:  # noqa: BLE001 - this request fails alone
                failed.append((f, e))
        return sampled, lps, failed

    def decode_steps(self, out: SchedulerOutput, forks: list[Fork], num_steps: int,
                     grammars: GrammarRuntime | None) -> tuple[list[list[int]], list[dict]]:
        """(tokens[j][b]: the token of out's chunk b at decode step j, and per step the
        seq_id -> logprobs of the rows that ask), sampled on the device, in the batched part
        (a sampling fault here fails the whole step); the batch's penalty state advances on the
        device between steps."""
        batch, outs = self.batch(forks, grammars), []
        seqs = [f.seq for f in forks]
        # grammar rows: step j's tokens reach the host (pinned copy + event) while step j + 1's
        # forward runs; the matchers advance and the next bitmask fills then (structured_output.py)
        to_host = _TokensToHost(num_steps, len(forks), self.runner.device) if batch.token_bitmask is not None else None

        def sample(logits: torch.Tensor) -> torch.Tensor:
            if to_host is not None and outs:  # this step's forward is queued: the host work overlaps it
                grammars.advance(batch, seqs, to_host.read(len(outs) - 1))
            outs.append(self.sampler.sample(logits, batch))
            if to_host is not None:
                to_host.start(len(outs) - 1, outs[-1].tokens)
            return outs[-1].tokens

        self.runner.execute_decode_steps(out, num_steps, sample)
        tokens, flats = read_samples(outs)  # the one host read of the whole run (grammar rows: the last)
        return tokens, [logprob_records(so, seqs, row, flat) for so, row, flat in zip(outs, tokens, flats)]


class _TokensToHost:
    """Each step's sampled tokens [B] copied to the host as soon as they are drawn (a pinned
    buffer and an event on CUDA), so that the host can wait for exactly them while the next
    step's forward, queued after them, runs."""

    def __init__(self, num_steps: int, b: int, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.host = torch.empty(num_steps, b, dtype=torch.int64, pin_memory=self.cuda)
        self.events: list = [None] * num_steps

    def start(self, j: int, tokens: torch.Tensor) -> None:
        self.host[j].copy_(tokens, non_blocking=self.cuda)
        if self.cuda:
            self.events[j] = torch.cuda.Event()
            self.events[j].record()

    def read(self, j: int) -> list[int]:
        if self.events[j] is not None:
            self.events[j].synchronize()
        return self.host[j].tolist()


# -- the host read and logprob records ----------------------------------------------------------

def unpack_logprobs(flat: list[float], chosen: list[int], k: int) -> list[TokenLogprobs]:
    w = 2 + 2 * k
    out = []
    for j, tok in enumerate(chosen):
        r = flat[j * w:(j + 1) * w]
        out.append(TokenLogprobs(tok, r[0], int(r[1]), [(int(i), x) for x, i in zip(r[2:2 + k], r[2 + k:])]))
    return out


def read_samples(outs: list[SamplerOutput]) -> tuple[list[list[int]], list[list[float] | None]]:
    """The tokens of each SamplerOutput and its packed logprobs (`logprob_records`' input, None
    where no row asked), read to the host in one copy: float64 holds token ids, ranks and the
    float32 logprobs exactly."""
    parts = [torch.stack([so.tokens for so in outs]).flatten().double()]
    sizes = []
    for so in outs:
        parts += [so.logprobs.flatten().double()] if so.logprob_rows else []
        sizes.append(so.logprobs.numel() if so.logprob_rows else 0)
    flat = torch.cat(parts).tolist()
    b = outs[0].tokens.numel()
    tokens = [[int(t) for t in flat[j * b:(j + 1) * b]] for j in range(len(outs))]
    at, lps = len(outs) * b, []
    for n in sizes:
        lps.append(flat[at:at + n] if n else None)
        at += n
    return tokens, lps


def logprob_records(so: SamplerOutput, seqs: list[Sequence], tokens: list[int],
                    flat: list[float] | None) -> dict[int, TokenLogprobs]:
    """seq_id -> the sampled token's TokenLogprobs (top cut to the row's own k) for the rows of
    ``so`` that computed them; tokens and flat: as `read_samples` read them."""
    if not so.logprob_rows:
        return {}
    recs = unpack_logprobs(flat, [tokens[row] for row in so.logprob_rows], so.top_k)
    out = {}
    for row, r in zip(so.logprob_rows, recs):
        seq = seqs[row]
        r.top = r.top[:seq.params.logprobs or 0]
        out[seq.seq_id] = r
    return out


def _prompt_rows(out: SchedulerOutput, forks: list[Fork]) -> tuple[list[int], list[tuple[object, int, int]]]:
    """prompt_logprobs: (the step's hidden rows to keep, and per request (req, lo, hi): those
    rows are positions [lo, hi), each predicting the prompt token after it); forks: each
    chunk's."""
    rows, spans, row0 = [], [], 0
    for ch, fork in zip(out.chunks, forks):
        seq = ch.seq
        if seq.params.prompt_logprobs is not None:
            hi = min(ch.end, seq.num_prompt_tokens - 1)
            if ch.start < hi:
                rows += range(row0 + 0, row0 + hi - ch.start)
                spans.append((fork.req, ch.start, hi))
        row0 += ch.num_tokens
    return rows, spans


@torch.inference_mode()
def _record_prompt_logprobs(compute_logits, hidden: torch.Tensor, spans: list[tuple[object, int, int]]) -> None:
    """Fill req.prompt_logprobs[lo + 1 : hi + 1] from the hidden states of positions [lo, hi)
    (in spans' order), LM head (``compute_logits``) and logprobs (plugins/sampling.py, as for
    sampled tokens) a slice of rows at a time (a long prompt's logits at once would be
    [tokens, vocab])."""
    targets = [t for req, lo, hi in spans for t in req.seq.prompt_token_ids[lo + 1:hi + 1]]
    k = max(req.params.prompt_logprobs for req, _, _ in spans)
    tgt = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    packed = []
    for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        x = compute_logits(hidden[i:i + PROMPT_LOGPROB_ROWS])
        rows = torch.arange(x.shape[0], device=x.device)
        packed.append(logprobs(x, rows, tgt[i:i + PROMPT_LOGPROB_ROWS], k).flatten())
    recs = unpack_logprobs(torch.cat(packed).tolist(), targets, k)
    j = 0
    for req, lo, hi in spans:
        kk = req.params.prompt_logprobs
        for pos in range(lo + 1, hi + 1):
            r = recs[j]
            req.prompt_logprobs[pos] = TokenLogprobs(r.token_id, r.logprob, r.rank, r.top[:kk])
            j += 1
