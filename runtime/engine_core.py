"""The engine core: requests in, steps, deltas out. `LLM` (runtime/llm.py) wraps it for one
caller; `EngineLoop` (runtime/engine_loop.py) drives it from one engine thread for the HTTP
server and the Triton model; benchmarks drive it step by step.

    core = LLM(engine_dir).core                      # or EngineCore(engine_dir, LoadOptions(...))
    req = core.add_request("Once upon a time", None, SamplingParams(max_tokens=8))
    while not req.is_finished:
        if req in core.step():                       # the requests that moved this step
            for delta in core.deltas(req): ...       # StreamDelta, one per completion that moved
    core.abort(req)                                  # forget it (frees its pages if still running)

Every step the scheduler picks decodes and prefill chunks (requests join and leave per step), the
runner computes logits for the sequences that need a token, the sampler picks tokens, and the
detokenizer applies stop strings. Not thread-safe: one thread owns a core.

Faults stay with the request that has them:
  - `add_request` checks a request completely (prompt, every SamplingParams field, the engine's
    vocabulary and max_seq_len) and makes all of its state (Sequence, detokenizer, generator)
    before it is queued; a bad request raises ValueError and leaves nothing behind.
  - In a step, the per-request parts run request by request: `hooks.before_forward` (tests),
    sampling its token, the scheduler's bookkeeping and stop checks, detokenizing. An exception
    there finishes that request alone with finish_reason "error" and an `error` message (on the
    request, its RequestOutput and its last StreamDelta); its KV pages are freed and `step()`
    returns it with the others, which go on unchanged.
  - The batched forward (the runner: inputs, kernels, KV offloading) cannot be blamed on one
    request: when it raises, every request scheduled in that step fails as above, and the
    engine goes on with the rest (waiting and later requests). A fault that breaks the device
    itself (a poisoned CUDA context) fails every later step the same way: restart the process.
  - Only engine-level faults (the scheduler's own, e.g. a KV cache too small for max_seq_len)
    raise from `step()`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infhip.runtime.distributed import start_ranks
from infhip.runtime.load import load_rank, load_report, make_runner, prefix_caching_rule
from infhip.runtime.options import LoadOptions
from infhip.runtime.outputs import EngineInfo, EngineStats, RequestOutput, StreamDelta
from infhip.runtime.penalty_slots import PenaltySlots
from infhip.runtime.requests import Fork, Request, prompt_ids
from infhip.runtime.sampler import Sampler
from infhip.runtime.sampling_params import SamplingParams
from infhip.runtime.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from infhip.runtime.sequence import Sequence, SequenceStatus
from infhip.runtime.step_sampling import StepSampler
from infhip.runtime.structured_output import GrammarRuntime

_log = logging.getLogger(__name__)


@dataclass
class StepHooks:
    """Test seams of a step, all None in production. before_forward: called with each scheduled
    sequence once per step, before the batched forward; an exception fails that request alone."""

    before_forward: Callable[[Sequence], None] | None = None


class EngineCore:
    """Load an engine (rank 0 of a tensor-parallel one) and run its requests step by step.

    Public: `add_request`, `step`, `deltas` / `delta`, `output`, `abort`; `stats()`, `info()`,
    `debug_view()`, `num_running`, `num_waiting`, `num_requests`, `reset_prefix_cache()`;
    `hooks`; the loaded parts `engine`, `runner`, `scheduler`, `sampling` (the step's
    StepSampler, runtime/step_sampling.py), `tokenizer`, `options`, `load_report`; `close()`.
    Frontends drive it through `EngineLoop` (runtime/engine_loop.py) only."""

    def __init__(self, engine_dir: str | Path, options: LoadOptions):
        t0 = time.perf_counter()
        self.options = opts = options
        # A tensor-parallel engine: its other ranks start loading now, in their own processes
        # (runtime/distributed/); None for a one-rank engine.
        self._tp = start_ranks(engine_dir, opts)
        try:
            self.engine = load_rank(engine_dir, opts)
            t_engine = time.perf_counter()
            if self._tp is not None:
                self._tp.join(self.engine)  # the workers have loaded; the group is up
            self.runner, self.max_num_seqs, budget, self.num_decode_steps = make_runner(self.engine, opts)
        except BaseException:
            self.close()
            raise
        build = self.engine.config.build
        self.scheduler = Scheduler(self.runner.kv, self.max_num_seqs, budget, build.max_seq_len)
        plan = self.engine.config.plan
        if opts.prefix_caching:
            self.runner.kv.enable_prefix_caching(repr((plan, build.kv_dtype, build.dtype)),
                                                 **prefix_caching_rule(self.engine.config, build.page_size))
            # only requests whose prompts every step transform computes whole (token drop: those
            # that never drop; read live: knobs may change)
            self.scheduler.prefix_filter = self._keeps_prompt
        # a sequence's KV is freed (finished, preempted): the transforms drop their state of it
        self.scheduler.on_free = self._release
        self.load_report = load_report(self.engine, self.runner, t0, t_engine)
        # penalized sequences' output counts, on the device across steps (runtime/penalty_slots.py)
        self.penalty_slots = PenaltySlots(self.engine.config.model.vocab_size, self.runner.device)
        self._grammars: GrammarRuntime | None = None  # structured output: made at its first request
        self._grammars_lock = threading.Lock()  # the server may make it on its tokenizer thread
        self.tokenizer = self.engine.tokenizer
        self.eos_token_ids = tuple(self.engine.config.model.eos_token_ids)
        self._ids = itertools.count()
        self._requests: dict[int, Request] = {}  # fork 0's seq_id -> request
        self._forks: dict[int, Fork] = {}  # seq_id -> fork, every live fork
        self.hooks = StepHooks()
        # the step's batched half: forward and sampling (runtime/step_sampling.py)
        self.sampling = StepSampler(self.runner, Sampler(), self.penalty_slots, self.engine.kernels,
                                    self.engine.config.model.vocab_size, self.eos_token_ids)

    def close(self) -> None:
        """Stop a tensor-parallel engine's worker processes (also at interpreter exit); a no-op
        for a one-rank engine. The core cannot run steps afterwards."""
        if getattr(self, "_tp", None) is not None:
            self._tp.close()

    @property
    def sampler(self) -> Sampler:
        """The Sampler (runtime/sampler.py) the steps sample with."""
        return self.sampling.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self.sampling.sampler = sampler

    # -- read-outs ------------------------------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (the `prefix_caching` option and an exact plan)."""
        return self.runner.kv.prefix_caching

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_requests(self) -> int:
        """Requests added and not yet forgotten (`output` or `abort`)."""
        return len(self._requests)

    def stats(self) -> EngineStats:
        """Requests and KV pages now (read-only; safe to call between steps)."""
        kv = self.runner.kv
        free = {g: kv.num_free_pages(g) for g in kv.groups}
        host = {g: spec.offload.host_pages for g, spec in kv.groups.items() if spec.offload is not None}
        host_free = {g: kv.num_free_host_pages(g) for g in host}
        return EngineStats(
            num_running=self.num_running, num_waiting=self.num_waiting,
            kv_pages_used={g: spec.num_pages - 1 - free[g] for g, spec in kv.groups.items()},
            kv_pages_free=free,
            host_pages_used={g: n - host_free[g] for g, n in host.items()}, host_pages_free=host_free,
            kv_pages_cached={g: kv.num_cached_pages(g) for g in kv.groups},
            host_pages_cached={g: kv.num_cached_host_pages(g) for g in host},
            prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
            prefix_cache_evictions=kv.prefix_cache_evictions, num_preemptions=self.scheduler.num_preemptions)

    def info(self) -> EngineInfo:
        """The engine's limits, KV capacity and methods' request counters (fixed at load)."""
        from infhip.runtime.core_readouts import core_info
        return core_info(self)

    def debug_view(self) -> dict:
        """What the core holds now, JSON-able, for tests and debugging (read between steps; a
        copy, never live state):

        - requests: the live requests with each completion's sequence (status, prompt / computed /
          cached / output tokens, finish reason, KV pages held per group);
        - running, waiting: the scheduler's queues (seq ids, in order); stats: `stats()`;
        - transforms, backends: each attached step transform's and attention backend's own
          `debug_view()` by name (their contracts, runtime/step_transform.py and
          runtime/attention/backend.py, say what each shows);
        - graphs: the captured decode graphs (batch size, each backend's key, the transform whose
          per-layer KV shift it carries, the length bucket) and their report (count, seconds,
          pool bytes, captured on request); None when steps run eagerly;
        - grammar_compiler: whether the structured-output compiler was made (its first request);
        - tp_worker_pids: the worker processes this core started (tensor parallelism; else []).

        Idle: no requests, nothing running or waiting."""
        from infhip.runtime.core_readouts import core_view
        return core_view(self)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix page (pages held by requests stay theirs)."""
        self.runner.kv.clear_prefix_cache()

    @property
    def grammars(self) -> GrammarRuntime:
        """The engine's structured-output compiler (made on first use: it reads the vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarRuntime(self.tokenizer, self.engine.config.model.vocab_size,
                                                self.eos_token_ids)
        return self._grammars

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt: str | None, token_ids: list[int] | None, params: SamplingParams) -> Request:
        """Check one request and make all of its state, then queue it (fork 0; with n / best_of
        > 1 the other forks join once its prompt is computed: `_spawn`). Prompt text, or token
        ids, or both (then the ids are used and the text kept as the request's prompt).
        ValueError (what is wrong, what to do) if anything is off; nothing is queued then."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        vocab = self.engine.config.model.vocab_size
        token_ids = prompt_ids(prompt, token_ids, self.tokenizer, vocab)
        # A sequence ends at max_seq_len tokens in all; it always gets at least one output token.
        room = max(1, self.scheduler.max_seq_len - len(token_ids))
        encode = (lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]) if self.tokenizer else None
        params = params.for_engine(vocab, room, encode)
        if params.structured_outputs is not None:  # compiled (and cached) now: a bad grammar is a ValueError
            self.grammars.compile(params.structured_outputs)
        req = Request(prompt, params, spawned=params.num_forks == 1)
        fork = self._new_fork(req, 0, token_ids)
        if params.prompt_logprobs is not None:
            for name, t in self.runner.stepping.items():
                if not t.keeps_prompt(fork.seq):
                    raise ValueError(f"prompt_logprobs needs every prompt position computed, and step transform "
                                     f"{name!r} would not compute all of this prompt's: {t.prompt_hint}")
            req.prompt_logprobs = [None] * len(token_ids)
        self.scheduler.add(fork.seq)  # its checks (length, KV pages) come before it queues anything
        req.forks.append(fork)
        self._requests[fork.seq.seq_id] = req
        self._forks[fork.seq.seq_id] = fork
        return req

    def _keeps_prompt(self, seq) -> bool:
        """Whether every step transform computes seq's whole prompt as a plan without it would
        (StepTransform.keeps_prompt; token drop: a prompt that never drops)."""
        return all(t.keeps_prompt(seq) for t in self.runner.stepping.values())

    def _release(self, seq) -> None:
        for t in self.runner.stepping.values():
            t.release(seq)

    def _new_fork(self, req: Request, index: int, token_ids: list[int]) -> Fork:
        return req.new_fork(index, next(self._ids), token_ids, self.tokenizer, self.runner.device)

    def _spawn(self, req: Request) -> None:
        """Queue forks 1.. of req once fork 0's prompt is computed: its pages are in the prefix
        cache now, so each fork starts on them (KVCacheManager.share) and computes only the last
        partial page; they keep fork 0's place in the queue (its arrival)."""
        req.spawned = True
        parent = req.forks[0].seq
        for i in range(1, req.params.num_forks):
            fork = self._new_fork(req, i, parent.prompt_token_ids)
            self.scheduler.add(fork.seq, arrival=parent.arrival)
            req.forks.append(fork)
            self._forks[fork.seq.seq_id] = fork

    def deltas(self, req: Request) -> list[StreamDelta]:
        """What req's completions produced since their last deltas (`Request.deltas`)."""
        return req.deltas()

    def delta(self, req: Request) -> StreamDelta | None:
        """`deltas` of a request of one completion (n = 1): its one delta or None."""
        deltas = self.deltas(req)
        if len(deltas) > 1:
            raise ValueError(f"request {req.seq.seq_id} has {req.params.n} completions: read them with deltas()")
        return deltas[0] if deltas else None

    def output(self, req: Request) -> RequestOutput:
        """A finished request's RequestOutput; the core forgets it."""
        self._forget(req)
        return req.output()

    def abort(self, req: Request) -> None:
        """Finish a request's forks (those still running) and forget it; its KV pages are freed."""
        req.spawned = True
        for f in req.forks:
            if not f.seq.is_finished:
                self.scheduler.finish(f.seq, "abort")
        self._forget(req)

    def _forget(self, req: Request) -> None:
        self._requests.pop(req.seq.seq_id, None)
        for f in req.forks:
            self._forks.pop(f.seq.seq_id, None)

    # -- a step ---------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduler step; returns the requests that got new tokens or finished, failed
        ones included (finish_reason "error"; the module docstring gives the rule)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            raise RuntimeError("scheduler made no progress although requests are pending (KV cache too small?)")
        touched: dict[int, Request] = {}
        out = self._per_request_checks(out, touched)
        if not out.chunks:
            return list(touched.values())
        steps, forks = self.sampling, [self._forks[ch.seq.seq_id] for ch in out.chunks]
        try:  # the batched part: a fault here is every scheduled request's
            with steps.launches():  # the engine's JIT policy (runtime/kernel_store.py serving)
                num_steps = self._num_decode_steps(out)
                if num_steps > 1:
                    tokens, logprobs = steps.decode_steps(out, forks, num_steps, self._grammars)
                else:
                    logits = steps.forward(out, forks)
        except Exception as e:  # noqa: BLE001 - these requests fail, the engine goes on
            _log.error("a step of %d request(s) failed; failing them all", len(out.chunks), exc_info=e)
            self.engine.tp.abandon(e)  # tensor-parallel: the other ranks are mid-step, later steps refuse
            for fork in forks:
                self._fail(fork, "in the batched forward of its step", e, touched, log=False)
            return list(touched.values())
        if num_steps > 1:
            self._commit_decode_steps(out, tokens, logprobs, touched)
            return list(touched.values())
        sampled, logprobs, failed = steps.sample(logits, [f for f, ch in zip(forks, out.chunks) if ch.needs_logits],
                                                 self._grammars)
        for fork, e in failed:
            self._fail(fork, "while sampling its token", e, touched)
        self._commit(out, sampled, logprobs, touched)
        return list(touched.values())

    def _commit(self, out: SchedulerOutput, sampled: dict[int, int], logprobs: dict, touched: dict[int, Request]) -> None:
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

    def _num_decode_steps(self, out: SchedulerOutput) -> int:
        """How many decode steps to run back to back for this step, at most num_decode_steps (read
        live: benchmarks change it); 1 = an ordinary step."""
        k = self.num_decode_steps
        if (k <= 1 or out.num_decodes != len(out.chunks) or out.preempted or self.scheduler.num_waiting
                or any(ch.start + k > self.runner.max_seq_len for ch in out.chunks)
                or any(_host_each_step(ch.seq.params) for ch in out.chunks)):
            return 1
        return k if self.scheduler.reserve_decode_steps(out, k) else 1

    def _commit_decode_steps(self, out: SchedulerOutput, tokens: list[list[int]], logprobs: list[dict],
                             touched: dict[int, Request]) -> None:
        """Commit back-to-back decode steps one by one; a sequence that stops (or fails) takes no more."""
        seqs = [ch.seq for ch in out.chunks]
        for j, row in enumerate(tokens):
            live = [(b, seq) for b, seq in enumerate(seqs) if seq.status is SequenceStatus.RUNNING]
            if not live:
                break
            step_out = out if j == 0 else SchedulerOutput(
                chunks=[ScheduledChunk(seq, seq.num_computed_tokens, 1) for _, seq in live])
            self._commit(step_out, {seq.seq_id: row[b] for b, seq in live}, logprobs[j], touched)

    def _per_request_checks(self, out: SchedulerOutput, touched: dict[int, Request]) -> SchedulerOutput:
        """The step without the sequences that fail before the forward: hooks.before_forward
        raised, or (queued on the scheduler directly, not through add_request) no request to
        report to."""
        keep, hook = [], self.hooks.before_forward
        for ch in out.chunks:
            fork = self._forks.get(ch.seq.seq_id)
            if fork is None:
                _log.error("sequence %d was queued without add_request; finishing it", ch.seq.seq_id)
                self.scheduler.finish(ch.seq, "error")
                continue
            try:
                if hook is not None:
                    hook(ch.seq)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(fork, "before its step", e, touched)
                continue
            keep.append(ch)
        return out if len(keep) == len(out.chunks) else SchedulerOutput(chunks=keep, preempted=out.preempted)

    def _fail(self, fork: Fork, stage: str, exc: BaseException, touched: dict[int, Request],
              log: bool = True) -> None:
        """Finish fork with finish_reason "error" (pages freed) and say why (log: with the
        traceback on this module's logger). A request whose fork 0 fails before its prompt is
        computed starts no other forks."""
        fork.error = f"the request failed {stage}: {type(exc).__name__}: {exc}"
        if log:
            _log.error("request %d: %s", fork.seq.seq_id, fork.error, exc_info=exc)
        if fork.seq.is_finished:  # e.g. its last token finished it, then detokenizing failed
            fork.seq.finish_reason = "error"
        else:
            self.scheduler.finish(fork.seq, "error")
        fork.req.spawned = True
        touched[fork.req.seq.seq_id] = fork.req


def _host_each_step(p: SamplingParams) -> bool:
    """Whether a request's sampling needs the host between decode steps in a way back-to-back
    steps cannot give it (then the engine runs one at a time): a multi-token bad word is
    matched against the committed output on the host. (A grammar advances on the host too, but
    inside the run: `StepSampler.decode_steps`, runtime/step_sampling.py.)"""
    return any(len(q) > 1 for q in p.bad_words_token_ids or ())
