"""The in-process benchmarks of infhip-bench: `latency`, `throughput` and `long`, on an `LLM`.

Every request here runs through `LLM.core` (runtime/engine_core.py) as `LLM.generate` runs it,
timed per engine step: a request's first token is seen in the step that produced it, so TTFT
and TPOT are what a caller of `generate_stream` would see (no HTTP). Prompts are random token
ids (the lengths are exact, no tokenizer needed) unless a dataset gives text.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from infhip.runtime.bench.stats import summary
from infhip.runtime.sampling_params import SamplingParams


def random_prompts(n: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """n prompts of input_len random token ids (ids 3.. skip the usual BOS / EOS / pad)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(input_len)] for _ in range(n)]


def vocab_of(llm) -> int:
    return llm.engine.config.model.vocab_size


def fixed_params(output_len: int) -> SamplingParams:
    """Greedy, every request generates exactly output_len tokens (as vLLM's benchmarks: ignore_eos)."""
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def timed_batch(llm, prompts: list, params: SamplingParams | list[SamplingParams], progress: bool = False) -> dict:
    """Run prompts (token-id lists or text) together; per request: TTFT, end-to-end time and
    output tokens (seconds); plus the batch's wall time. ``progress``: a bar of finished requests."""
    from tqdm import tqdm

    core = llm.core
    bar = tqdm(total=len(prompts), desc="requests", unit="req", disable=not progress)
    params = params if isinstance(params, list) else [params] * len(prompts)
    t0 = time.perf_counter()
    reqs = [core.add_request(p if isinstance(p, str) else None, None if isinstance(p, str) else p, sp)
            for p, sp in zip(prompts, params)]
    first: dict[int, float] = {}
    end: dict[int, float] = {}
    try:
        while len(end) < len(reqs):
            core.step()
            now = time.perf_counter() - t0
            for i, r in enumerate(reqs):
                if i not in first and r.seq.num_output_tokens > 0:
                    first[i] = now
                if i not in end and r.is_finished:
                    end[i] = now
                    first.setdefault(i, now)
                    bar.update(1)
        outs = [core.output(r) for r in reqs]
    finally:
        bar.close()
        for r in reqs:
            core.abort(r)
    errors = [o.error for o in outs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} benchmark request(s) failed: {errors[0]}")
    return {"wall_s": max(end.values()), "ttft_s": [first[i] for i in range(len(reqs))],
            "e2e_s": [end[i] for i in range(len(reqs))], "output_tokens": [len(o.token_ids) for o in outs],
            "input_tokens": [len(o.prompt_token_ids) for o in outs]}


def tpot_of(run: dict) -> list[float]:
    """Per request: (end - first token) / (output tokens - 1); requests of one token have none."""
    return [(e - f) / (n - 1) for f, e, n in zip(run["ttft_s"], run["e2e_s"], run["output_tokens"]) if n > 1]


def latency(llm, input_len: int, output_len: int, batch_size: int = 1, num_iters: int = 10, warmup: int = 2,
            progress: bool = True) -> dict:
    """vLLM's `bench latency`: one batch of batch_size prompts, num_iters times (after warmup
    untimed runs); latency, TTFT and TPOT as mean / median / p99 in ms."""
    from tqdm import tqdm

    prompts = random_prompts(batch_size, input_len, vocab_of(llm))
    params = fixed_params(output_len)
    for _ in range(warmup):
        timed_batch(llm, prompts, params)
    runs = [timed_batch(llm, prompts, params)
            for _ in tqdm(range(num_iters), desc="latency", unit="run", disable=not progress)]
    return {"input_len": input_len, "output_len": output_len, "batch_size": batch_size, "num_iters": num_iters,
            "latency_ms": summary([r["wall_s"] for r in runs], 1000),
            "ttft_ms": summary([t for r in runs for t in r["ttft_s"]], 1000),
            "tpot_ms": summary([t for r in runs for t in tpot_of(r)], 1000),
            "latencies_s": [r["wall_s"] for r in runs]}


def dataset_requests(path: Path, tokenizer, limit: int | None) -> list[tuple[object, int]]:
    """(prompt, output_len) per line of a JSONL file: {"prompt": text | [ids], "output_len": n} or
    {"input_len": n, "output_len": m} (random ids of that length)."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append((row["prompt"] if "prompt" in row else int(row["input_len"]), int(row["output_len"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} line {i + 1}: want {{\"prompt\" or \"input_len\", \"output_len\"}} ({e})") from None
        if isinstance(out[-1][0], str) and tokenizer is None:
            raise ValueError(f"{path} line {i + 1}: a text prompt needs an engine with a tokenizer")
        if limit is not None and len(out) == limit:
            break
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out


def throughput(llm, num_prompts: int, input_len: int, output_len: int, dataset: Path | None = None,
               progress: bool = True) -> dict:
    """vLLM's `bench throughput`: every request at once (offline, continuous batching); requests,
    total and output tokens per second. Lengths fixed, or shaped by a dataset (dataset_requests)."""
    if dataset is not None:
        rows = dataset_requests(dataset, llm.tokenizer, num_prompts)
        prompts = [p if not isinstance(p, int) else random_prompts(1, p, vocab_of(llm), seed=i)[0]
                   for i, (p, _) in enumerate(rows)]
        params = [fixed_params(n) for _, n in rows]
    else:
        prompts, params = random_prompts(num_prompts, input_len, vocab_of(llm)), fixed_params(output_len)
    timed_batch(llm, prompts[:1], params if not isinstance(params, list) else params[0])  # warm-up
    run = timed_batch(llm, prompts, params, progress=progress)
    n_in, n_out, wall = sum(run["input_tokens"]), sum(run["output_tokens"]), run["wall_s"]
    return {"num_requests": len(prompts), "elapsed_s": wall, "requests_per_s": len(prompts) / wall,
            "total_tokens_per_s": (n_in + n_out) / wall, "output_tokens_per_s": n_out / wall,
            "total_input_tokens": n_in, "total_output_tokens": n_out}


def long_context(llm, contexts: list[int], output_len: int, label: str, progress: bool = True) -> list[dict]:
    """Per context length: one request of that many tokens, its TTFT and decode speed (output
    tokens after the first per second)."""
    from tqdm import tqdm

    timed_batch(llm, random_prompts(1, min(contexts), vocab_of(llm)), fixed_params(2))  # warm-up
    rows = []
    for ctx in tqdm(contexts, desc=f"long ({label})", unit="context", disable=not progress):
        prompt = random_prompts(1, ctx, vocab_of(llm), seed=ctx)
        run = timed_batch(llm, prompt, fixed_params(output_len))
        n, ttft, e2e = run["output_tokens"][0], run["ttft_s"][0], run["e2e_s"][0]
        rows.append({"label": label, "context": ctx, "ttft_ms": ttft * 1000,
                     "decode_tok_s": (n - 1) / (e2e - ttft) if n > 1 and e2e > ttft else None,
                     "output_tokens": n})
    return rows


def dense_overrides(config) -> dict:
    """The load overrides that run an engine's plan densely: every step transform off, every
    attention backend below its dense threshold for any context (a backend without such a
    knob cannot be run densely by a load: ValueError says to pass --dense-engine)."""
    from infhip.methods import BACKEND, method

    out = {}
    for name in config.plan.knobs:
        m = method(name)
        if m.kind != BACKEND:
            out[name] = False
        elif "dense_threshold" in m.load_keys():
            out[name] = {"dense_threshold": config.build.max_seq_len + 1}
        else:
            raise ValueError(f"{name} has no load knob that makes it dense; build a dense engine and pass --dense-engine")
    return out
