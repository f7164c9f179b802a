"""Continuous batching with chunked prefill: which tokens of which sequences run this step.

Every step requests join and leave. ``schedule()`` gives, within a token budget
(``max_num_batched_tokens``) and ``max_num_seqs`` running sequences:
  1. one decode chunk to each RUNNING sequence with exactly one uncomputed token (oldest
     first). Without a free page a RUNNING sequence is preempted (pages freed, back to the
     FRONT of its priority in the waiting queue, recomputed from scratch later): the one of
     the worst priority (highest ``SamplingParams.priority``), the most recently arrived among
     those (vLLM's rule: an urgent request never loses its KV to a less urgent one);
  2. prefill chunks to partially prefilled RUNNING sequences, then to WAITING ones (in
     priority order, FIFO within a priority: ``SamplingParams.priority``, lower first), each
     ``min(uncomputed, remaining budget)`` tokens. A waiting sequence that does not fit stays
     at the head of the queue: nobody skips past it. Priority: a waiting sequence of a better
     priority than a partially prefilled one goes before it, so a short urgent request is
     admitted (and then decodes, step 1) while a long prompt is still being prefilled chunk by
     chunk. With prefix caching a waiting
     sequence starts with the cached pages of its longest reusable prefix
     (``KVCacheManager.share``) and its first chunk starts there; ``update()`` offers every page
     that a chunk fills to the cache (``KVCacheManager.register``); ``prefix_filter`` leaves
     some sequences out of both (token drop: those that may drop).
The executor runs the chunks, samples one token per chunk with ``needs_logits`` and hands them
to ``update()``, which advances the sequences and retires the finished ones.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from infhip.runtime.kv_cache import KVCacheManager, OutOfPages
from infhip.runtime.sequence import FINISH_REASONS, Sequence, SequenceStatus, check_stop_token


@dataclass
class ScheduledChunk:
    """Positions [start, start + num_tokens) of ``seq`` computed this step."""

    seq: Sequence
    start: int
    num_tokens: int
    # Fixed at scheduling time (update() appends a token, which would flip a live property).
    needs_logits: bool = field(init=False)  # completes all known tokens: sample one more
    is_decode: bool = field(init=False)  # one query over a fully cached prefix (step 1)

    def __post_init__(self) -> None:
        if not (0 <= self.start and self.num_tokens >= 1 and self.end <= self.seq.num_tokens):
            raise ValueError(f"chunk [{self.start}, {self.end}) outside sequence "
                             f"{self.seq.seq_id} of {self.seq.num_tokens} tokens")
        self.needs_logits = self.end == self.seq.num_tokens
        self.is_decode = self.num_tokens == 1 and self.start > 0 and self.needs_logits

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decode chunks first (chunks[:num_decodes]), then prefills
    preempted: list[Sequence] = field(default_factory=list)  # lost their KV this step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decodes(self) -> int:
        n = 0
        while n < len(self.chunks) and self.chunks[n].is_decode:
            n += 1
        return n

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class _Step:
    """Scratch state of one schedule() call."""

    def __init__(self, budget: int):
        self.budget = budget
        self.decodes: list[ScheduledChunk] = []
        self.prefills: list[ScheduledChunk] = []
        self.preempted: list[Sequence] = []

    def add(self, chunk: ScheduledChunk, decode: bool) -> None:
        (self.decodes if decode else self.prefills).append(chunk)
        self.budget -= chunk.num_tokens

    def retract(self, seq: Sequence) -> None:
        """Drop ``seq``'s chunk (it was preempted after being scheduled) and refund its tokens."""
        for lst in (self.decodes, self.prefills):
            for i, c in enumerate(lst):
                if c.seq is seq:
                    self.budget += c.num_tokens
                    del lst[i]
                    return


def _victim_key(seq: Sequence) -> tuple[int, int]:
    """Preemption order: the largest key goes first (worst priority, then the newest)."""
    return seq.params.priority, seq.arrival


