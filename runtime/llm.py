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
from infhip.runtime.outputs import RequestOutput, StreamDelta
from infhip.runtime.sampler import Sampler, make_generator
from infhip.runtime.sampling_params import SamplingParams
from infhip.runtime.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from infhip.runtime.sequence import Sequence, SequenceStatus
from infhip.runtime.token_drop import never_drops

_log = logging.getLogger(__name__)


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    detok: Detokenizer
    generator: torch.Generator | None
    emitted_tokens: int = 0
    error: str | None = None  # why it failed (finish_reason "error"), else None


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
        self.tokenizer = self.engine.tokenizer
        self.eos_token_ids = tuple(self.engine.config.model.eos_token_ids)
        self._ids = itertools.count()
        self._requests: dict[int, _Request] = {}
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
        """Check one request and make all of its state, then queue it. ValueError (what is wrong,
        what to do) if anything is off; nothing is queued then."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        token_ids = self._prompt_ids(prompt, token_ids)
        # A sequence ends at max_seq_len tokens in all; it always gets at least one output token.
        room = max(1, self.scheduler.max_seq_len - len(token_ids))
        params = params.for_engine(self.engine.config.model.vocab_size, room)
        seq = Sequence(seq_id=next(self._ids), prompt_token_ids=token_ids, params=params)
        req = _Request(seq, prompt, Detokenizer(self.tokenizer, params.stop),
                       make_generator(params.seed, self.runner.device))
        self.scheduler.add(seq)  # its checks (length, KV pages) come before it queues anything
        self._requests[seq.seq_id] = req
        return req

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
                    tokens = self._decode_steps(out, num_steps)
                else:
                    logits = self.runner.execute(out)
        except Exception as e:  # noqa: BLE001 - these requests fail, the engine goes on
            _log.error("a step of %d request(s) failed; failing them all", len(out.chunks), exc_info=e)
            self.engine.tp.abandon(e)  # tensor-parallel: the other ranks are mid-step, later steps refuse
            for ch in out.chunks:
                self._fail(self._requests[ch.seq.seq_id], "in the batched forward of its step", e, touched,
                           log=False)
            return list(touched.values())
        if num_steps > 1:
            self._commit_decode_steps(out, tokens, touched)
        else:
            self._commit(out, self._sample(logits, out, touched), touched)
        return list(touched.values())

    def _per_request_checks(self, out: SchedulerOutput, touched: dict[int, _Request]) -> SchedulerOutput:
        """The step without the sequences that fail before the forward: fault_hook raised, or
        (queued on the scheduler directly, not through _add) no request to report to."""
        keep = []
        for ch in out.chunks:
            req = self._requests.get(ch.seq.seq_id)
            if req is None:
                _log.error("sequence %d was queued without LLM._add; finishing it", ch.seq.seq_id)
                self.scheduler.finish(ch.seq, "error")
                continue
            try:
                if self.fault_hook is not None:
                    self.fault_hook(ch.seq)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(req, "before its step", e, touched)
                continue
            keep.append(ch)
        return out if len(keep) == len(out.chunks) else SchedulerOutput(chunks=keep, preempted=out.preempted)

    def _sample(self, logits: torch.Tensor, out: SchedulerOutput, touched: dict[int, _Request]) -> dict[int, int]:
        """seq_id -> token for the chunks with needs_logits (logits rows in chunk order), sampled
        as one batch; if that raises, row by row, so that only the rows that raise fail. (A
        seeded row may then draw different noise than it would have: the failed batch call may
        have advanced its generator.)"""
        reqs = [self._requests[ch.seq.seq_id] for ch in out.chunks if ch.needs_logits]
        if not reqs:
            return {}
        try:
            tokens = self.sampler(logits, [r.seq.params for r in reqs], [r.generator for r in reqs]).tolist()
            return {r.seq.seq_id: t for r, t in zip(reqs, tokens)}
        except Exception:  # noqa: BLE001 - find the request(s) at fault below
            _log.warning("batched sampling failed; sampling each request alone", exc_info=True)
        sampled = {}
        for i, r in enumerate(reqs):
            try:
                sampled[r.seq.seq_id] = self.sampler(logits[i:i + 1], [r.seq.params], [r.generator]).item()
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(r, "while sampling its token", e, touched)
        return sampled

    def _commit(self, out: SchedulerOutput, sampled: dict[int, int], touched: dict[int, _Request]) -> None:
        """Hand one executed step to the scheduler and apply stop strings to the new text, request
        by request: a fault in one request's bookkeeping or detokenizing fails it alone."""
        for ch in out.chunks:
            seq = ch.seq
            if seq.is_finished:  # failed while sampling
                continue
            req = self._requests[seq.seq_id]
            try:
                self.scheduler.update(SchedulerOutput(chunks=[ch]), sampled, self.eos_token_ids)
                if ch.needs_logits:
                    if req.detok.update(seq.output_token_ids) and not seq.is_finished:
                        self.scheduler.finish(seq, "stop")
                    touched[seq.seq_id] = req
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail(req, "while taking its new token (stop checks, detokenizing)", e, touched)

    def _fail(self, req: _Request, stage: str, exc: BaseException, touched: dict[int, _Request],
              log: bool = True) -> None:
        """Finish req with finish_reason "error" (pages freed) and say why (log: with the
        traceback on this module's logger)."""
        req.error = f"the request failed {stage}: {type(exc).__name__}: {exc}"
        if log:
            _log.error("request %d: %s", req.seq.seq_id, req.error, exc_info=exc)
        if req.seq.is_finished:  # e.g. its last token finished it, then detokenizing failed
            req.seq.finish_reason = "error"
        else:
            self.scheduler.finish(req.seq, "error")
        touched[req.seq.seq_id] = req

    def _num_decode_steps(self, out: SchedulerOutput) -> int:
        """How many decode steps to run back to back for this step (1 = an ordinary step)."""
        k = self.num_decode_steps
        if (k <= 1 or out.num_decodes != len(out.chunks) or out.preempted or self.scheduler.num_waiting
                or any(ch.start + k > self.runner.max_seq_len for ch in out.chunks)):
            return 1
        return k if self.scheduler.reserve_decode_steps(out, k) else 1

    def _decode_steps(self, out: SchedulerOutput, num_steps: int) -> list[list[int]]:
        """tokens[j][b]: the token of out's chunk b at decode step j (sampled on the device, in
        the batched part: a sampling fault here fails the whole step)."""
        reqs = [self._requests[ch.seq.seq_id] for ch in out.chunks]
        params, gens = [r.seq.params for r in reqs], [r.generator for r in reqs]
        steps = self.runner.execute_decode_steps(out, num_steps, lambda logits: self.sampler(logits, params, gens))
        return torch.stack(steps).tolist()  # the one host sync of the whole run

    def _commit_decode_steps(self, out: SchedulerOutput, tokens: list[list[int]],
                             touched: dict[int, _Request]) -> None:
        """Commit the decode steps one by one; a sequence that stops (or fails) takes no more."""
        seqs = [ch.seq for ch in out.chunks]
        for j, row in enumerate(tokens):
            live = [(b, seq) for b, seq in enumerate(seqs) if seq.status is SequenceStatus.RUNNING]
            if not live:
                break
            step_out = out if j == 0 else SchedulerOutput(
                chunks=[ScheduledChunk(seq, seq.num_computed_tokens, 1) for _, seq in live])
            self._commit(step_out, {seq.seq_id: row[b] for b, seq in live}, touched)

    def _output(self, req: _Request) -> RequestOutput:
        self._requests.pop(req.seq.seq_id, None)
        return RequestOutput(request_id=req.seq.seq_id, prompt=req.prompt,
                             prompt_token_ids=req.seq.prompt_token_ids,
                             token_ids=list(req.seq.output_token_ids), text=req.detok.text,
                             finish_reason=req.seq.finish_reason, error=req.error,
                             num_cached_tokens=req.seq.num_cached_tokens or 0)

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
        while not all(r.seq.is_finished for r in reqs):
            self.step()
        return [self._output(r) for r in reqs]

    def generate_stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                        prompt_token_ids: list[int] | None = None) -> Iterator[StreamDelta]:
        """Yield the completion of one prompt piece by piece as it is generated (if it fails, the
        last delta has finish_reason "error" and its `error`)."""
        [(p, ids, sp)] = self._normalise(prompt, prompt_token_ids, sampling_params)
        req = self._add(p, ids, sp)
        try:
            while not req.seq.is_finished:
                if req in self.step() or req.seq.is_finished:
                    delta = self._delta(req)
                    if delta is not None:
                        yield delta
        finally:  # also when the caller stops iterating early: free the request's pages
            self._abort(req)

    def _delta(self, req: _Request) -> StreamDelta | None:
        """What req produced since its last delta (None if nothing yet; the last one carries the
        finish reason, and with "error" the error)."""
        new_tokens = req.seq.output_token_ids[req.emitted_tokens:]
        req.emitted_tokens = len(req.seq.output_token_ids)
        text = req.detok.delta(final=req.seq.is_finished)
        if new_tokens or text or req.seq.is_finished:
            return StreamDelta(new_tokens, text, req.seq.finish_reason, req.error, req.seq.num_cached_tokens or 0)
        return None

    def _abort(self, req: _Request) -> None:
        """Finish a request (if still running) and forget it; its KV pages are freed."""
        if not req.seq.is_finished:
            self.scheduler.finish(req.seq, "abort")
        self._requests.pop(req.seq.seq_id, None)



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
