"""Token drop on one RULER prompt: gold-answer log-prob, needle coverage per anchor (CPU diagnostic).

    python -m benchmarks.quality.token_drop_ruler_probe --engine engines/q05-dense --task niah_single_2 --length 4096 \
        [--samples 0,1] [--token-drop p=0.99,min_prompt_len=0] [--token-drop p=0.99,min_prompt_len=0,spare_anchors=2 ...]
        [--reference] [--skip-dense] [--layers]

For each sample, dense and then each --token-drop spec (engine knobs laid over the engine's, as
`infhip-eval --token-drop`): the teacher-forced log-prob of the gold answer's tokens after the
prompt (engine decode steps: prefill with the drop, then the gold tokens forced) and whether
greedy decoding would give the gold tokens (argmax at every forced step); with a drop also the
mean retention and the anchors at which the needle (the prompt tokens overlapping the first
occurrence of the gold answer string) was dropped; --layers adds the retention per anchor and
the needle block's share of the observation window's mass (and its rank) at each anchor.
Used in docs/results/2026-12-02-qwen/uniprefill-investigation.md; an 8K prompt takes ~5 min a pass on 2 cores.

--reference: also the float64 plain-torch reference (eval/token_drop_reference.py) of the first --token-drop
with the engine's kept sets: its gold log-prob must equal the engine's (a kernel/runtime bug
check on this model), plus the keys-only / rows-only variants of
benchmarks/quality/token_drop_ablation.py (where the loss comes from).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="engines/q05-dense")
    ap.add_argument("--task", default="niah_single_2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--samples", default="0")
    ap.add_argument("--template", default="chat")
    ap.add_argument("--token-drop", action="append", default=[],
                    help="token-drop knobs, e.g. p=0.99,min_prompt_len=0 (repeat)")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--skip-dense", action="store_true", help="no dense pass (its figures from an earlier run)")
    ap.add_argument("--layers", action="store_true", help="print per-anchor retention / coverage")
    args = ap.parse_args()
    from infhip import LLM, SamplingParams
    from infhip.eval.common import record_kept_positions
    from infhip.methods.token_drop import parse_token_drop_knobs
    from infhip.eval.ruler import ruler_prompt
    from infhip.runtime.sequence import Sequence

    torch.set_num_threads(2)
    dense = None if args.skip_dense else LLM(args.engine)
    from infhip.runtime.engine import load_tokenizer
    tok = load_tokenizer(Path(args.engine))

    def forced(llm, ids, gold):
        """Prefill ids, then force gold: (sum log p(gold), greedy would give gold, seq_id)."""
        seen = len(llm.runner.transforms["token_drop"].stats.retention)
        seq = Sequence(seq_id=20_000 + seen + int(time.time() * 1000) % 10_000,
                       prompt_token_ids=list(ids), params=SamplingParams(max_tokens=len(gold), ignore_eos=True))
        llm.scheduler.add(seq)
        lps, hits, j = [], [], 0
        while j < len(gold):
            out = llm.scheduler.schedule()
            logits = llm.runner.execute(out)
            if out.chunks[0].needs_logits:
                lps.append(torch.log_softmax(logits[0].double(), -1)[gold[j]].item())
                hits.append(int(logits[0].argmax()) == gold[j])
                llm.scheduler.update(out, {seq.seq_id: gold[j]})
                j += 1
            else:
                llm.scheduler.update(out, {})
        llm.scheduler.finish(seq, "abort")
        return sum(lps), all(hits), seq.seq_id

    import infhip.methods.token_drop.runtime.step as token_drop_module
    captured: list[torch.Tensor] = []  # block scores of each anchor's importance call, in layer order
    _bi = token_drop_module.block_importance

    def _capture(*a, **kw):
        out = _bi(*a, **kw)
        captured.append(out[0].detach().double().cpu().flatten())
        return out

    token_drop_module.block_importance = _capture
    drop_llms = []
    for spec in args.token_drop:
        llm = LLM(args.engine, token_drop=parse_token_drop_knobs(spec))
        record_kept_positions(llm)
        drop_llms.append((spec, llm))
    for s in [int(x) for x in args.samples.split(",")]:
        p = ruler_prompt(tok, args.task, args.length, s, template=args.template)
        ids, ans = p.ids, p.answers[0]
        gold = tok.encode(" " + ans + ".", add_special_tokens=False) if args.task.startswith("niah") else \
            tok.encode(" " + ans, add_special_tokens=False)
        # answer-bearing prompt tokens: tokens overlapping the first occurrence of the answer text
        offs = tok(p.text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
        assert len(offs) == len(ids), (len(offs), len(ids))
        c0 = p.text.find(ans)
        needle = [i for i, (a, b) in enumerate(offs) if c0 >= 0 and a < c0 + len(ans) and b > c0]
        tail_txt = p.text[p.text.rfind("<|im_end|>"):] if "<|im_end|>" in p.text else ""
        print(f"\n== {args.task} {args.length} sample {s}: {len(ids)} tokens, answer {ans!r} at tokens "
              f"{needle[:1]}..{needle[-1:]} , gold {len(gold)} tokens, template tail {tail_txt!r}", flush=True)
        t0 = time.time()
        lp, hit, _ = forced(dense, ids, gold) if not args.skip_dense else (math.nan, None, None)
        print(f"dense: greedy = gold {hit}  log p(gold) {lp:.3f}  ({time.time() - t0:.0f} s)", flush=True)
        for spec, llm in drop_llms:
            t0 = time.time()
            captured.clear()
            lp, hit, sid = forced(llm, ids, gold)
            kept_positions = record_kept_positions(llm)
            kept = {layer: torch.cat(c) for layer, c in kept_positions[sid].items()}
            n = len(ids)
            ret = sum(len(v) for v in kept.values()) / max(1, len(kept)) / n
            miss = [layer for layer, v in sorted(kept.items()) if needle and not set(needle) <= set(v.tolist())]
            print(f"token drop {spec}: greedy = gold {hit}  log p(gold) {lp:.3f}  retention {ret:.3f}  needle dropped at anchors "
                  f"{miss}  ({time.time() - t0:.0f} s)", flush=True)
            if args.layers:
                print("   per anchor retention:", " ".join(f"{layer}:{len(v) / n:.2f}" for layer, v in sorted(kept.items())))
                # the prefill's anchor calls come first (decode steps run none); one per dropping anchor
                G = llm.runner.transforms["token_drop"].cfg.block_size
                nb = -(-n // G)
                blocks = sorted({i // G for i in needle})
                row = []
                for layer, sc in zip(sorted(kept), captured):
                    sc = sc[:nb]
                    share = sc[blocks].sum().item() / sc.sum().item()
                    rank = int((sc > sc[blocks].max()).sum())
                    row.append(f"{layer}:{100 * share:.2f}%/r{rank}")
                print(f"   needle block(s) {blocks}: share of the window's mass / rank of {nb} blocks:", " ".join(row))
            if args.reference and spec == args.token_drop[0]:
                import infhip.eval.token_drop_reference as ref
                from infhip.eval.token_drop_reference import reference_schedule
                src = Path(ref.__file__).read_text()
                # as benchmarks/quality/token_drop_ablation.py: every row takes every layer's update / every key stays visible
                edits = {"keys-only": [("x = torch.where(active[:, None], x1 + m, torch.where(keys[:, None], x1, x))",
                                        "x = x1 + m")],
                         "rows-only": [("visible = (pos[None, :] <= pos[:, None]) & keys[None, :]",
                                        "visible = pos[None, :] <= pos[:, None]")]}
                schedule = reference_schedule(llm)  # where and how this engine dropped
                full = list(ids) + gold
                model, plan = llm.runner.model, llm.engine.config.plan.layers
                for name in ("dense", "drop", "keys-only", "rows-only"):
                    t0 = time.time()
                    if name in edits:
                        code = src
                        for old, new in edits[name]:
                            assert old in code, f"eval/token_drop_reference.py changed: {old!r} not found"
                            code = code.replace(old, new)
                        ns: dict = {}
                        exec(compile(code, "token_drop_reference_variant", "exec"), ns)
                        fn = ns["reference_logits"]
                    else:
                        fn = ref.reference_logits
                    logits = fn(model, full, n, {} if name == "dense" else kept, plan, schedule=schedule)[n - 1:-1]
                    lpr = logits.log_softmax(-1)[torch.arange(len(gold)), torch.tensor(gold)].sum().item()
                    print(f"   reference {name:9}: log p(gold) {lpr:.3f}  ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
