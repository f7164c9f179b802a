"""Hit ratio of the offload page cache (runtime/offload_cache.py) while a real model decodes real
text: the share of the host pages stage-1 survivors lie on that already had a GPU copy.

A KJV window of ``--length`` tokens is prefilled, its middle pages move to the host pool, and
the model generates ``--tokens`` tokens greedily with the page cache on (one request's stage-1
survivors). CPU, float32 (torch references). The `3k` stages keep everything at 8K; an engine
with a chain scaled down so that stage 1 prunes there as `3k`'s does at 1M:

    infhip-build --model smollm2-135m --output engines/smollm2-135m-scaled --preset 3k --dtype float32 \
        --max-seq-len 16384 --device cpu --infinitehip "stages=[[64,64,1024],[64,16,512],[64,4,256]],special_final_k=512"
    python benchmarks/offload_cache_hits.py --engine engines/smollm2-135m-scaled --length 9000 --tokens 96

(benchmarks/mask_stability.py measures the masks themselves.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", required=True)
    p.add_argument("--length", type=int, default=9000)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--refresh", default="16,8,4", help="refresh intervals of the stages")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from infhip import LLM, SamplingParams
    from infhip.eval.ppl import ppl_items

    # pages move from the threshold on (RoPE on inside the window), so the decode steps read the host
    knobs = dict(refresh_intervals=[int(x) for x in args.refresh.split(",")], rope_off_in_trained_window=False,
                 dense_threshold=4096)
    llm = LLM(args.engine, infinitehip_overrides=knobs, kv_offload_bytes=1 << 30, kv_offload_cache_tokens=None,
              max_num_seqs=1)
    stages = [[s.block_q, s.chunk_size, s.k] for s in llm.engine.config.plan.infinitehip.stages]
    ctx, tgt = ppl_items(llm.tokenizer, args.length, 1, 1, 0)[0]
    out = llm.generate(prompt_token_ids=[ctx + tgt],
                       sampling_params=SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
    st = llm.runner.page_cache.stats
    res = dict(engine=args.engine, length=len(ctx + tgt), tokens=args.tokens, stages=stages, refresh=args.refresh,
               capacity_pages=llm.runner.page_cache.capacity, **vars(st), hit_ratio=st.hit_ratio,
               text=out[0].text)
    print(f"{args.engine}: {res['length']} tokens, {args.tokens} generated; stages {stages}, refresh {args.refresh}; "
          f"cache {res['capacity_pages']} pages per layer")
    print(f"stage-1 survivor pages needed {st.needed}, already copied {st.hits} (hit ratio {st.hit_ratio:.3f}), "
          f"copied {st.copied}, evicted {st.evicted}")
    print(f"text: {out[0].text[:200]!r}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
