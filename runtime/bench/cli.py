"""infhip-bench: benchmark an engine on this machine, or any OpenAI-compatible server.

    infhip-bench latency    --engine E [--input-len 128 --output-len 32 --batch-size 1 --num-iters 10]
    infhip-bench throughput --engine E [--num-prompts 64 --input-len 128 --output-len 32 | --dataset F.jsonl]
    infhip-bench serve      --url http://127.0.0.1:8000 [--concurrency 1,8,32 --num-prompts 64 ...]
    infhip-bench long       --engine E --contexts 4096,16384,65536 [--output-len 32] [--dense-engine D]

Each prints a table (serve: also vLLM's result block per concurrency, so the numbers compare
with `vllm bench serve`'s), writes --json, and with --plot a PNG (if matplotlib is installed).
latency / throughput / long take LLM's load options (runtime/options.py), as infhip-run does.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

from infhip.runtime.bench import offline, serve, stats


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"want integers >= 1, got {text!r}")
    return values


def make_parser() -> argparse.ArgumentParser:
    from infhip.runtime.options import add_load_options

    p = argparse.ArgumentParser(prog="infhip-bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def common(q, engine: bool):
        if engine:
            q.add_argument("--engine", required=True, help="engine directory written by infhip-build")
            add_load_options(q)
        q.add_argument("--json", type=Path, default=None, help="write the results here")
        q.add_argument("--plot", type=Path, default=None, help="write a PNG plot here (needs matplotlib)")
        q.add_argument("--no-progress", action="store_true", help="no progress bars")

    q = sub.add_parser("latency", help="batch latency, TTFT and TPOT over repeated runs (vllm bench latency)")
    common(q, True)
    q.add_argument("--input-len", type=int, default=128)
    q.add_argument("--output-len", type=int, default=32)
    q.add_argument("--batch-size", type=int, default=1)
    q.add_argument("--num-iters", type=int, default=10)
    q.add_argument("--num-iters-warmup", type=int, default=2)

    q = sub.add_parser("throughput", help="offline requests and tokens per second (vllm bench throughput)")
    common(q, True)
    q.add_argument("--num-prompts", type=int, default=64)
    q.add_argument("--input-len", type=int, default=128)
    q.add_argument("--output-len", type=int, default=32)
    q.add_argument("--dataset", type=Path, default=None,
                   help='JSONL of {"prompt": text or ids, "output_len": n} or {"input_len": n, "output_len": m}')

    q = sub.add_parser("serve", help="fixed concurrencies against an OpenAI-compatible URL (vllm bench serve)")
    common(q, False)
    q.add_argument("--url", required=True, help="server base URL (http://host:port or .../v1)")
    q.add_argument("--model", default=None, help='"model" of each request (default: none; ours serves its one)')
    q.add_argument("--api-key", default=None)
    q.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="comma-separated (default 1,8,32)")
    q.add_argument("--num-prompts", type=int, default=None, help="requests per concurrency (default 4 x concurrency)")
    q.add_argument("--input-len", type=int, default=128)
    q.add_argument("--output-len", type=int, default=32)
    q.add_argument("--vocab-size", type=int, default=256,
                   help="prompts are random token ids below this (default 256: valid for any real model)")

    q = sub.add_parser("long", help="TTFT and decode speed at given context lengths, dense vs the engine's plan")
    common(q, True)
    q.add_argument("--contexts", type=_ints, required=True, help="comma-separated context lengths in tokens")
    q.add_argument("--output-len", type=int, default=32)
    q.add_argument("--dense-engine", default=None,
                   help="a dense engine to compare with (default: this engine loaded dense: transforms off, "
                        "sparse attention below its dense threshold)")
    q.add_argument("--plan-only", action="store_true", help="skip the dense run")
    return p


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    for name in ("input_len", "output_len", "batch_size", "num_iters", "num_prompts"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            print(f"infhip-bench: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        payload, rows, columns, plot = globals()[f"_{args.command}"](args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"infhip-bench: error: {e}", file=sys.stderr)
        return 2
    stats.table(rows, columns)
    stats.write_json(args.json, {"command": args.command, "args": {k: v for k, v in vars(args).items()}, **payload})
    note = stats.plot(args.plot, rows, *plot) if plot else None
    if note:
        print(f"infhip-bench: {note}", file=sys.stderr)
    return 0


def _llm(engine: str, args, **overrides):
    from infhip.runtime.llm import LLM
    from infhip.runtime.options import load_options

    opts = load_options(args)
    if overrides:
        opts = type(opts).of(opts, overrides={**(opts.overrides or {}), **overrides})
    return LLM(engine, opts)


MS = ".2f"


def _latency(args):
    with _llm(args.engine, args) as llm:
        r = offline.latency(llm, args.input_len, args.output_len, args.batch_size, args.num_iters,
                            args.num_iters_warmup, progress=not args.no_progress)
    row = {"batch": args.batch_size, "input": args.input_len, "output": args.output_len,
           **{f"{k}_{s}": r[f"{k}_ms"][s] for k in ("latency", "ttft", "tpot") for s in ("mean", "median", "p99")}}
    cols = [("batch", "batch", "d"), ("input", "input", "d"), ("output", "output", "d")]
    cols += [(f"{k} {s} ms", f"{k}_{s}", MS) for k in ("latency", "ttft", "tpot") for s in ("mean", "median", "p99")]
    return {"latency": r}, [row], cols, None


def _throughput(args):
    with _llm(args.engine, args) as llm:
        r = offline.throughput(llm, args.num_prompts, args.input_len, args.output_len, args.dataset,
                               progress=not args.no_progress)
    cols = [("requests", "num_requests", "d"), ("elapsed s", "elapsed_s", ".2f"), ("req/s", "requests_per_s", ".2f"),
            ("total tok/s", "total_tokens_per_s", ".1f"), ("output tok/s", "output_tokens_per_s", ".1f")]
    return {"throughput": r}, [r], cols, None


def _serve(args):
    results = []
    for c in args.concurrency:
        n = args.num_prompts or 4 * c
        prompts = offline.random_prompts(n, args.input_len, args.vocab_size, seed=c)
        r = serve.run_concurrency(args.url, prompts, args.output_len, c, args.model, args.api_key,
                                  progress=not args.no_progress)
        stats.serve_block(r)
        results.append(r)
    if not any(r["completed"] for r in results):
        raise RuntimeError(f"no request to {args.url} succeeded: {results[0]['errors']}")
    cols = [("concurrency", "max_concurrency", "d"), ("ok", "completed", "d"), ("failed", "failed", "d"),
            ("req/s", "request_throughput", ".2f"), ("out tok/s", "output_throughput", ".1f")]
    cols += [(f"{k.upper()} {s} ms", f"{s}_{k}_ms", MS) for k in ("ttft", "tpot", "itl") for s in ("mean", "median", "p99")]
    return {"serve": results}, results, cols, ("max_concurrency", ["output_throughput", "median_ttft_ms"], "serve")


def _long(args):
    from infhip.config import EngineConfig

    rows = []
    with _llm(args.engine, args) as llm:
        rows += offline.long_context(llm, args.contexts, args.output_len, f"plan ({llm.engine.config.plan.preset})",
                                     progress=not args.no_progress)
    gc.collect()
    dense = {} if args.dense_engine else offline.dense_overrides(EngineConfig.load(Path(args.engine)))
    if not args.plan_only and (args.dense_engine or dense):  # a dense plan is its own dense run
        ctx = _llm(args.dense_engine, args) if args.dense_engine else _llm(args.engine, args, **dense)
        with ctx as llm:
            rows += offline.long_context(llm, args.contexts, args.output_len, "dense", progress=not args.no_progress)
    cols = [("run", "label", "s"), ("context", "context", "d"), ("TTFT ms", "ttft_ms", MS),
            ("decode tok/s", "decode_tok_s", ".1f")]
    return {"long": rows}, rows, cols, ("context", ["ttft_ms", "decode_tok_s"], "long context")


if __name__ == "__main__":
    sys.exit(main())
