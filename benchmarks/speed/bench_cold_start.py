"""Cold start of an ahead-of-time engine: Llama-3.1-8B shapes, random weights, one H200.

    python -m benchmarks.speed.bench_cold_start --out $OUT [--work /tmp/cold] [--long 1040000]

Builds two engines with ``infhip-build`` (timed, sizes reported): ``dense`` (bf16) and
``3k-flash`` with an fp8 KV cache. Each measurement then runs in a fresh Python process whose
Triton cache is empty and cannot be written (TRITON_CACHE_DIR in /proc): whatever it launches
must come from the engine.

- dense: ``LLM()`` wall time split (weights / kernel verify / graph capture / other), first
  token of a 16-token prompt, then batch-1 decode tok/s over 256 tokens.
- 3k-flash fp8: the same load split and first token; then the *first* request at 128K and at
  ``--long`` tokens, each streamed for 400 tokens: rate of tokens 1-100 against tokens 200-400
  (goal >= 0.9: nothing is compiled or captured while serving); the TTFT of the first long
  request against a second one of the same length (goal: within 5 %).

Every process counts what it compiled or captured on the request path (the JIT hook's
warnings and the graphs' ``on_request`` counter). Prints a table last; JSON to --out.

``--smoke`` (benchmarks/speed/tiny.py): the same builds and processes on the CPU with a tiny Llama
(float32, dense_threshold 30), contexts of 100 and 200 tokens, streams a tenth as long.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.speed import tiny

READ_ONLY_CACHE = "/proc/infhip-no-triton-cache"  # empty, and unwritable even by root


def build(work: Path, name: str, *flags: str, smoke: bool = False) -> dict:
    out = work / name
    cfg = tiny.write_config(work / "llama-3.1-8b.json", "llama-3.1-8b", smoke)
    where = (["--device", "cpu", "--dtype", "float32", "--max-num-batched-tokens", "64"] if smoke
             else ["--device", "cuda"])
    if smoke and "--preset" in flags:
        where += ["--infinitehip-overrides", "dense_threshold=30"]  # sparse past 30 tokens
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "infhip.builder.cli", "--checkpoint", str(cfg), "--random-weights",
                    *where, "--output", str(out), "--force", "--quiet", *flags], check=True)
    report = json.loads((out / "build_report.json").read_text())
    return {"engine": str(out), "build_s": round(time.perf_counter() - t0, 1),
            "size_gib": round(report["sizes_bytes"]["total"] / 2**30, 2), "kernels": report["kernels"],
            "timings_s": report["timings_s"]}


def child(args) -> dict:
    """One fresh process: load, first token, then the scenario's streams."""
    import logging

    import torch

    from infhip import LLM, SamplingParams

    jit_events = []
    handler = logging.Handler()
    handler.emit = lambda record: jit_events.append(record.getMessage())
    logging.getLogger("infhip.kernels").addHandler(handler)
    logging.getLogger("infhip.graphs").addHandler(handler)

    t0 = time.perf_counter()
    llm = LLM(args.child, max_num_seqs=1, jit="warn")
    load_s = time.perf_counter() - t0
    vocab = llm.engine.config.model.vocab_size
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(10, vocab, (n,), generator=gen).tolist()

    def stream(n_prompt, n_out):
        """(ttft_s, per-token arrival times after the first token)."""
        params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        times = []
        for delta in llm.generate_stream(prompt_token_ids=ids(n_prompt), sampling_params=params):
            now = time.perf_counter()
            times += [now] * len(delta.token_ids)
        return times[0] - t, [x - times[0] for x in times]

    s = 10 if args.smoke else 1  # a smoke run's streams: a tenth as long
    ttft_short, _ = stream(16, 1)
    res = {"load": llm.load_report, "load_wall_s": round(load_s, 2), "first_token_s": round(ttft_short, 3),
           "ready_s": round(load_s + ttft_short, 2)}
    if args.scenario == "dense":
        _, times = stream(16, 256 // s + 1)
        res["decode_bs1_tok_s"] = round(256 // s / times[256 // s], 1)
    else:
        for n in args.contexts:
            ttft, times = stream(n, 400 // s + 1)
            early = 100 // s / times[100 // s]  # tokens 1-100 (after the first)
            late = 200 // s / (times[400 // s] - times[200 // s])
            res[f"ctx{n}"] = {"ttft_s": round(ttft, 2), "tok_s_1_100": round(early, 1),
                              "tok_s_200_400": round(late, 1), "early_over_late": round(early / late, 3)}
        ttft2, _ = stream(args.contexts[-1], 2)
        res["second_long_ttft_s"] = round(ttft2, 2)
        first = res[f"ctx{args.contexts[-1]}"]["ttft_s"]
        res["long_ttft_first_over_second"] = round(first / ttft2, 3)
    graphs = llm.runner.graphs.report if llm.runner.graphs is not None else {}
    res["request_path"] = {"graphs_captured": graphs.get("on_request", 0), "events": jit_events[:20],
                           "num_events": len(jit_events)}
    return res


def run_child(engine: str, scenario: str, contexts: list[int], smoke: bool = False) -> dict:
    # (a smoke run keeps TRITON_INTERPRET: on the CPU "0" picks the plugins' torch references)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" or smoke}
    env["TRITON_CACHE_DIR"] = READ_ONLY_CACHE
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.bench_cold_start", "--child", engine, "--scenario",
                           scenario, "--contexts", ",".join(map(str, contexts))] + (["--smoke"] if smoke else []),
                          env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/infhip-cold"))
    ap.add_argument("--long", type=int, default=1040000, help="the long request's prompt tokens")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", default="dense", help=argparse.SUPPRESS)
    ap.add_argument("--contexts", default="", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny engines on the CPU: the code path, not speed")
    args = ap.parse_args()
    if args.child:
        args.contexts = [int(x) for x in args.contexts.split(",") if x]
        print(json.dumps(child(args)))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    results = {"builds": {}, "runs": {}}
    long, room = tiny.cap(args.long, args.smoke), 512 if args.smoke else 8192
    results["builds"]["dense"] = build(args.work, "dense", "--max-seq-len", str(room), smoke=args.smoke)
    results["builds"]["3k-flash-fp8"] = build(args.work, "3k-flash-fp8", "--preset", "3k-flash", "--kv-dtype", "fp8",
                                              "--max-seq-len", str(long + room), "--max-batch-size", "4",
                                              smoke=args.smoke)
    results["runs"]["dense"] = run_child(results["builds"]["dense"]["engine"], "dense", [], args.smoke)
    results["runs"]["3k-flash-fp8"] = run_child(results["builds"]["3k-flash-fp8"]["engine"], "sparse",
                                                [long // 2 if args.smoke else 131072, long], args.smoke)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_cold_start.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    print("\n| engine | build s | size GiB | kernels | LLM() s (weights / graphs) | graphs | first token s |")
    print("|---|---|---|---|---|---|---|")
    for name, b in results["builds"].items():
        r = results["runs"][name]
        if "error" in r:
            print(f"| {name} | {b['build_s']} | {b['size_gib']} | {b['kernels']['count']} | error | | |")
            continue
        ld = r["load"]
        print(f"| {name} | {b['build_s']} | {b['size_gib']} | {b['kernels']['count']} | {r['load_wall_s']} "
              f"({ld['weights_s']} / {ld['graphs_s']}) | {ld['graphs']} | {r['first_token_s']} |")
    sparse = results["runs"]["3k-flash-fp8"]
    for key, v in sparse.items():
        if key.startswith("ctx"):
            print(f"{key}: TTFT {v['ttft_s']} s, tok/s 1-100 {v['tok_s_1_100']}, 200-400 {v['tok_s_200_400']}, "
                  f"ratio {v['early_over_late']}")
    if "second_long_ttft_s" in sparse:
        print(f"long TTFT first/second: {sparse['long_ttft_first_over_second']}; dense bs1 decode: "
              f"{results['runs']['dense'].get('decode_bs1_tok_s')} tok/s")
    for name, r in results["runs"].items():
        print(f"{name}: request-path compiles/captures: {r.get('request_path')}")


if __name__ == "__main__":
    main()
