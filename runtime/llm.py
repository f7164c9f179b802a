"""The in-process API: `LLM(engine_dir).generate(...)` and `.generate_stream(...)`.

    >>> from infhip import LLM, SamplingParams                       # doctest: +SKIP
    >>> llm = LLM("engines/smollm2-135m")
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    >>> out[0].text, out[0].finish_reason
    >>> for delta in llm.generate_stream("Once upon a time", SamplingParams(max_tokens=32)):
    ...     print(delta.text, end="", flush=True)

Every step the scheduler picks decodes and prefill chunks (requests join and leave per step),
the runner computes logits for the sequences that need a token, the sampler picks tokens, and
the detokenizer applies stop strings. `LLM` is not thread-safe: `infhip-serve`
(runtime/server.py) drives the same cycle (`_add`, `step`, `_delta`, `_abort`) from its one
engine thread for all concurrent HTTP requests.

Faults stay with the request that has them:
  - `_add` checks a request completely (prompt, every SamplingParams field, the engine's
    vocabulary and max_seq_len) and makes all of its state (Sequence, detokenizer, generator)
    before it is queued; a bad request raises ValueError and leaves nothing behind.
  - In a step, the per-request parts run request by request: `fault_hook` (tests), sampling
    its token, the scheduler's bookkeeping and stop checks, detokenizing. An exception there
    finishes that request alone with finish_reason "error" and an `error` message (on the
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

import dataclasses
import itertools
import logging
import math
import operator
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from infhip.config import TokenDropConfig, apply_runtime_overrides
from infhip.runtime.detokenizer import Detokenizer
from infhip.runtime.distributed import start_ranks
from infhip.runtime.engine import load_engine
from infhip.runtime.kernel_store import serving
from infhip.runtime.model_runner import ModelRunner
from infhip.runtime.options import LoadOptions
from infhip.runtime.outputs import CompletionOutput, RequestOutput, StreamDelta, TokenLogprobs
from infhip.runtime.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from infhip.runtime.sampling_params import SEED_RANGE, SamplingParams
from infhip.runtime.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from infhip.runtime.sequence import Sequence, SequenceStatus
from infhip.runtime.structured_output import GrammarRuntime
from infhip.runtime.token_drop import never_drops

_log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Fork:
    """One completion of a request. A request of n (best_of) > 1 completions starts with fork 0,
    which computes the prompt; once its prompt is done the others join the queue with the same
    prompt and start on its KV pages through the prefix cache (`LLM._spawn`)."""

    req: "_Request"
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
class _Request:
    prompt: str | None
    params: SamplingParams  # as checked by for_engine (n, best_of, logprobs as asked)
    forks: list[_Fork] = dataclasses.field(default_factory=list)
    spawned: bool = False  # forks 1.. exist (or never will: n = 1, or fork 0 ended first)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def seq(self) -> Sequence:
        """Fork 0's sequence: the prompt, its admission, its cached tokens."""
        return self.forks[0].seq

    @property
    def error(self) -> str | None:
        return next((f.error for f in self.forks if f.error), None)

    @property
    def is_finished(self) -> bool:
        return self.spawned and all(f.seq.is_finished for f in self.forks)


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
    kv_pages_cached: dict[str, int] = dataclasses.field(default_factory=dict)
    host_pages_cached: dict[str, int] = dataclasses.field(default_factory=dict)  # (counted in host_pages_free)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0


