"""Prefix caching on a long document: a document + question, then follow-up questions
that share the document; TTFT of each and decode speed, with the document's KV pages cached on
the GPU, cached in pinned host memory (KV offloading), and on a dense engine.

    python -m benchmarks.speed.bench_prefix_cache --out $OUT            # one H200, under 8 minutes
    python -m benchmarks.speed.bench_prefix_cache --smoke --out /tmp/pc  # tiny shapes on CPU: the code runs

Llama-3.1-8B shapes, random weights (``infhip-build --model llama-3.1-8b --random-weights``, the
builder API here), bf16 weights, batch 1, CUDA graphs, the engine's prefill chunk (32768). Cases,
in this order (the most important first; each is skipped, and said so, when the time left under
``--deadline-s`` is below its estimate, and a request running past the deadline is aborted):

1. ``3k-flash fp8``: a 3k-flash engine with an fp8 KV cache, the whole document on the GPU;
2. ``3k-flash fp8 offloaded``: the same engine loaded with a small GPU cache and
   ``kv_offload_bytes`` for the document: its middle pages live in pinned host memory, and stay
   cached there between the questions; ``--in-place-follow-ups`` more follow-ups then run with
   prefill staging off (a short chunk reads the host pages in place instead of copying them all);
3. ``dense 128K``: a dense engine (bf16 KV) with a ``--dense-doc-tokens`` document.

Expected time on an H200 (from earlier runs: 1M uncached TTFT 65 s, builds ~60 s / ~50 s):
about 150 s for case 1 with its build, 110 s for case 2, 80 s for case 3.

Per case: request 0 = document + question 0 (nothing cached: the no-cache TTFT), then
``--follow-ups`` requests = document + question i (the document's pages reused). Per request:
TTFT (wall, from queueing to the first sampled token on the host), cached prompt tokens, and decode
tok/s over the next ``--max-tokens`` - 1 tokens (engine default of 8 fused decode steps). The
goal: every follow-up's TTFT <= 2 s at 1M (64.8 s uncached before), decode tok/s of the follow-ups
equal to the first request's. Prints a table last; JSON to ``--out``/bench_prefix_cache.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

GiB = 1 << 30
# Test-sized InfiniteHiP knobs for --smoke (tests/test_infinitehip_runtime.py's TINY, sparse from 30 tokens).
SMOKE_IH = dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0],
                special_final_k=16, dense_threshold=30)


class Deadline:
    """Wall-clock guard: ``left()`` seconds before the script must be done."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def engine_config(work: Path, smoke: bool) -> Path:
    """The llama-3.1-8b config (a tiny variant of it for --smoke) as a checkpoint to build from."""
    from infhip.builder.registry import bundled_config

    cfg = json.loads(bundled_config("llama-3.1-8b").read_text())
    if smoke:
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=128, bos_token_id=1,
                   eos_token_id=2)
        cfg["rope_scaling"]["original_max_position_embeddings"] = 64
    src = work / "src" / "config.json"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(json.dumps(cfg))
    return src


def build(work: Path, name: str, max_len: int, kv_dtype: str, preset: str | None, smoke: bool) -> Path:
    from infhip.builder.build import build_engine

    kw = dict(dtype="float32", device="cpu", max_num_batched_tokens=64) if smoke else dict(dtype="bfloat16",
                                                                                          device="cuda")
    if preset != "dense" and smoke:
        kw["infinitehip_overrides"] = SMOKE_IH
    return build_engine(checkpoint=engine_config(work, smoke), output_dir=work / name, preset=preset,
                        kv_dtype=None if kv_dtype == "bfloat16" else kv_dtype,  # None: the weights' dtype
                        random_weights=True, max_seq_len=max_len, max_batch_size=1,
                        force=True, progress=False, **kw)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ask(llm, prompt: list[int], max_tokens: int, deadline: Deadline) -> dict:
    """One request alone, step by step: TTFT, cached tokens, decode tok/s after the first token."""
    from infhip import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    req = llm.core.add_request(None, prompt, params)
    seq = req.seq
    t_first = t_last = None
    while not seq.is_finished:
        if deadline.left() < 0:
            llm.core.abort(req)
            return {"prompt_tokens": len(prompt), "aborted": "deadline", "computed": seq.num_computed_tokens,
                    "seconds": round(time.perf_counter() - t0, 2)}
        llm.core.step()  # ends with the sampled tokens on the host
        n = len(seq.output_token_ids)
        if n and t_first is None:
            t_first = time.perf_counter()
        t_last = time.perf_counter()
    n = len(seq.output_token_ids)
    llm.core.abort(req)  # finished: the core forgets it
    return {"prompt_tokens": len(prompt), "cached_tokens": seq.num_cached_tokens, "ttft_s": round(t_first - t0, 3),
            "output_tokens": n,
            "decode_tok_s": round((n - 1) / (t_last - t_first), 1) if n > 1 and t_last > t_first else None}


