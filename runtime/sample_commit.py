"""The second half of `EngineCore.step` (runtime/engine_core.py): run the forward, sample the
scheduled rows (one batch, or back-to-back decode steps on the device), and commit each
request's tokens to the scheduler and its detokenizer, request by request so that a fault in
one fails it alone. One `SampleAndCommit` per core, which holds it; everything it works on is
handed to it (its constructor says what), it reaches into no core attribute."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from infhip.runtime.kernel_store import serving
from infhip.runtime.logprobs import logprob_records, prompt_rows, read_samples, record_prompt_logprobs
from infhip.runtime.outputs import TokenLogprobs
from infhip.runtime.penalty_slots import PenaltySlots
from infhip.runtime.requests import Fork, Request
from infhip.runtime.sampler import Sampler, SamplingBatch
from infhip.runtime.sampling_params import SamplingParams
from infhip.runtime.scheduler import ScheduledChunk, SchedulerOutput
from infhip.runtime.sequence import SequenceStatus
from infhip.runtime.structured_output import GrammarRuntime

_log = logging.getLogger(__name__)


# fail(fork, stage, exc, touched): finish one fork with an error (EngineCore._fail)
FailFork = Callable[[Fork, str, BaseException, dict[int, Request]], None]


class SampleAndCommit:
    """A core's forward, sampling and commit. Inputs: the runner (forward), the scheduler (commits,
    decode-step reservations), the sampler and the penalized rows' device counts, the engine's
    kernel store (the sampler's kernels are served from it), the vocabulary size and end-of-
    sequence ids; ``forks`` the core's live forks by seq_id (read only); ``grammars()`` the
    structured-output runtime once the core has made one (None before); ``fail`` and ``spawn``
    the core's actions on a fork that fails and on a request whose fork 0 computed its prompt."""

    def __init__(self, *, runner, scheduler, sampler: Sampler, penalty_slots: PenaltySlots, kernels,
                 vocab_size: int, eos_token_ids: tuple[int, ...], forks: Mapping[int, Fork],
                 grammars: Callable[[], GrammarRuntime | None], fail: FailFork, spawn: Callable[[Request], None]):
        self.runner, self.scheduler, self.sampler, self.penalty_slots = runner, scheduler, sampler, penalty_slots
        self.kernels, self.vocab_size, self.eos_token_ids = kernels, vocab_size, eos_token_ids
        self._forks, self._grammars, self._fail, self._spawn = forks, grammars, fail, spawn

    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """The step's logits (rows: the chunks with needs_logits); the prompt logprobs of the
        chunks that ask, from the hidden rows the runner keeps for them."""
        rows, spans = prompt_rows(out, lambda seq: self._forks[seq.seq_id].req)
        # (hidden_rows only when asked: tools and tests wrap execute(out))
        logits = self.runner.execute(out, hidden_rows=rows) if rows else self.runner.execute(out)
        if spans:
            record_prompt_logprobs(self.runner.model.compute_logits, self.runner.hidden_out, spans)
        return logits

    def _batch(self, forks: list[Fork]) -> SamplingBatch:
        """The sampler's view of these forks' rows for this step (runtime/sampler.py: penalized
        rows keep their counts on the device in penalty_slots), with the token
        bitmask of those under a grammar (runtime/structured_output.py)."""
        batch = SamplingBatch([f.seq.params for f in forks], [f.generator for f in forks], self.runner.device,
                              self.vocab_size,
                              [(f.seq.prompt_token_ids, f.seq.output_token_ids) for f in forks], self.eos_token_ids,
                              self.penalty_slots, [f.seq for f in forks])
        grammars = self._grammars()
        if grammars is not None:
            grammars.apply(batch, [f.seq for f in forks])
        return batch

    def sample(self, logits: torch.Tensor, out: SchedulerOutput,
               touched: dict[int, Request]) -> tuple[dict[int, int], dict[int, TokenLogprobs]]:
        """(seq_id -> token, seq_id -> its logprobs where asked) for the chunks with needs_logits
        (logits rows in chunk order), sampled as one batch; if that raises, row by row, so that
        only the rows that raise fail. (A seeded row may then draw different noise than it would
        have: the failed batch call may have advanced its generator.)"""
        forks = [self._forks[ch.seq.seq_id] for ch in out.chunks if ch.needs_logits]
        if not forks:
            return {}, {}
        try:
            with serving(self.kernels):  # the sampler's kernels are the engine's too
                so = self.sampler.sample(logits, self._batch(forks))
            [tokens], [lps] = read_samples([so])  # the step's one host read
            return {f.seq.seq_id: t for f, t in zip(forks, tokens)}, logprob_records(so, [f.seq for f in forks],
                                                                                     tokens, lps)
        except Exception:  # noqa: BLE001 - find the request(s) at fault below
            _log.warning("batched sampling failed; sampling each request alone", exc_info=True)
        sampled, lps = {}, {}
        for i, f in enumerate(forks):
            try:
                with serving(self.kernels):
                    so = self.sampler.sample(logits[i:i + 1], self._batch([f]))
                [tokens], [flat] = read_samples([so])
                sampled[f.seq.seq_id] = tokens[0]
                lps.update(logprob_records(so, [f.seq], tokens, flat))
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(f, "while sampling its token", e, touched)
        return sampled, lps

    def commit(self, out: SchedulerOutput, sampled: dict[int, int], logprobs: dict[int, TokenLogprobs],
               touched: dict[int, Request]) -> None:
        """Hand one executed step to the scheduler and apply stop strings to the new text, request
        by request: a fault in one request's bookkeeping or detokenizing fails it alone."""
        for ch in out.chunks:
            seq = ch.seq
            if seq.is_finished:  # failed while sampling
                continue
            fork = self._forks[seq.seq_id]
            try:
                self.scheduler.update(SchedulerOutput(chunks=[ch]), sampled, self.eos_token_ids)
                if ch.needs_logits:
                    lp = logprobs.get(seq.seq_id)
                    if lp is not None:
                        fork.logprobs.append(lp)
                        fork.cumulative_logprob += lp.logprob
                    if fork.detok.update(seq.output_token_ids) and not seq.is_finished:
                        self.scheduler.finish(seq, "stop")
                    if not fork.req.spawned:  # fork 0's prompt is computed: the others start on it
                        self._spawn(fork.req)
                    touched[fork.req.seq.seq_id] = fork.req
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(fork, "while taking its new token (stop checks, detokenizing)", e, touched)

    def num_decode_steps(self, out: SchedulerOutput, k: int) -> int:
        """How many decode steps to run back to back for this step, at most k (the core's
        num_decode_steps, read live: benchmarks change it); 1 = an ordinary step."""
        if (k <= 1 or out.num_decodes != len(out.chunks) or out.preempted or self.scheduler.num_waiting
                or any(ch.start + k > self.runner.max_seq_len for ch in out.chunks)
                or any(_host_each_step(ch.seq.params) for ch in out.chunks)):
            return 1
        return k if self.scheduler.reserve_decode_steps(out, k) else 1

    def decode_steps(self, out: SchedulerOutput, num_steps: int) -> tuple[list[list[int]], list[dict]]:
        """(tokens[j][b]: the token of out's chunk b at decode step j, and per step the
        seq_id -> logprobs of the rows that ask), sampled on the device, in the batched part
        (a sampling fault here fails the whole step); the batch's penalty state advances on the
        device between steps."""
        forks = [self._forks[ch.seq.seq_id] for ch in out.chunks]
        batch, outs = self._batch(forks), []
        seqs = [f.seq for f in forks]
        # grammar rows: step j's tokens reach the host (pinned copy + event) while step j + 1's
        # forward runs; the matchers advance and the next bitmask fills then (structured_output.py)
        to_host = _TokensToHost(num_steps, len(forks), self.runner.device) if batch.token_bitmask is not None else None

        def sample(logits: torch.Tensor) -> torch.Tensor:
            if to_host is not None and outs:  # this step's forward is queued: the host work overlaps it
                self._grammars().advance(batch, seqs, to_host.read(len(outs) - 1))
            outs.append(self.sampler.sample(logits, batch))
            if to_host is not None:
                to_host.start(len(outs) - 1, outs[-1].tokens)
            return outs[-1].tokens

        self.runner.execute_decode_steps(out, num_steps, sample)
        tokens, flats = read_samples(outs)  # the one host read of the whole run (grammar rows: the last)
        return tokens, [logprob_records(so, seqs, row, flat) for so, row, flat in zip(outs, tokens, flats)]

    def commit_decode_steps(self, out: SchedulerOutput, tokens: list[list[int]], logprobs: list[dict],
                            touched: dict[int, Request]) -> None:
        """Commit the decode steps one by one; a sequence that stops (or fails) takes no more."""
        seqs = [ch.seq for ch in out.chunks]
        for j, row in enumerate(tokens):
            live = [(b, seq) for b, seq in enumerate(seqs) if seq.status is SequenceStatus.RUNNING]
            if not live:
                break
            step_out = out if j == 0 else SchedulerOutput(
                chunks=[ScheduledChunk(seq, seq.num_computed_tokens, 1) for _, seq in live])
            self.commit(step_out, {seq.seq_id: row[b] for b, seq in live}, logprobs[j], touched)


def _host_each_step(p: SamplingParams) -> bool:
    """Whether a request's sampling needs the host between decode steps in a way back-to-back
    steps cannot give it (then the engine runs one at a time): a multi-token bad word is
    matched against the committed output on the host. (A grammar advances on the host too, but
    inside the run: `SampleAndCommit.decode_steps`.)"""
    return any(len(q) > 1 for q in p.bad_words_token_ids or ())


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