class LLM:
    """Load an engine and serve it in-process.

    Args:
        engine_dir: a directory written by `infhip-build`.
        options: a :class:`~infhip.runtime.options.LoadOptions`; or its fields as keywords
            (``LLM(engine, max_num_seqs=4, token_drop=False)``), laid over ``options`` when both
            are given. Every option, its meaning and default: runtime/options.py (the flags of
            infhip-run / infhip-serve have the same names). ``infinitehip_overrides`` and
            ``token_drop`` change the engine's plan for this load (docs/knobs.md).
    """

    def __init__(self, engine_dir: str | Path, options: LoadOptions | None = None, **kwargs):
        t0 = time.perf_counter()
        self.options = opts = LoadOptions.of(options, **kwargs)
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
                                                 **prefix_caching_rule(plan, build.page_size))
            runner = self.runner  # token drop: only requests that never drop (read live: knobs may change)
            self.scheduler.prefix_filter = lambda seq: never_drops(seq, runner.token_drop, runner.drop_max_context)
        self.load_report = self._load_report(t0, t_engine)
        self.sampler = Sampler()
        self._grammars: GrammarRuntime | None = None  # structured output: made at its first request
        self._grammars_lock = threading.Lock()  # the server may make it on its tokenizer thread
        self.tokenizer = self.engine.tokenizer
        self.eos_token_ids = tuple(self.engine.config.model.eos_token_ids)
        self._ids = itertools.count()
        self._requests: dict[int, _Request] = {}  # fork 0's seq_id -> request
        self._forks: dict[int, _Fork] = {}  # seq_id -> fork, every live fork
        # Tests inject faults here: called with each scheduled sequence once per step, before the
        # batched forward; an exception fails that request alone (the module docstring's rule).
        self.fault_hook: Callable[[Sequence], None] | None = None

    # -- load -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop a tensor-parallel engine's worker processes (also at interpreter exit); a no-op
        for a one-rank engine. The LLM cannot run steps afterwards."""
        if getattr(self, "_tp", None) is not None:
            self._tp.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is on (the `prefix_caching` argument and an exact plan)."""
        return self.runner.kv.prefix_caching

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

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
            prefix_cache_evictions=kv.prefix_cache_evictions)

    def _load_report(self, t0: float, t_engine: float) -> dict:
        """Where LLM() spent its time: reading weights, verifying the engine's compiled kernels,
        capturing the decode graphs (kernels load on their first launch, in the graphs' warm-ups)."""
        kernels = self.engine.kernels
        graphs = self.runner.graphs.report if self.runner.graphs is not None else {"graphs": 0, "seconds": 0.0}
        total = time.perf_counter() - t0
        verify = kernels.load_seconds if kernels is not None else 0.0
        return {"total_s": round(total, 3), "weights_s": round(t_engine - t0 - verify, 3),
                "kernels_verify_s": round(verify, 3), "kernels": len(kernels.variants) if kernels else 0,
                "graphs": graphs["graphs"], "graphs_s": round(graphs["seconds"], 3),
                "graph_pool_bytes": graphs.get("pool_bytes", 0),
                "other_s": round(total - (t_engine - t0) - graphs["seconds"], 3)}

    # -- requests -------------------------------------------------------------------------------
    def _add(self, prompt: str | None, token_ids: list[int] | None, params: SamplingParams) -> _Request:
        """Check one request and make all of its state, then queue it (fork 0; with n / best_of
        > 1 the other forks join once its prompt is computed: `_spawn`). ValueError (what is
        wrong, what to do) if anything is off; nothing is queued then."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_ids(prompt, token_ids)
        # A sequence ends at max_seq_len tokens in all; it always gets at least one output token.
        room = max(1, self.scheduler.max_seq_len - len(token_ids))
        encode = (lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]) if self.tokenizer else None
        params = params.for_engine(self.engine.config.model.vocab_size, room, encode)
        if params.structured_outputs is not None:  # compiled (and cached) now: a bad grammar is a ValueError
            self.grammars.compile(params.structured_outputs)
        req = _Request(prompt, params, spawned=params.num_forks == 1)
        fork = self._new_fork(req, 0, token_ids)
        if params.prompt_logprobs is not None:
            if not never_drops(fork.seq, self.runner.token_drop, self.runner.drop_max_context):
                raise ValueError("prompt_logprobs needs every prompt position computed; this prompt would have "
                                 "tokens dropped (UniPrefill): load the engine with token_drop=False")
            req.prompt_logprobs = [None] * len(token_ids)
        self.scheduler.add(fork.seq)  # its checks (length, KV pages) come before it queues anything
        req.forks.append(fork)
        self._requests[fork.seq.seq_id] = req
        self._forks[fork.seq.seq_id] = fork
        return req

    def _new_fork(self, req: _Request, index: int, token_ids: list[int]) -> _Fork:
        """Fork `index` of req: its own params (seed + index; logprobs computed when best_of
        ranks by them; the prompt's logprobs are fork 0's), sequence, detokenizer, generator."""
        p = req.params
        seed = None if p.seed is None else p.seed + index
        if seed is not None and seed >= SEED_RANGE[1]:
            seed -= 1 << 64  # the same 64-bit seed, in range
        logprobs = p.logprobs if p.logprobs is not None else (0 if p.needs_logprobs else None)
        fp = dataclasses.replace(p, n=1, best_of=None, seed=seed, logprobs=logprobs,
                                 prompt_logprobs=p.prompt_logprobs if index == 0 else None)
        seq = Sequence(seq_id=next(self._ids), prompt_token_ids=token_ids, params=fp)
        return _Fork(req, index, seq, Detokenizer(self.tokenizer, fp.stop), make_generator(seed, self.runner.device))

    def _spawn(self, req: _Request) -> None:
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

    def _prompt_ids(self, prompt: str | None, token_ids) -> list[int]:
        """The prompt as a list of token ids of this engine's vocabulary."""
        if token_ids is None:
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer (built with --random-weights from a config); "
                                 "pass prompt_token_ids instead of prompts")
            if not isinstance(prompt, str):
                raise ValueError(f"a prompt must be a string, got {type(prompt).__name__}; "
                                 "pass token ids as prompt_token_ids")
            token_ids = self.tokenizer(prompt)["input_ids"]
        ids = _int_list(token_ids)
        if ids is None:
            raise ValueError(f"prompt token ids must be a list of ints, got {token_ids!r:.80}")
        vocab = self.engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
        return ids

    def step(self) -> list[_Request]:
        """Run one scheduler step; returns the requests that got new tokens or finished, failed
        ones included (finish_reason "error"; the module docstring gives the rule)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            raise RuntimeError("scheduler made no progress although requests are pending (KV cache too small?)")
        touched: dict[int, _Request] = {}
        out = self._per_request_checks(out, touched)
        if not out.chunks:
            return list(touched.values())
        try:  # the batched part: a fault here is every scheduled request's
            with serving(self.engine.kernels):  # the engine's JIT policy (runtime/kernel_store.py)
                num_steps = self._num_decode_steps(out)
                if num_steps > 1:
                    tokens, logprobs = self._decode_steps(out, num_steps)
                else:
                    rows, spans = self._prompt_rows(out)
                    # (hidden_rows only when asked: tools and tests wrap execute(out))
                    logits = self.runner.execute(out, hidden_rows=rows) if rows else self.runner.execute(out)
                    if spans:
                        self._record_prompt_logprobs(self.runner.hidden_out, spans)
        except Exception as e:  # noqa: BLE001 - these requests fail, the engine goes on
            _log.error("a step of %d request(s) failed; failing them all", len(out.chunks), exc_info=e)
            self.engine.tp.abandon(e)  # tensor-parallel: the other ranks are mid-step, later steps refuse
            for ch in out.chunks:
                self._fail(self._forks[ch.seq.seq_id], "in the batched forward of its step", e, touched, log=False)
            return list(touched.values())
        if num_steps > 1:
            self._commit_decode_steps(out, tokens, logprobs, touched)
        else:
            self._commit(out, *self._sample(logits, out, touched), touched)
        return list(touched.values())

    def _per_request_checks(self, out: SchedulerOutput, touched: dict[int, _Request]) -> SchedulerOutput:
        """The step without the sequences that fail before the forward: fault_hook raised, or
        (queued on the scheduler directly, not through _add) no request to report to."""
        keep = []
        for ch in out.chunks:
            fork = self._forks.get(ch.seq.seq_id)
            if fork is None:
                _log.error("sequence %d was queued without LLM._add; finishing it", ch.seq.seq_id)
                self.scheduler.finish(ch.seq, "error")
                continue
            try:
                if self.fault_hook is not None:
                    self.fault_hook(ch.seq)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(fork, "before its step", e, touched)
                continue
            keep.append(ch)
        return out if len(keep) == len(out.chunks) else SchedulerOutput(chunks=keep, preempted=out.preempted)

    def _batch(self, forks: list[_Fork]) -> SamplingBatch:
        """The sampler's view of these forks' rows for this step (runtime/sampler.py), with the
        token bitmask of those under a grammar (runtime/structured_output.py)."""
        batch = SamplingBatch([f.seq.params for f in forks], [f.generator for f in forks], self.runner.device,
                              self.engine.config.model.vocab_size,
                              [(f.seq.prompt_token_ids, f.seq.output_token_ids) for f in forks], self.eos_token_ids)
        if self._grammars is not None:
            self._grammars.apply(batch, [f.seq for f in forks])
        return batch

    @property
    def grammars(self) -> GrammarRuntime:
        """The engine's structured-output compiler (made on first use: it reads the vocabulary)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarRuntime(self.tokenizer, self.engine.config.model.vocab_size,
                                                self.eos_token_ids)
        return self._grammars

    def _sample(self, logits: torch.Tensor, out: SchedulerOutput,
                touched: dict[int, _Request]) -> tuple[dict[int, int], dict[int, TokenLogprobs]]:
        """(seq_id -> token, seq_id -> its logprobs where asked) for the chunks with needs_logits
        (logits rows in chunk order), sampled as one batch; if that raises, row by row, so that
        only the rows that raise fail. (A seeded row may then draw different noise than it would
        have: the failed batch call may have advanced its generator.)"""
        forks = [self._forks[ch.seq.seq_id] for ch in out.chunks if ch.needs_logits]
        if not forks:
            return {}, {}
        try:
            so = self.sampler.sample(logits, self._batch(forks))
            [tokens], [lps] = _read_samples([so])  # the step's one host read
            return {f.seq.seq_id: t for f, t in zip(forks, tokens)}, _logprob_records(so, [f.seq for f in forks],
                                                                                      tokens, lps)
        except Exception:  # noqa: BLE001 - find the request(s) at fault below
            _log.warning("batched sampling failed; sampling each request alone", exc_info=True)
        sampled, lps = {}, {}
        for i, f in enumerate(forks):
            try:
                so = self.sampler.sample(logits[i:i + 1], self._batch([f]))
                [tokens], [flat] = _read_samples([so])
                sampled[f.seq.seq_id] = tokens[0]
                lps.update(_logprob_records(so, [f.seq], tokens, flat))
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(f, "while sampling its token", e, touched)
        return sampled, lps

    def _prompt_rows(self, out: SchedulerOutput) -> tuple[list[int], list[tuple[_Request, int, int]]]:
        """prompt_logprobs: (the step's hidden rows to keep, and per request (req, lo, hi): those
        rows are positions [lo, hi), each predicting the prompt token after it)."""
        rows, spans, row0 = [], [], 0
        for ch in out.chunks:
            seq = ch.seq
            if seq.params.prompt_logprobs is not None:
                hi = min(ch.end, seq.num_prompt_tokens - 1)
                if ch.start < hi:
                    rows += range(row0 + 0, row0 + hi - ch.start)
                    spans.append((self._forks[seq.seq_id].req, ch.start, hi))
            row0 += ch.num_tokens
        return rows, spans

    @torch.inference_mode()
    def _record_prompt_logprobs(self, hidden: torch.Tensor, spans: list[tuple[_Request, int, int]]) -> None:
        """Fill req.prompt_logprobs[lo + 1 : hi + 1] from the hidden states of positions [lo, hi)
        (in spans' order), LM head and log-softmax a slice of rows at a time (a long prompt's
        logits at once would be [tokens, vocab])."""
        targets = [t for req, lo, hi in spans for t in req.seq.prompt_token_ids[lo + 1:hi + 1]]
        k = max(req.params.prompt_logprobs for req, _, _ in spans)
        tgt = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
        packed = []
        for i in range(0, len(targets), _PROMPT_LOGPROB_ROWS):
            lp = torch.log_softmax(self.runner.model.compute_logits(hidden[i:i + _PROMPT_LOGPROB_ROWS]).float(), -1)
            packed.append(_pack_logprobs(lp, tgt[i:i + _PROMPT_LOGPROB_ROWS], k))
        recs = _unpack_logprobs(torch.cat(packed).tolist(), targets, k)
        j = 0
        for req, lo, hi in spans:
            kk = req.params.prompt_logprobs
            for pos in range(lo + 1, hi + 1):
                r = recs[j]
                req.prompt_logprobs[pos] = TokenLogprobs(r.token_id, r.logprob, r.rank, r.top[:kk])
                j += 1

    def _commit(self, out: SchedulerOutput, sampled: dict[int, int], logprobs: dict[int, TokenLogprobs],
                touched: dict[int, _Request]) -> None:
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

    def _fail(self, fork: _Fork, stage: str, exc: BaseException, touched: dict[int, _Request],
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

    def _num_decode_steps(self, out: SchedulerOutput) -> int:
        """How many decode steps to run back to back for this step (1 = an ordinary step)."""
        k = self.num_decode_steps
        if (k <= 1 or out.num_decodes != len(out.chunks) or out.preempted or self.scheduler.num_waiting
                or any(ch.start + k > self.runner.max_seq_len for ch in out.chunks)
                or any(_host_each_step(ch.seq.params) for ch in out.chunks)):
            return 1
        return k if self.scheduler.reserve_decode_steps(out, k) else 1

    def _decode_steps(self, out: SchedulerOutput, num_steps: int) -> tuple[list[list[int]], list[dict]]:
        """(tokens[j][b]: the token of out's chunk b at decode step j, and per step the
        seq_id -> logprobs of the rows that ask), sampled on the device, in the batched part
        (a sampling fault here fails the whole step); the batch's penalty state advances on the
        device between steps."""
        forks = [self._forks[ch.seq.seq_id] for ch in out.chunks]
        batch, outs = self._batch(forks), []

        def sample(logits: torch.Tensor) -> torch.Tensor:
            outs.append(self.sampler.sample(logits, batch))
            return outs[-1].tokens

        self.runner.execute_decode_steps(out, num_steps, sample)
        tokens, flats = _read_samples(outs)  # the one host read of the whole run
        seqs = [f.seq for f in forks]
        return tokens, [_logprob_records(so, seqs, row, flat) for so, row, flat in zip(outs, tokens, flats)]

    def _commit_decode_steps(self, out: SchedulerOutput, tokens: list[list[int]], logprobs: list[dict],
                             touched: dict[int, _Request]) -> None:
        """Commit the decode steps one by one; a sequence that stops (or fails) takes no more."""
        seqs = [ch.seq for ch in out.chunks]
        for j, row in enumerate(tokens):
            live = [(b, seq) for b, seq in enumerate(seqs) if seq.status is SequenceStatus.RUNNING]
            if not live:
                break
            step_out = out if j == 0 else SchedulerOutput(
                chunks=[ScheduledChunk(seq, seq.num_computed_tokens, 1) for _, seq in live])
            self._commit(step_out, {seq.seq_id: row[b] for b, seq in live}, logprobs[j], touched)

    def _completions(self, req: _Request) -> list[_Fork]:
        """The forks a request returns: all n in index order, or with best_of the n of highest
        cumulative logprob, best first."""
        if req.params.num_forks == req.params.n:
            return req.forks
        return sorted(req.forks, key=lambda f: -f.cumulative_logprob)[:req.params.n]

    def _output(self, req: _Request) -> RequestOutput:
        self._forget(req)
        keep_lp = req.params.logprobs is not None
        outs = [CompletionOutput(i, list(f.seq.output_token_ids), f.detok.text, f.seq.finish_reason,
                                 list(f.logprobs) if keep_lp else None,
                                 f.cumulative_logprob if f.seq.params.needs_logprobs else None, f.error)
                for i, f in enumerate(self._completions(req))]
        first = outs[0]
        return RequestOutput(request_id=req.seq.seq_id, prompt=req.prompt, prompt_token_ids=req.seq.prompt_token_ids,
                             token_ids=first.token_ids, text=first.text, finish_reason=first.finish_reason,
                             error=req.error, num_cached_tokens=req.seq.num_cached_tokens or 0,
                             logprobs=first.logprobs, prompt_logprobs=req.prompt_logprobs, outputs=outs)

    @staticmethod
    def _normalise(prompts, prompt_token_ids, sampling_params):
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
        items = [(prompts[i] if prompts is not None else None,
                  prompt_token_ids[i] if prompt_token_ids is not None else None, params[i]) for i in range(n)]
        return items

    # -- public API -----------------------------------------------------------------------------
    def generate(self, prompts: list[str] | str | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None) -> list[RequestOutput]:
        """Generate completions for a batch of prompts (continuous batching); outputs in input order.
        A bad prompt or params raise ValueError and run none of them; a request that fails while
        running comes back with finish_reason "error" and its `error`, the others complete."""
        reqs = []
        try:
            for p, ids, sp in self._normalise(prompts, prompt_token_ids, sampling_params):
                reqs.append(self._add(p, ids, sp))
        except Exception:  # one bad prompt rejects the whole call: nothing stays queued
            for r in reqs:
                self._abort(r)
            raise
        while not all(r.is_finished for r in reqs):
            self.step()
        return [self._output(r) for r in reqs]

    def generate_stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                        prompt_token_ids: list[int] | None = None) -> Iterator[StreamDelta]:
        """Yield the completion of one prompt piece by piece as it is generated (if it fails, the
        last delta has finish_reason "error" and its `error`). With n > 1 the completions'
        deltas interleave (StreamDelta.index); with best_of > n they come whole at the end."""
        [(p, ids, sp)] = self._normalise(prompt, prompt_token_ids, sampling_params)
        req = self._add(p, ids, sp)
        try:
            while not req.is_finished:
                if req in self.step() or req.is_finished:
                    yield from self._deltas(req)
        finally:  # also when the caller stops iterating early: free the request's pages
            self._abort(req)

    def _deltas(self, req: _Request) -> list[StreamDelta]:
        """What req's forks produced since their last deltas (each fork's last one carries its
        finish reason, and with "error" the error); the request's first delta carries the prompt
        logprobs. best_of > n: nothing until every fork is done, then the n kept, whole."""
        if req.params.num_forks > req.params.n:
            if not req.is_finished or req.forks[0].final_sent:
                return []
            forks = list(enumerate(self._completions(req)))
            for f in req.forks:
                f.final_sent = True
                f.emitted_tokens = f.emitted_logprobs = 0
        else:
            forks = [(f.index, f) for f in req.forks]
        deltas = []
        for index, f in forks:
            seq = f.seq
            new_tokens = seq.output_token_ids[f.emitted_tokens:]
            f.emitted_tokens = len(seq.output_token_ids)
            text = f.detok.text if req.params.num_forks > req.params.n else f.detok.delta(final=seq.is_finished)
            done = seq.is_finished and not (f.final_sent and req.params.num_forks == req.params.n)
            if not (new_tokens or text or done):
                continue
            f.final_sent = f.final_sent or seq.is_finished
            lps = None
            if req.params.logprobs is not None:
                lps, f.emitted_logprobs = f.logprobs[f.emitted_logprobs:], len(f.logprobs)
            deltas.append(StreamDelta(new_tokens, text, seq.finish_reason, f.error, req.seq.num_cached_tokens or 0,
                                      index, lps))
        if deltas and req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            deltas[0].prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return deltas

    def _delta(self, req: _Request) -> StreamDelta | None:
        """`_deltas` of a request of one completion (n = 1): its one delta or None."""
        deltas = self._deltas(req)
        if len(deltas) > 1:
            raise ValueError(f"request {req.seq.seq_id} has {req.params.n} completions: read them with _deltas")
        return deltas[0] if deltas else None

    def _abort(self, req: _Request) -> None:
        """Finish a request's forks (those still running) and forget it; its KV pages are freed."""
        req.spawned = True
        for f in req.forks:
            if not f.seq.is_finished:
                self.scheduler.finish(f.seq, "abort")
        self._forget(req)

    def _forget(self, req: _Request) -> None:
        self._requests.pop(req.seq.seq_id, None)
        for f in req.forks:
            self._forks.pop(f.seq.seq_id, None)


