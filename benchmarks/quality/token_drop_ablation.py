"""Where does token drop lose quality? A CPU diagnostic on SmolLM2-135M (real weights, KJV).

    python -m benchmarks.quality.token_drop_ablation [--length 2048] [--chunk 128] [--p 0.99] [--sample 0]
        [--knobs drop_layers=every,drop_point=before_attention,reenter=true]
        [--variants dense,drop,keys-only,rows-only,nested] [--spare 0 --spare 0,1] [--probe]

The engine prefills one KJV window (the `ppl` window of that sample: the first length - chunk
tokens) with token drop and records the positions each anchor kept; the plain-torch reference
(eval/token_drop_reference.py, which the engine matches) then scores the last `chunk` tokens under
these semantics with those same kept sets, under the engine's drop schedule (drop layers, drop
point, re-entry: TokenDropConfig; the engine's own unless --knobs changes them, e.g. the paper's
schedule above, the one the variants below were written for; the default since 2026-12-04 is
the authors' code's: a few layers, after attention, no re-entry):

    dense      no drop
    drop       the engine's semantics (dropped rows skip layers and write no KV there)
    keys-only  every row runs every layer; each layer's keys are its kept set (KV removal only)
    rows-only  dropped rows skip layers and re-enter stale, but every token keeps its KV (no removal)
    nested     no re-entry: a token dropped at an anchor stays dropped (kept sets intersected;
               LazyLLM-like; the sets are still the ones the engine chose, with re-entry if its
               schedule has it)

--spare L1,L2: the drop semantics with anchors L1, L2 dropping nothing, every other anchor
choosing its own kept set from the stream it then receives (the reference's top-p,
`reference_select`; first checked to reproduce the engine's sets exactly when nothing is spared).

--probe: with only the first dropping anchor's drop applied (the engine's set; layer 0 from 3K
tokens on at p = 0.99) and without any, per layer: the attention mass the scored queries put on
the tokens that anchor dropped, the mass on position 0, and the mean norm of those tokens'
stream (the layer's input) over that of all prompt tokens.

Prints the perplexity of each. Run from the repository root. float64; a 4K window takes ~1.5 min
per reference pass on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch


VARIANTS = ("dense", "drop", "keys-only", "rows-only", "nested")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--p", type=float, default=0.99)
    ap.add_argument("--knobs", default="", help="more token-drop knobs (as infhip-eval --token-drop), "
                    "e.g. drop_layers=every,drop_point=before_attention,reenter=true")
    ap.add_argument("--sample", type=int, default=0, help="ppl window index (seed 0)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--spare", action="append", default=[], help="anchors that drop nothing, e.g. 0,1 (repeat)")
    ap.add_argument("--probe", action="store_true", help="attention on the tokens the first anchor dropped")
    args = ap.parse_args()
    wanted = [v for v in args.variants.split(",") if v]
    if bad := set(wanted) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(bad)}")
    from infhip import LLM
    from infhip.eval.common import record_kept_positions
    from infhip.eval.ppl import ppl_items
    import infhip.eval.token_drop_reference as ref
    from infhip.eval.token_drop_reference import reference_schedule, run_greedy
    from infhip.methods.token_drop import parse_token_drop_knobs

    llm = LLM(args.engine, token_drop={"p": args.p, "min_prompt_len": 0, **parse_token_drop_knobs(args.knobs)})
    schedule = reference_schedule(llm)  # the reference must drop where and how the engine did
    print(f"drop schedule: {schedule}")
    kept_positions = record_kept_positions(llm)
    ctx, tgt = ppl_items(llm.tokenizer, args.length, args.chunk, args.sample + 1, 0)[args.sample]
    _, _, sid = run_greedy(llm, ctx, 1)
    kept = {layer: torch.cat(c) for layer, c in kept_positions[sid].items()}
    n_ctx, G = len(ctx), llm.runner.transforms["token_drop"].cfg.block_size
    print(f"{len(ctx)} context + {len(tgt)} scored tokens, {-(-n_ctx // G)} blocks of {G}; mean retention "
          f"over anchors: {sum(len(v) for v in kept.values()) / len(kept) / n_ctx:.3f}")
    for layer in sorted(kept)[:3]:
        dropped = sorted(set(range(-(-n_ctx // G))) - set((kept[layer] // G).tolist()))
        print(f"  anchor {layer}: retention {len(kept[layer]) / n_ctx:.3f}, dropped blocks {dropped}")
    model, layers, ids = llm.runner.model, llm.engine.config.plan.layers, ctx + tgt

    def ppl(fn, masks, **kw) -> float:
        kw.setdefault("schedule", schedule)
        logits = fn(model, ids, n_ctx, masks, layers, **kw)[n_ctx - 1:-1]
        lp = logits.log_softmax(-1)[torch.arange(len(tgt)), torch.tensor(tgt)]
        return math.exp(-lp.mean().item())

    src = Path(ref.__file__).read_text()

    def variant(edits) -> dict:
        code = src
        for old, new in edits:
            assert old in code, f"eval/token_drop_reference.py changed: {old!r} not found"
            code = code.replace(old, new)
        ns: dict = {}
        exec(compile(code, "token_drop_reference_variant", "exec"), ns)
        return ns

    # keys-only: every row takes every layer's update; rows-only: every key stays visible; nested:
    # no re-entry, and a drop layer's rows = its kept set within the rows still active (`keys`
    # holds them when the layer does not re-enter)
    edits = {"keys-only": [("x = torch.where(active[:, None], x1 + m, torch.where(keys[:, None], x1, x))", "x = x1 + m")],
             "rows-only": [("visible = (pos[None, :] <= pos[:, None]) & keys[None, :]", "visible = pos[None, :] <= pos[:, None]")],
             "nested": [("                active[kept[l]] = True\n", "                active[kept[l]] = keys[kept[l]]\n")]}
    for name in wanted:
        if name in ("dense", "drop"):
            print(f"{name:9} {ppl(ref.reference_logits, {} if name == 'dense' else kept):.3f}", flush=True)
        else:
            kw = {"schedule": dict(schedule, reenter=False)} if name == "nested" else {}
            print(f"{name:9} {ppl(variant(edits[name])['reference_logits'], kept, **kw):.3f}", flush=True)

    if args.spare:
        cfg = llm.runner.transforms["token_drop"].cfg
        select = dict(p=args.p, n=cfg.obs_window, G=G, A=cfg.num_sink, tail=llm.runner.transforms["token_drop"].tail)
        for spec in [""] + args.spare:
            spare = {int(s) for s in spec.split(",") if s}
            chosen: dict = {}
            value = ppl(ref.reference_logits, chosen, select=dict(select, spare=spare))
            if not spare:  # the reference's own selection must be the engine's
                same = set(chosen) == set(kept) and all(torch.equal(chosen[k], kept[k].to(chosen[k].device))
                                                         for k in kept)
                print(f"reference selection == engine's: {same}")
                continue
            ret = (sum(len(v) for v in chosen.values()) + n_ctx * len(spare)) / (len(chosen) + len(spare)) / n_ctx
            print(f"spare {spec:4} {value:.3f}  (mean retention {ret:.3f})", flush=True)

    if args.probe:
        first = next((k for k in sorted(kept) if len(kept[k]) < n_ctx), None)
        if first is None:
            print("probe: no anchor dropped anything")
            return
        probe_pos = torch.tensor(sorted(set(range(n_ctx)) - set(kept[first].tolist())))
        rows = torch.arange(n_ctx, len(ids)) - 1  # the queries whose logits are scored
        ns = variant([('        o = torch.einsum("hqk,khd->qhd", p, v).reshape(L, -1)\n',
                       '        o = torch.einsum("hqk,khd->qhd", p, v).reshape(L, -1)\n        _probe(p, x)\n')])
        for name, masks in (("dense", {}), (f"only anchor {first} drops", {first: kept[first]})):
            stats = []
            ns["_probe"] = lambda p, x: stats.append((
                p[:, rows][:, :, probe_pos.to(p.device)].sum(-1).mean().item(), p[:, rows, 0].mean().item(),
                (x[probe_pos].norm(dim=-1).mean() / x[:n_ctx].norm(dim=-1).mean()).item()))
            value = ppl(ns["reference_logits"], masks)
            print(f"probe, {name}: ppl {value:.3f}; {len(probe_pos)} tokens dropped by anchor {first}")
            print("  layer  mass on them  mass on pos 0  |x| them / all")
            for layer, (mass, sink, norm) in enumerate(stats):
                print(f"  {layer:5d}  {mass:12.4f}  {sink:13.4f}  {norm:14.2f}")


if __name__ == "__main__":
    main()
