"""Token drop on a real model: time to first token vs dense at the retention top-p reaches (GPU).

    python -m benchmarks.speed.token_drop_ttft --engine engines/q05-dense --device cuda --lengths 8k,16k,32k \
        --tasks niah_single_2,qa_1 --samples 2 --token-drop "default=p=0.99,min_prompt_len=4096" \
        --token-drop "old=p=0.99,min_prompt_len=4096,drop_layers=every,drop_point=before_attention,reenter=true,spare_anchors=1" \
        --json $OUT/token_drop_ttft.json

benchmarks/speed/bench_token_drop.py times random-weight engines at a *forced* share of blocks; this
one times the real engine on real RULER prompts (chat template), so each schedule keeps what
its top-p keeps and the speedup is the one at the retention it reaches. Per length and column:
the median over prompts of the best of --reps ``generate(max_tokens=1)`` wall times (device
synchronised), its ratio to dense on the same prompts, and the mean retention (share of the
prompt's tokens that ran each full-attention layer's MLP, averaged over those layers).
One engine load per column, all on the same weights; prompts are the same for every column.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--kv-cache-memory-bytes", default="16GiB")
    ap.add_argument("--lengths", default="8k,16k,32k")
    ap.add_argument("--tasks", default="niah_single_2,qa_1")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--template", default="chat")
    ap.add_argument("--token-drop", action="append", default=[], metavar="NAME=KNOBS",
                    help="a column: its name and token-drop knobs (repeat); dense always runs")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from infhip import LLM, SamplingParams
    from infhip.runtime.bench.offline import timed_batch
    from infhip.eval.ruler_prompts import ruler_prompt
    from infhip.methods.token_drop import parse_token_drop_knobs
    from infhip.runtime.engine import load_tokenizer

    mem = args.kv_cache_memory_bytes
    mem = int(float(mem[:-3]) * 2**30) if mem.lower().endswith("gib") else int(mem)
    tok = load_tokenizer(args.engine)
    lengths = [int(float(x[:-1]) * 1024) if x.lower().endswith("k") else int(x) for x in args.lengths.split(",")]
    prompts = {n: [ruler_prompt(tok, t, n, s, template=args.template).ids for t in args.tasks.split(",")
                   for s in range(args.samples)] for n in lengths}
    columns = [("dense", None)] + [tuple(spec.split("=", 1)) for spec in args.token_drop]
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    rows = []
    for name, knobs in columns:
        llm = LLM(str(args.engine), device=args.device, kv_cache_memory_bytes=mem,
                  token_drop=parse_token_drop_knobs(knobs) if knobs else False)
        llm.generate(prompt_token_ids=[prompts[lengths[0]][0]], sampling_params=sp)  # warm-up
        for n in lengths:
            times, rets = [], []
            for ids in prompts[n]:
                # infhip-bench's loop (runtime/bench/offline.py): the step that samples the first
                # token ends with it on the host, so its time needs no extra synchronisation
                times.append(min(timed_batch(llm, [ids], sp)["ttft_s"][0] for _ in range(args.reps)))
                per = next(reversed(llm.runner.transforms["token_drop"].stats.retention.values()), {}) if knobs else {}
                rets.append(sum(k / t for k, t in per.values()) / len(per) if per else 1.0)
            rows.append(dict(column=name, length=n, ttft_s=statistics.median(times), times_s=times,
                             retention=statistics.mean(rets), knobs=knobs))
            print(f"{name:>10} {n:>7}: TTFT {rows[-1]['ttft_s'] * 1e3:8.1f} ms  retention {rows[-1]['retention']:.3f}",
                  flush=True)
        del llm
    dense = {r["length"]: r["ttft_s"] for r in rows if r["column"] == "dense"}
    print("\n| column | length | TTFT ms | speedup vs dense | retention |\n|---|---|---|---|---|")
    for r in rows:
        r["speedup"] = dense[r["length"]] / r["ttft_s"]
        print(f"| {r['column']} | {r['length']} | {r['ttft_s'] * 1e3:.1f} | {r['speedup']:.2f}x | {r['retention']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"engine": str(args.engine), "json": str(args.json)},
                                         "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