def load_rank(engine_dir: str | Path, opts: LoadOptions, rank: int = 0):
    """Rank `rank`'s engine (its weight shard, its view of the model) with the load's plan
    changes applied (runtime knobs, token drop on/off): what LLM and each TP worker serve."""
    engine = load_engine(engine_dir, opts.device, opts.jit, rank=rank)
    config = engine.config
    plan = apply_runtime_overrides(config.plan, opts.infinitehip_overrides)
    if opts.token_drop is not None:
        plan = dataclasses.replace(plan, token_drop=_token_drop_override(plan.token_drop, opts.token_drop))
    engine.config = dataclasses.replace(config, plan=plan)
    return engine


def make_runner(engine, opts: LoadOptions) -> tuple[ModelRunner, int, int, int]:
    """(runner, max_num_seqs, token budget per step, decode steps run back to back) of a load;
    every TP rank makes the same one (runtime/distributed/worker.py)."""
    num_decode_steps = opts.num_decode_steps or (8 if engine.device.type == "cuda" else 1)
    build = engine.config.build
    max_num_seqs = opts.max_num_seqs or build.max_batch_size
    budget = opts.max_num_batched_tokens or build.max_num_batched_tokens
    if budget < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({max_num_seqs})")
    with serving(engine.kernels):  # graph capture launches every decode kernel once
        runner = ModelRunner(engine, max_num_seqs, budget, opts.kv_cache_memory_bytes,
                             enforce_eager=opts.enforce_eager, max_decode_steps=num_decode_steps,
                             kv_offload_bytes=opts.kv_offload_bytes)
    return runner, max_num_seqs, budget, num_decode_steps


def prefix_caching_rule(plan, page_size: int) -> dict:
    """KVCacheManager.enable_prefix_caching's arguments for ``plan`` (docs/design/prefix_caching.md,
    "Exactness per plan"; token drop's rule is the scheduler's prefix_filter). InfiniteHiP prefill is
    block-causal (a query block of ``block_q`` reads only keys before its end), and no state but
    K/V survives a prefill (mask caches and key banks are decode state, rebuilt at the first
    sparse decode step; the raw-keys scratch lives one step): so a reused prefix is a multiple of
    lcm(page_size, block_q), which keeps the suffix's query blocks on the prefix's grid, and pages
    that sparse decode steps filled are not named (prefill would compute them otherwise)."""
    ih = plan.infinitehip
    if ih is None:
        return {}
    return dict(granule=math.lcm(page_size, ih.block_q), cache_decode_pages=False)


_PROMPT_LOGPROB_ROWS = 512  # prompt positions per LM-head slice ([rows, vocab] float32 at a time)


def _host_each_step(p: SamplingParams) -> bool:
    """Whether a request's sampling needs the host between decode steps (then the engine runs
    one at a time): a multi-token bad word is matched against the output on the host, a grammar
    advances on the host with each token."""
    return p.structured_outputs is not None or any(len(q) > 1 for q in p.bad_words_token_ids or ())


def _pack_logprobs(lp: torch.Tensor, chosen: torch.Tensor, k: int) -> torch.Tensor:
    """One flat float32 tensor of rows' [logprob, rank, k top logprobs, k top ids] (ids and ranks
    are exact in float32 below 2**24), so that the host reads them in one copy."""
    c = lp.gather(1, chosen[:, None])
    rank = (lp > c).sum(dim=-1, keepdim=True).float() + 1
    parts = [c, rank]
    if k:
        top_lp, top_ids = lp.topk(k, dim=-1)
        parts += [top_lp, top_ids.float()]
    return torch.cat(parts, dim=1).flatten()


def _unpack_logprobs(flat: list[float], chosen: list[int], k: int) -> list[TokenLogprobs]:
    w = 2 + 2 * k
    out = []
    for j, tok in enumerate(chosen):
        r = flat[j * w:(j + 1) * w]
        out.append(TokenLogprobs(tok, r[0], int(r[1]), [(int(i), x) for x, i in zip(r[2:2 + k], r[2 + k:])]))
    return out


def _read_samples(outs: list[SamplerOutput]) -> tuple[list[list[int]], list[list[float] | None]]:
    """The tokens of each SamplerOutput and its packed logprobs (`_logprob_records`' input, None
    where no row asked), read to the host in one copy: float64 holds token ids, ranks and the
    float32 logprobs exactly."""
    parts = [torch.stack([so.tokens for so in outs]).flatten().double()]
    sizes = []
    for so in outs:
        if so.logprob_rows:
            k = so.top_ids.shape[1] if so.top_ids is not None else 0
            cols = [so.logprobs[:, None], so.ranks[:, None].float()]
            cols += [so.top_logprobs, so.top_ids.float()] if k else []
            parts.append(torch.cat(cols, dim=1).flatten().double())
            sizes.append(parts[-1].numel())
        else:
            sizes.append(0)
    flat = torch.cat(parts).tolist()
    b = outs[0].tokens.numel()
    tokens = [[int(t) for t in flat[j * b:(j + 1) * b]] for j in range(len(outs))]
    at, lps = len(outs) * b, []
    for n in sizes:
        lps.append(flat[at:at + n] if n else None)
        at += n
    return tokens, lps


def _logprob_records(so: SamplerOutput, seqs: list[Sequence], tokens: list[int],
                     flat: list[float] | None) -> dict[int, TokenLogprobs]:
    """seq_id -> the sampled token's TokenLogprobs (top cut to the row's own k) for the rows of
    ``so`` that computed them; tokens and flat: as `_read_samples` read them."""
    if not so.logprob_rows:
        return {}
    k = so.top_ids.shape[1] if so.top_ids is not None else 0
    recs = _unpack_logprobs(flat, [tokens[row] for row in so.logprob_rows], k)
    out = {}
    for row, r in zip(so.logprob_rows, recs):
        seq = seqs[row]
        r.top = r.top[:seq.params.logprobs or 0]
        out[seq.seq_id] = r
    return out


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


def _token_drop_override(built, value):
    """The token-drop config of a load: `value` (bool or dict of knobs) over the engine's `built`."""
    if isinstance(value, bool):
        return (built or TokenDropConfig()) if value else None
    return (built or TokenDropConfig()).replace(**value)  # a dict (LoadOptions checked the type)
