"""infhip-serve under N concurrent streaming clients vs the same requests through `LLM.generate`.

    python -m benchmarks.speed.bench_serving --engine engines/smollm2-135m --clients 32,128 \
        [--prompt-tokens 64] [--max-tokens 32] [--device cpu|cuda] [--prompt-token-ids] [--out result.json]

For each N in --clients: N requests (prompt of --prompt-tokens tokens, --max-tokens tokens,
greedy, ignore_eos, so every request generates exactly --max-tokens tokens) are

1. generated offline in this process together (infhip-bench's loop, runtime/bench/offline.py:
   `LLM.generate`'s path, after a warm-up call), then
2. sent at once by N concurrent streaming clients (infhip-bench serve's client,
   runtime/bench/serve.py, one connection each) to
   `infhip-serve` started as a subprocess on a free loopback port (so clients and server do not
   share a Python interpreter), after one warm-up request.

Offline runs first and its LLM is freed before the server loads the engine (a GPU holds one
KV cache of 90% of its memory at a time). Prompts: windows of a fixed English text cut to
--prompt-tokens tokens and sent as text, or with --prompt-token-ids (or an engine without a
tokenizer, e.g. an 8B random-weight engine) random token ids sent as ids.

Printed table: requests/s (N / makespan), output tokens/s, TTFT p50/p99 (client-side: send to
the first event carrying tokens; the offline row has none: generate returns whole requests)
and end-to-end p50, and the server's requests/s as a fraction of offline in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
        "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. "
        "And God said, Let there be light: and there was light. And God saw the light, that it was good: and "
        "God divided the light from the darkness. And God called the light Day, and the darkness he called "
        "Night. And the evening and the morning were the first day. ")


def make_prompts(engine: str, n: int, num_tokens: int, random_ids: bool, seed: int = 0) -> list:
    """n prompts of num_tokens tokens: text windows (str) or random token ids (list[int])."""
    from infhip.config import EngineConfig
    from infhip.runtime.engine import load_tokenizer

    rng = random.Random(seed)
    tokenizer = load_tokenizer(Path(engine))
    if random_ids or tokenizer is None:
        vocab = EngineConfig.load(Path(engine)).model.vocab_size
        return [[rng.randrange(vocab) for _ in range(num_tokens)] for _ in range(n)]
    ids = tokenizer(TEXT * (num_tokens // 40 + 4))["input_ids"]
    starts = [rng.randrange(len(ids) - num_tokens) for _ in range(n)]
    return [tokenizer.decode(ids[s:s + num_tokens]) for s in starts]


def offline(engine: str, device: str | None, prompts_by_n: dict[int, list], max_tokens: int) -> dict[int, dict]:
    """requests/s and tokens/s of LLM.generate over each prompt set (one call each, after a warm-up)."""
    from infhip import LLM, SamplingParams
    from infhip.runtime.bench.offline import timed_batch

    llm = LLM(engine, device=device)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    rows = {}
    for n, prompts in prompts_by_n.items():
        timed_batch(llm, prompts[:1], params)  # warm-up (CUDA graphs, allocator)
        run = timed_batch(llm, prompts, params)  # infhip-bench's loop: LLM.generate's path, timed per step
        dt = run["wall_s"]
        rows[n] = {"requests_per_s": n / dt, "tokens_per_s": sum(run["output_tokens"]) / dt, "seconds": dt}
        print(f"[bench_serving] offline, {n} requests: {dt:.1f} s", file=sys.stderr, flush=True)
    del llm
    gc.collect()
    _empty_cuda_cache()
    return rows


def _empty_cuda_cache() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def start_server(engine: str, device: str | None, max_clients: int) -> tuple[subprocess.Popen, str]:
    """infhip-serve on a free loopback port, admitting every client (no 429: the benchmark sends
    all requests at once); (process, base URL) once it listens."""
    argv = [sys.executable, "-m", "infhip.runtime.server", "--engine", engine, "--port", "0",
            "--backlog", "4096", "--max-waiting-requests", str(max_clients), "--max-waiting-tokens", str(1 << 40)]
    argv += ["--device", device] if device else []
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        sys.stderr.write(line)
        if m := re.search(r" on (http://\S+) ", line):
            # keep draining its stderr: a full pipe would block the server
            threading.Thread(target=lambda: [sys.stderr.write(x) for x in proc.stderr], daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError(f"infhip-serve exited with {proc.wait()} before listening")


def served(url: str, prompts: list, max_tokens: int) -> dict:
    """All prompts at once, one streaming client each: infhip-bench serve's client
    (runtime/bench/serve.py) at concurrency len(prompts), after one warm-up request."""
    from infhip.runtime.bench.serve import run_concurrency

    run_concurrency(url, prompts[:1], max_tokens, 1, progress=False)  # warm-up
    r = run_concurrency(url, prompts, max_tokens, len(prompts), progress=False)
    if r["failed"]:
        raise RuntimeError(f"{r['failed']} request(s) failed: {r['errors']}")
    return {"requests_per_s": r["request_throughput"], "tokens_per_s": r["output_throughput"], "seconds": r["duration"],
            "ttft_p50": r["median_ttft_ms"] / 1000, "ttft_p99": r["p99_ttft_ms"] / 1000,
            "e2e_p50": r["median_e2el_ms"] / 1000, "output_tokens": r["total_output_tokens"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--clients", default="32,128", help="comma-separated numbers of concurrent clients")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--prompt-token-ids", action="store_true", help="random token ids instead of text")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",")]

    prompts = {n: make_prompts(args.engine, n, args.prompt_tokens, args.prompt_token_ids, seed=n) for n in clients}

    off = offline(args.engine, args.device, prompts, args.max_tokens)
    proc, url = start_server(args.engine, args.device, max(clients))
    try:
        srv = {}
        for n in clients:
            srv[n] = served(url, prompts[n], args.max_tokens)
            print(f"[bench_serving] served, {n} clients: {srv[n]['seconds']:.1f} s", file=sys.stderr, flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    for n in clients:
        assert srv[n].pop("output_tokens") == n * args.max_tokens, "a request got fewer tokens than asked"

    import torch
    print(f"\n{time.strftime('%Y-%m-%d')}  {platform.node()}  {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, python {platform.python_version()}")
    print(f"engine {args.engine}, prompt {args.prompt_tokens} tokens "
          f"({'random ids' if isinstance(prompts[clients[0]][0], list) else 'text'}), {args.max_tokens} new tokens, "
          "greedy")
    print(f"{'clients':>7} | {'path':<13} | {'req/s':>7} | {'out tok/s':>9} | {'TTFT p50':>9} | {'TTFT p99':>9} | "
          f"{'e2e p50':>8} | vs offline")
    for n in clients:
        o, s = off[n], srv[n]
        print(f"{n:>7} | {'LLM.generate':<13} | {o['requests_per_s']:>7.2f} | {o['tokens_per_s']:>9.1f} | "
              f"{'-':>9} | {'-':>9} | {'-':>8} | 1.00")
        print(f"{n:>7} | {'infhip-serve':<13} | {s['requests_per_s']:>7.2f} | {s['tokens_per_s']:>9.1f} | "
              f"{s['ttft_p50']:>8.2f}s | {s['ttft_p99']:>8.2f}s | {s['e2e_p50']:>7.2f}s | "
              f"{s['requests_per_s'] / o['requests_per_s']:.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                        "offline": off, "served": srv}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