def _queue_key(seq: Sequence) -> tuple[int, int]:
    """Waiting-queue order: priority (lower first), then arrival (a preempted sequence keeps its
    arrival, so it goes back before the later ones of its priority)."""
    return seq.params.priority, seq.arrival


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_seq_len: int):
        for name, v in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_seq_len", max_seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Scheduler.{name} must be an int >= 1, got {v!r}")
        if max_seq_len > kv.max_pages_per_seq * kv.page_size:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the page table "
                             f"({kv.max_pages_per_seq} pages x {kv.page_size} tokens)")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_seq_len = max_seq_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival: oldest first
        self._ids: set[int] = set()  # unfinished seq ids
        self._next_arrival = 0
        self.num_preemptions = 0  # since start (infhip-serve's /metrics)
        # Prefix caching: which sequences may start on cached pages and name theirs (None: all).
        # Token drop: only those that never drop (their pages are not compacted).
        self.prefix_filter: Callable[[Sequence], bool] | None = None
        # Called with each sequence whose KV pages were freed, after its status changed (finished,
        # or preempted: WAITING, recomputed from 0): the engine core tells the step transforms,
        # whose per-sequence state describes that KV (token drop's drop histories).
        self.on_free: Callable[[Sequence], None] | None = None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence, arrival: int | None = None) -> None:
        """Queue a new request (by priority, then FIFO). Stamps ``seq.arrival`` (``arrival``: an
        earlier request's, to queue beside it: the forks of an n > 1 request take their first's)."""
        n = seq.num_prompt_tokens
        if n == 0:
            raise ValueError(f"request {seq.seq_id} has an empty prompt; give at least one token")
        if n > self.max_seq_len:
            raise ValueError(f"request {seq.seq_id}: prompt of {n} tokens exceeds max_seq_len "
                             f"{self.max_seq_len}; shorten it or rebuild the engine with a larger "
                             f"--max-seq-len")
        for g, spec in self.kv.groups.items():
            need = self.kv.pages_needed(g, n, self.max_num_batched_tokens)
            if need > spec.num_pages - 1:
                raise ValueError(f"request {seq.seq_id}: prompt of {n} tokens needs {need} KV pages "
                                 f"in group {g!r}, the cache has {spec.num_pages - 1}; give the KV "
                                 f"cache more memory or shorten the prompt")
            host = self.kv.host_pages_needed(g, n)
            if spec.offload is not None and host > spec.offload.host_pages:
                raise ValueError(f"request {seq.seq_id}: prompt of {n} tokens offloads up to {host} KV pages "
                                 f"in group {g!r}, the host pool has {spec.offload.host_pages}; give "
                                 f"kv_offload_bytes more memory or shorten the prompt")
        if seq.seq_id in self._ids:
            raise ValueError(f"seq_id {seq.seq_id} is already in use by an unfinished request")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"request {seq.seq_id} must be new (WAITING, nothing computed)")
        if arrival is None:
            arrival = self._next_arrival
            self._next_arrival += 1
        seq.arrival = arrival
        self._ids.add(seq.seq_id)
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """Into the waiting queue at its place (_queue_key)."""
        if not self.waiting or _queue_key(self.waiting[-1]) <= _queue_key(seq):
            self.waiting.append(seq)  # the common case: no priorities, FIFO
        else:
            self.waiting.insert(bisect.bisect_right(self.waiting, _queue_key(seq), key=_queue_key), seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire ``seq`` (e.g. "stop" on a stop string, "abort"): free its pages. Idempotent."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        self._ids.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if self.on_free is not None:
            self.on_free(seq)

    # ---- scheduling ---------------------------------------------------------------------
    def _preempt(self, victim: Sequence, step: _Step) -> None:
        step.retract(victim)
        self.running.remove(victim)
        self.kv.free(victim.seq_id)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        self._enqueue(victim)  # by its arrival: before the later ones of its priority
        step.preempted.append(victim)
        self.num_preemptions += 1
        if self.on_free is not None:
            self.on_free(victim)

    def _victim(self) -> Sequence:
        """The running sequence to preempt next (_victim_key)."""
        return max(self.running, key=_victim_key)

    def _alone_error(self, seq: Sequence, end: int) -> RuntimeError:
        free = {g: self.kv.num_free_pages(g) for g in self.kv.groups}
        return RuntimeError(
            f"sequence {seq.seq_id} cannot get KV pages for positions up to {end - 1} even with "
            f"every other sequence preempted (free pages per group: {free}); the KV cache is "
            f"too small for max_seq_len {self.max_seq_len}: give it more memory or lower "
            f"--max-seq-len")

    def _fit(self, seq: Sequence, start: int, end: int) -> int:
        """Largest e in [start, end] with can_append(start, e) (start if none): pages only
        grow with e, so binary search."""
        if self.kv.can_append(seq.seq_id, start, end):
            return end
        lo, hi = start, end - 1  # answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kv.can_append(seq.seq_id, start, mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def schedule(self) -> SchedulerOutput:
        step = _Step(self.max_num_batched_tokens)

        # 1. Decodes, oldest first; a missing page preempts the worst-priority, newest running
        # sequence (possibly seq itself: then it waits for the others).
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue
            if step.budget == 0:
                break
            start = seq.num_computed_tokens
            while not self.kv.can_append(seq.seq_id, start, start + 1):
                victim = self._victim()
                if victim is seq and len(self.running) == 1:
                    raise self._alone_error(seq, start + 1)
                self._preempt(victim, step)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.kv.append(seq.seq_id, start, start + 1)
            step.add(ScheduledChunk(seq, start, 1), decode=True)

        # 2a. Partially prefilled running sequences, as many tokens as budget and pages allow;
        # those of a worse priority than the head of the queue go after the waiting ones (2c).
        urgent = self.waiting[0].params.priority if self.waiting else None
        later = [s for s in self.running if urgent is not None and s.params.priority > urgent]
        self._prefill_running([s for s in self.running if s not in later], step)
        self._admit_waiting(step)
        self._prefill_running(later, step)
        return SchedulerOutput(chunks=step.decodes + step.prefills, preempted=step.preempted)

    def _prefill_running(self, seqs: list[Sequence], step: _Step) -> None:
        """Step 2a for ``seqs`` (running, oldest first)."""
        for seq in seqs:
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens <= 1:
                continue
            if step.budget == 0:
                break
            start = seq.num_computed_tokens
            want = start + min(seq.num_uncomputed_tokens, step.budget)
            end = self._fit(seq, start, want)
            while end == start and (victim := self._victim()) is not seq:
                self._preempt(victim, step)  # worse priority / newer (even if scheduled) yields
                end = self._fit(seq, start, want)
            if end == start:  # seq is the next victim itself: wait, holding its pages, for the others
                if len(self.running) == 1:
                    raise self._alone_error(seq, start + 1)
                continue
            self.kv.append(seq.seq_id, start, end)
            step.add(ScheduledChunk(seq, start, end - start), decode=False)

    def _admit_waiting(self, step: _Step) -> None:
        """Step 2b: waiting sequences in queue order, no skipping; none right after a preemption
        (it would only thrash: the pages just freed were needed by running sequences)."""
        while (self.waiting and not step.preempted and step.budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            # prefix caching: start with the cached pages of the longest reusable prefix (not for a
            # prompt whose logprobs are asked: every position of it is computed)
            reads = self._reuses(seq) and seq.params.prompt_logprobs is None
            cached = self.kv.share(seq.seq_id, seq.all_token_ids) if reads else 0
            end = cached + min(seq.num_tokens - cached, step.budget)
            if not self.kv.can_append(seq.seq_id, cached, end):
                self.kv.free(seq.seq_id)  # the shared pages go back to the cache
                break
            self.waiting.popleft()
            self.kv.append(seq.seq_id, cached, end)
            self.kv.record_admission(seq.num_tokens, cached)
            if seq.num_cached_tokens is None:  # first admission (a preempted one comes back)
                seq.num_cached_tokens = cached
            seq.num_computed_tokens = cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            step.add(ScheduledChunk(seq, cached, end - cached), decode=False)

    def _reuses(self, seq: Sequence) -> bool:
        """Whether ``seq`` takes part in prefix caching (shares cached pages, names its own)."""
        return self.kv.prefix_caching and (self.prefix_filter is None or self.prefix_filter(seq))

    def reserve_decode_steps(self, out: SchedulerOutput, num_steps: int) -> bool:
        """Pages for ``num_steps`` positions of every chunk of the pure-decode step ``out``, so
        that many decode steps can run back to back on the device; False if the cache cannot
        hold them (run one step then). A sequence that got its pages keeps them: its next steps
        need them anyway."""
        try:
            for ch in out.chunks:
                self.kv.append(ch.seq.seq_id, ch.start, ch.start + num_steps)
        except OutOfPages:
            return False
        return True

    def update(self, out: SchedulerOutput, sampled: dict[int, int],
               eos_token_ids: tuple[int, ...] = ()) -> list[Sequence]:
        """Apply one executed step: advance computed counts, append the tokens sampled for chunks
        with ``needs_logits``, stop (token, max_tokens, max_seq_len), free the finished ones."""
        eos = tuple(eos_token_ids)
        finished = []
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:  # aborted since schedule()
                continue
            if seq.num_computed_tokens != chunk.start:
                raise ValueError(f"sequence {seq.seq_id} has {seq.num_computed_tokens} computed "
                                 f"tokens, chunk starts at {chunk.start}: update() called twice?")
            seq.num_computed_tokens = chunk.end
            if (chunk.end // self.kv.page_size > chunk.start // self.kv.page_size and self._reuses(seq)
                    and (self.kv.cache_decode_pages or not chunk.is_decode)):
                tokens = seq.all_token_ids if seq.output_token_ids else seq.prompt_token_ids  # no copy
                self.kv.register(seq.seq_id, tokens, chunk.end)  # the pages this chunk filled
            if not chunk.needs_logits:
                continue
            if seq.seq_id not in sampled:
                raise ValueError(f"no sampled token for sequence {seq.seq_id}, whose chunk "
                                 f"needs_logits")
            token = int(sampled[seq.seq_id])
            seq.output_token_ids.append(token)
            reason = check_stop_token(seq, token, eos)
            if reason is None and seq.num_tokens >= self.max_seq_len:
                reason = "length"  # the sequence reached max_seq_len: no position left
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished
