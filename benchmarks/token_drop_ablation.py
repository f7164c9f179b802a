"""Where does token drop lose quality? A CPU diagnostic on SmolLM2-135M (real weights, KJV).

    python benchmarks/token_drop_ablation.py [--length 2048] [--chunk 128] [--p 0.99]

The engine prefills one KJV window with token drop and records the positions each anchor kept;
the plain-torch reference (tests/_td_reference.py, which the engine matches) then scores the
last `chunk` tokens under four semantics with those same kept sets:

    dense      no drop
    drop       the engine's semantics (dropped rows skip layers and write no KV there)
    keys-only  every row runs every layer; each layer's keys are its kept set (KV removal only)
    rows-only  dropped rows skip layers and re-enter stale, but every token keeps its KV (no removal)
    nested     no re-entry: a token dropped at an anchor stays dropped (kept sets intersected;
               LazyLLM-like; the sets are still the ones the engine chose with re-entry)

Prints the perplexity of each. Run from the repository root.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--p", type=float, default=0.99)
    args = ap.parse_args()
    from infhip import LLM
    from infhip.eval.ppl import ppl_items
    from tests import _td_reference as ref
    from tests.test_token_drop_runtime import run_greedy

    llm = LLM(args.engine, token_drop=dict(p=args.p, min_prompt_len=0))
    llm.runner.record_kept_positions = True
    ctx, tgt = ppl_items(llm.tokenizer, args.length, args.chunk, 1, 0)[0]
    _, _, sid = run_greedy(llm, ctx, 1)
    kept = {layer: torch.cat(c) for layer, c in llm.runner.kept_positions[sid].items()}
    print(f"mean retention over anchors: {sum(len(v) for v in kept.values()) / len(kept) / len(ctx):.3f}")
    model, layers, ids = llm.runner.model, llm.engine.config.plan.layers, ctx + tgt

    def ppl(fn, masks) -> float:
        logits = fn(model, ids, len(ctx), masks, layers)[len(ctx) - 1:-1]
        lp = logits.log_softmax(-1)[torch.arange(len(tgt)), torch.tensor(tgt)]
        return math.exp(-lp.mean().item())

    src = Path(ref.__file__).read_text()
    variants = {"keys-only": [("x = torch.where(active[:, None], x1 + m, x)", "x = x1 + m")],
                "rows-only": [("keys = active.clone()", "keys = torch.ones(L, dtype=torch.bool, device=dev)")],
                "nested": [("            active = torch.ones(L, dtype=torch.bool, device=dev)  # reconstitution: every row re-enters\n",
                            "            prev_active = active\n"),
                           ("                active[num_prompt:] = True\n",
                            "                active[num_prompt:] = True\n                active &= prev_active\n")]}
    print(f"dense     {ppl(ref.reference_logits, {}):.3f}")
    print(f"drop      {ppl(ref.reference_logits, kept):.3f}")
    for name, edits in variants.items():
        code = src
        for old, new in edits:
            assert old in code, f"tests/_td_reference.py changed: {old!r} not found"
            code = code.replace(old, new)
        ns: dict = {}
        exec(compile(code, name, "exec"), ns)
        print(f"{name:9} {ppl(ns['reference_logits'], kept):.3f}")


if __name__ == "__main__":
    main()