def conversation(llm, doc: list[int], questions: list[list[int]], max_tokens: int, deadline: Deadline) -> list:
    rows = []
    for i, q in enumerate(questions):
        r = ask(llm, doc + q, max_tokens, deadline)
        rows.append(r)
        print(f"    request {i}: {json.dumps(r)}", flush=True)
        if "aborted" in r:
            print(f"    deadline: the remaining {len(questions) - i - 1} request(s) skipped", flush=True)
            break
    return rows


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def per_token_bytes(llm) -> int:
    """KV bytes of one token over all layers (fp8 scales included)."""
    a = llm.engine.model.layers[0].self_attn
    scales = 2 * 4 * a.kv.k.shape[2] if a.kv.k_scale is not None else 0
    return len(llm.engine.model.layers) * (2 * a.kv.k[0, 0].numel() * a.kv.k.element_size() + scales)


def free_memory() -> None:
    gc.collect()  # an LLM's reference cycles hold its KV cache until collected
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/infhip-prefix-cache"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks that the script runs)")
    p.add_argument("--doc-tokens", type=int, default=1_000_000)
    p.add_argument("--dense-doc-tokens", type=int, default=128_000)
    p.add_argument("--offload-doc-tokens", type=int, default=None, help="default: --doc-tokens")
    p.add_argument("--question-tokens", type=int, default=64)
    p.add_argument("--follow-ups", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=97, help="tokens each request generates")
    p.add_argument("--kv-dtype", choices=("bfloat16", "fp8"), default="fp8")
    p.add_argument("--gpu-kv-gib", type=float, default=16, help="GPU KV cache of the offloaded case")
    p.add_argument("--in-place-follow-ups", type=int, default=2,
                   help="offloaded case: this many more follow-ups with prefill staging off")
    p.add_argument("--cases", default="3k-flash,offload,dense",
                   help="which cases, in this order (each is skipped when the deadline leaves too little time)")
    p.add_argument("--deadline-s", type=float, default=450,
                   help="the script stops starting work after this many seconds (the device call's limit is 600)")
    args = p.parse_args()
    deadline = Deadline(args.deadline_s)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        import infhip.runtime.offload.policy as policy

        policy.OFFLOAD_BATCH_TOKENS = 16  # tiny contexts: move pages a page at a time
        args.doc_tokens, args.dense_doc_tokens = min(args.doc_tokens, 200), min(args.dense_doc_tokens, 100)
        args.question_tokens, args.max_tokens = min(args.question_tokens, 12), min(args.max_tokens, 6)
    offload_doc = args.offload_doc_tokens or args.doc_tokens
    cases = args.cases.split(",")

    from infhip import LLM

    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}, "cases": {}, "skipped": []}
    q_len, slack = args.question_tokens, 8192 if not args.smoke else 64
    sparse_engine = None
    prefill_s = None  # the uncached 1M TTFT, once measured: the estimate of the offloaded case

    def run_case(name: str, engine: Path, doc_len: int, estimate_s: float, **load) -> dict | None:
        if deadline.left() < estimate_s:
            msg = f"{name}: skipped, {deadline.left():.0f} s left, about {estimate_s:.0f} s needed"
            print(msg, flush=True)
            res["skipped"].append(msg)
            return None
        try:
            return _run_case(name, engine, doc_len, **load)
        except Exception as e:  # noqa: BLE001 - record it, go on with the other cases
            import traceback
            traceback.print_exc()
            res["skipped"].append(f"{name}: failed: {type(e).__name__}: {e}")
        free_memory()  # out of the except clause: the traceback and the LLM its frames held are gone
        return None

    def _run_case(name: str, engine: Path, doc_len: int, **load) -> dict:
        t0 = time.perf_counter()
        llm = LLM(engine, max_num_seqs=1, **load)
        vocab = llm.engine.config.model.vocab_size
        doc = tokens(doc_len, 1, vocab)
        questions = [tokens(q_len, 100 + i, vocab) for i in range(1 + args.follow_ups)]
        print(f"{name}: loaded in {time.perf_counter() - t0:.1f} s, prefix caching {llm.core.prefix_caching}", flush=True)
        rows = conversation(llm, doc, questions, args.max_tokens, deadline)
        staging = llm.runner.staging
        if staging is not None and args.in_place_follow_ups and len(rows) == len(questions) \
                and "aborted" not in rows[-1]:
            # offloaded: follow-ups whose prefill reads the host pages in place instead of staging
            # every one of them to the GPU first (a short chunk reads few of them)
            staging.enabled = False
            more = [tokens(q_len, 200 + i, vocab) for i in range(args.in_place_follow_ups)]
            print("    staging off (prefill reads host pages in place):", flush=True)
            for r in conversation(llm, doc, more, args.max_tokens, deadline):
                rows.append(dict(r, staging="off"))
            staging.enabled = True
        kv = llm.runner.kv
        stats = llm.stats()
        out = {"doc_tokens": doc_len, "prefix_caching": llm.core.prefix_caching, "load_s": round(time.perf_counter() - t0, 1),
               "requests": rows, "kv_pages_cached": stats.kv_pages_cached,
               "host_pages_used": stats.host_pages_used, "prefix_cache_hits": stats.prefix_cache_hits,
               "host_pages_cached": {g: kv.num_cached_host_pages(g) for g in kv.groups},
               "per_token_bytes": per_token_bytes(llm)}
        res["cases"][name] = out
        del llm, kv, staging  # the last references: the next case needs the GPU memory (and pinned pages)
        free_memory()
        return out

    def resident() -> None:
        nonlocal prefill_s
        out = run_case(f"3k-flash {args.kv_dtype}", sparse_engine, args.doc_tokens, 30 + args.doc_tokens / 12_000)
        if out and out["requests"] and "ttft_s" in out["requests"][0]:
            prefill_s = out["requests"][0]["ttft_s"]

    def offloaded() -> None:
        per_token = res["cases"].get(f"3k-flash {args.kv_dtype}", {}).get("per_token_bytes")
        if per_token is None:  # no resident case ran: Llama-3.1-8B shapes (the smoke config's)
            per_token = (32 * 2 * (8 * 128 + 4 * 8) if args.kv_dtype == "fp8" else 32 * 2 * 8 * 128 * 2) \
                if not args.smoke else 2 * 2 * (2 * 16 * (1 if args.kv_dtype == "fp8" else 2) + 4 * 2)
        gpu_kv = int(args.gpu_kv_gib * GiB) if not args.smoke else None
        estimate = 40 + 1.4 * (prefill_s or offload_doc / 12_000)
        run_case(f"3k-flash {args.kv_dtype} offloaded", sparse_engine, offload_doc, estimate,
                 kv_cache_memory_bytes=gpu_kv, kv_offload_bytes=int(1.05 * (offload_doc + q_len + slack) * per_token))

    def dense() -> None:
        t0 = time.perf_counter()
        if deadline.left() < 60 + args.dense_doc_tokens / 10_000:
            res["skipped"].append(f"dense: skipped before its build, {deadline.left():.0f} s left")
            print(res["skipped"][-1], flush=True)
            return
        engine = build(args.work, "dense", args.dense_doc_tokens + q_len + slack, "bfloat16", "dense", args.smoke)
        print(f"dense engine built in {time.perf_counter() - t0:.0f} s", flush=True)
        run_case(f"dense {args.dense_doc_tokens // 1000}K" if not args.smoke else "dense", engine,
                 args.dense_doc_tokens, 15 + args.dense_doc_tokens / 10_000)

    t0 = time.perf_counter()
    if "3k-flash" in cases or "offload" in cases:
        sparse_engine = build(args.work, "3k-flash", max(args.doc_tokens, offload_doc) + q_len + slack,
                              args.kv_dtype, "3k-flash", args.smoke)
        print(f"3k-flash engine built in {time.perf_counter() - t0:.0f} s", flush=True)
    for case in cases:  # in the order given: the most important first
        {"3k-flash": resident, "offload": offloaded, "dense": dense}[case]()

    (args.out / "bench_prefix_cache.json").write_text(json.dumps(res, indent=2))
    print(f"\n{res['device']}  torch {res['torch']}; Llama-3.1-8B shapes{' (smoke: tiny)' if args.smoke else ''}, "
          f"random weights, batch 1; request 0 uncached, the others share its document")
    print(f"{'case':<28}{'req':>4}{'prompt':>10}{'cached':>10}{'TTFT s':>9}{'tok/s':>8}  note")
    for name, case in res["cases"].items():
        for i, r in enumerate(case["requests"]):
            if "aborted" in r:
                print(f"{name:<28}{i:>4}{r['prompt_tokens']:>10}  aborted at the deadline")
                continue
            note = "staging off" if r.get("staging") == "off" else ""
            print(f"{name:<28}{i:>4}{r['prompt_tokens']:>10}{r['cached_tokens']:>10}{r['ttft_s']:>9.3f}"
                  f"{r['decode_tok_s'] or 0:>8.1f}  {note}")
        print(f"{'':<28}cached pages: GPU {case['kv_pages_cached']}, host {case['host_pages_cached']}")
    for msg in res["skipped"]:
        print(f"SKIPPED {msg}")


if __name__ == "__main__":
    sys.exit(main())
