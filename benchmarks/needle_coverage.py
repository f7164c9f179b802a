"""Does an InfiniteHiP engine's final mask keep the passkey needle where the model reads it?

    python benchmarks/needle_coverage.py --engine engines/smollm2-135m-3k --length 8192 --depth 0.5

Prefills one passkey prompt (infhip/eval/passkey.py, seed 0, sample 0) densely, then, at every
sparse layer, runs the layer's pruning stages on the last query block (64 queries) exactly as
the engine would (infhip/eval/recall.py's parameters) with both chunk scores — the paper's raw
max over heads and "head_normalized" — and, as an experiment, the mask the kv head that reads
the needle most would choose alone (one mask per kv head; the engine shares one across heads),
and prints per layer: the share of the needle's tokens in the final mask of the last query, and
the dense attention mass that query puts on them (max and mean over heads). CPU: the pruning
runs the float64 references (a few minutes at 8K).
"""

from __future__ import annotations

import argparse

import torch

from infhip.eval.common import load_llm
from infhip.runtime.options import parse_size
from infhip.eval.forcing import teacher_force
from infhip.eval.passkey import passkey_prompt_ids, passkey_value
from infhip.eval.recall import capture_queries, sparse_layer_params
from infhip.plugins.infinitehip import per_query_key_mask, plan_query_blocks, pruning_stage
from infhip.plugins.paged_kv import PagedKV

CHUNK = 64  # measured queries: the last query block


def needle_positions(tokenizer, ids: list[int], passkey: int) -> list[int]:
    needle = tokenizer.encode(f" {passkey}", add_special_tokens=False)
    starts = [i for i in range(len(ids) - len(needle)) if ids[i:i + len(needle)] == needle]
    return sorted({s + j for s in starts for j in range(len(needle))})


def final_mask(attn, q, table, length, params, head_normalized: bool, kv_head: int | None = None,
               query_stride: int = 1) -> torch.Tensor:
    """bool [length]: the keys the last of the CHUNK queries attends to. kv_head: the mask that
    kv head would choose alone (its query heads and keys only; the experiment of one mask per kv
    head, which the engine does not have: it shares one mask across all heads)."""
    q_start, q_lens, ends, _ = plan_query_blocks([CHUNK], [length], params["stages"][0][0])
    tables = torch.tensor([table], dtype=torch.int32).expand(len(ends), -1).contiguous()
    k_cache = attn.kv.k
    if kv_head is not None:
        group = q.shape[1] // k_cache.shape[2]
        q = q[:, kv_head * group:(kv_head + 1) * group].contiguous()
        k_cache = k_cache[:, :, kv_head:kv_head + 1].contiguous()
    sel = num = None
    for b_q, l_c, k in params["stages"]:
        sel, num = pruning_stage(q, PagedKV(k_cache, None), tables, q_start, q_lens, ends, sel, num,
                                 chunk_size=l_c, k=k, block_q=b_q, n_sink=params["n_sink"], n_stream=params["n_stream"],
                                 rope_style=params["rope_style"], inv_freq=attn.rope[0].inv_freq,
                                 head_normalized=head_normalized, query_stride=query_stride)
    return per_query_key_mask(sel, q_lens, ends, params["n_sink"], params["n_stream"], length)[-1]


def dense_mass(attn, q_last, table, length, positions) -> torch.Tensor:
    """float [Hq]: softmax mass of the last query on `positions`, per q head."""
    page = attn.kv.k.shape[1]
    rows = torch.tensor(table).repeat_interleave(page)[:length]
    keys = attn.kv.k[rows, torch.arange(length) % page].float()  # [length, Hkv, D]
    keys = keys.repeat_interleave(q_last.shape[0] // keys.shape[1], 1)  # [length, Hq, D]
    probs = (torch.einsum("hd,lhd->hl", q_last.float(), keys) * attn.scale).softmax(-1)
    return probs[:, positions].sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="an InfiniteHiP engine (e.g. --preset 3k)")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--kv-cache-memory-bytes", default=None, help="KV budget, e.g. 16GiB (long-window engines: Gemma)")
    ap.add_argument("--query-stride", type=int, default=1,
                    help="score every stage with every s-th query of the block (64: the last query only)")
    args = ap.parse_args()
    # dense prefill (the masks are computed here, not by the engine): fast on the CPU
    llm = load_llm(args.engine, "cpu", infinitehip_overrides={"dense_threshold": 10**9}, max_num_seqs=1,
                   kv_cache_memory_bytes=parse_size(args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes else None)
    passkey = passkey_value(0, args.length, args.depth, 0)
    ids = passkey_prompt_ids(llm.tokenizer, args.length, args.depth, passkey)
    needle = needle_positions(llm.tokenizer, ids, passkey)
    print(f"passkey {passkey}: needle tokens at {needle[0]}..{needle[-1]} of {args.length}")
    params = sparse_layer_params(llm, args.length)
    with capture_queries(llm.runner.model, sorted(params), CHUNK) as store:
        gen = teacher_force(llm, [(ids, [0])])
        next(gen)  # the prefill has run; the sequence still holds its pages
        seq = next(s for s in llm.scheduler.running)
        print("| layer | needle kept, raw max | needle kept, head_normalized | needle kept, own mask of the "
              "kv head reading it most | dense mass max head | mean |")
        print("|---|---|---|---|---|---|")
        for i in sorted(params):
            attn = llm.runner.model.layers[i].self_attn
            q = torch.cat(store[i])[-CHUNK:]
            table = llm.runner.kv.block_table(seq.seq_id, attn.kv_group)
            kept = [final_mask(attn, q, table, args.length, params[i], hn, query_stride=args.query_stride)[
                needle].float().mean().item() for hn in (False, True)]
            mass = dense_mass(attn, q[-1], table, args.length, needle)
            reader = int(mass.argmax()) // (q.shape[1] // attn.kv.k.shape[2])  # its kv head
            own = final_mask(attn, q, table, args.length, params[i], False, kv_head=reader,
                             query_stride=args.query_stride)[needle].float().mean().item()
            print(f"| {i} | {kept[0]:.2f} | {kept[1]:.2f} | {own:.2f} | {mass.max():.3f} | {mass.mean():.3f} |",
                  flush=True)
        gen.close()


if __name__ == "__main__":
    main()
