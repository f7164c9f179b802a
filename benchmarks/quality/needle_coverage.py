"""Does an InfiniteHiP engine's final mask keep the passkey needle where the model reads it?

    python -m benchmarks.quality.needle_coverage --engine engines/smollm2-135m-3k --length 8192 --depth 0.5 [--haystack pg]

Prefills one passkey prompt (eval/passkey.py, seed 0, sample 0) densely, then, at every
sparse layer, runs the layer's pruning stages on the last query block (64 queries) exactly as
the engine would (eval/recall.py's parameters, the engine's query strides unless
--query-stride) with both chunk scores — the paper's raw max over heads and "head_normalized" —
and, as an experiment, the mask the kv head that reads the needle most would choose alone (one
mask per kv head; the engine shares one across heads), and prints per layer: the share of the
needle's tokens in the last query's key set after each stage (sink + that stage's survivors +
stream; the last figure is the final mask), and the dense attention mass that query puts on
them (max and mean over heads); in brackets, the share of the max head's needle mass on the
tokens the final mask keeps. CPU: the pruning runs the float64 references (a few minutes at 8K).
"""

from __future__ import annotations

import argparse

import torch

from infhip.eval.common import load_llm
from infhip.runtime.options import parse_size
from infhip.eval.forcing import teacher_force
from infhip.eval.passkey import passkey_prompt_ids, passkey_value
from infhip.eval.recall import capture_queries, sparse_layer_params
from infhip.eval.text import SOURCES
from infhip.plugins.infinitehip import block_key_mask, plan_query_blocks, pruning_stage
from infhip.plugins.paged_kv import PagedKV

CHUNK = 64  # measured queries: the last query block


def needle_positions(tokenizer, ids: list[int], passkey: int) -> list[int]:
    needle = tokenizer.encode(f" {passkey}", add_special_tokens=False)
    starts = [i for i in range(len(ids) - len(needle)) if ids[i:i + len(needle)] == needle]
    return sorted({s + j for s in starts for j in range(len(needle))})


def stage_masks(attn, q, table, length, params, head_normalized: bool, strides: list[int],
                kv_head: int | None = None) -> list[torch.Tensor]:
    """bool [length] per stage: the keys the last of the CHUNK queries would attend to if pruning
    stopped after that stage (after the last one: the final mask). kv_head: the masks that kv head
    would choose alone (its query heads and keys only; the experiment of one mask per kv head,
    which the engine does not have: it shares one mask across all heads)."""
    q_start, q_lens, ends, _ = plan_query_blocks([CHUNK], [length], params["stages"][0][0])
    tables = torch.tensor([table], dtype=torch.int32).expand(len(ends), -1).contiguous()
    k_cache = attn.kv.k
    if kv_head is not None:
        group = q.shape[1] // k_cache.shape[2]
        q = q[:, kv_head * group:(kv_head + 1) * group].contiguous()
        k_cache = k_cache[:, :, kv_head:kv_head + 1].contiguous()
    sel = num = None
    masks = []
    for (b_q, l_c, k), stride in zip(params["stages"], strides):
        sel, num = pruning_stage(q, PagedKV(k_cache, None), tables, q_start, q_lens, ends, sel, num,
                                 chunk_size=l_c, k=k, block_q=b_q, n_sink=params["n_sink"], n_stream=params["n_stream"],
                                 rope_style=params["rope_style"], inv_freq=attn.rope[0].inv_freq,
                                 head_normalized=head_normalized, query_stride=stride)
        masks.append(block_key_mask(sel, ends, params["n_sink"], params["n_stream"], length)[-1])
    return masks


def dense_mass(attn, q_last, table, length, positions) -> torch.Tensor:
    """float [Hq, len(positions)]: softmax mass of the last query on each of `positions`, per q head."""
    page = attn.kv.k.shape[1]
    rows = torch.tensor(table).repeat_interleave(page)[:length]
    keys = attn.kv.k[rows, torch.arange(length) % page].float()  # [length, Hkv, D]
    keys = keys.repeat_interleave(q_last.shape[0] // keys.shape[1], 1)  # [length, Hq, D]
    probs = (torch.einsum("hd,lhd->hl", q_last.float(), keys) * attn.scale).softmax(-1)
    return probs[:, positions]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="an InfiniteHiP engine (e.g. --preset 3k)")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--depth", type=float, default=0.5)
    ap.add_argument("--haystack", choices=SOURCES, default="noise", help="passkey_prompt_ids' haystack")
    ap.add_argument("--kv-cache-memory-bytes", default=None, help="KV budget, e.g. 16GiB (long-window engines: Gemma)")
    ap.add_argument("--query-stride", type=int, default=None,
                    help="score every stage with every s-th query of the block (64: the last query only; "
                         "default: the engine's query_strides)")
    args = ap.parse_args()
    # dense prefill (the masks are computed here, not by the engine): fast on the CPU
    llm = load_llm(args.engine, "cpu", infinitehip_overrides={"dense_threshold": 10**9}, max_num_seqs=1,
                   kv_cache_memory_bytes=parse_size(args.kv_cache_memory_bytes) if args.kv_cache_memory_bytes else None)
    passkey = passkey_value(0, args.length, args.depth, 0)
    ids = passkey_prompt_ids(llm.tokenizer, args.length, args.depth, passkey, args.haystack)
    needle = needle_positions(llm.tokenizer, ids, passkey)
    print(f"passkey {passkey}: needle tokens at {needle[0]}..{needle[-1]} of {args.length}")
    params = sparse_layer_params(llm, args.length)
    with capture_queries(llm.runner.model, sorted(params), CHUNK) as store:
        gen = teacher_force(llm, [(ids, [0])])
        next(gen)  # the prefill has run; the sequence still holds its pages
        seq = next(s for s in llm.scheduler.running)
        stages = len(next(iter(params.values()))["stages"])
        print(f"needle share kept after stage 1/.../{stages} (last: the final mask)")
        print("| layer | raw max | head_normalized | own mask of the kv head reading it most | that kv head "
              "| dense mass max head | mean |")
        print("|---|---|---|---|---|---|---|")
        for i in sorted(params):
            attn = llm.runner.model.layers[i].self_attn
            q = torch.cat(store[i])[-CHUNK:]
            table = llm.runner.kv.block_table(seq.seq_id, attn.kv_group)
            strides = [args.query_stride] * stages if args.query_stride else params[i]["query_strides"]
            mass = dense_mass(attn, q[-1], table, args.length, needle)  # [Hq, needle tokens]
            head = int(mass.sum(-1).argmax())  # the q head reading the needle most
            reader = head // (q.shape[1] // attn.kv.k.shape[2])  # its kv head
            cells = []
            for hn, kv in ((False, None), (True, None), (False, reader)):
                masks = stage_masks(attn, q, table, args.length, params[i], hn, strides, kv_head=kv)
                kept_mass = mass[head, masks[-1][needle]].sum() / mass[head].sum()
                cells.append("/".join(f"{m[needle].float().mean().item():.2f}" for m in masks) + f" ({kept_mass:.2f})")
            total = mass.sum(-1)
            print(f"| {i} | {' | '.join(cells)} | {reader} | {total.max():.3f} | {total.mean():.3f} |", flush=True)
        gen.close()


if __name__ == "__main__":
    main()
