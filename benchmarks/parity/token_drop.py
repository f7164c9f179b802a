"""Token-drop parity on CPU: the UniPrefill authors' token selection and schedule beside our engine, same prompts.

    python -m benchmarks.parity.token_drop --peer /path/to/UniPrefill --engine engines/q05-dense \
        --tasks niah_single_2,niah_multikey_1 --length 8192 --samples 0 \
        --column dense --column "ours-old=p=0.99,min_prompt_len=0,drop_layers=every,drop_point=before_attention,reenter=true" \
        --column "ours-authors=p=0.99,min_prompt_len=0,drop_layers=5:8:11:14:17:20" --column authors --json out.json

Columns (any subset, each run on every prompt):

* ``dense``: our engine (``--engine``, a float32 CPU engine of the model) without token drop;
* ``NAME=KNOBS``: our engine with ``--token-drop KNOBS`` laid over the engine's knobs;
* ``authors`` (give it first: the engine columns then report the rows per layer that differ
  from its): transformers' Qwen2 / Llama (the GGUF of ``--model``, float32) driven layer by layer
  here, with the AUTHORS' ``topselectionvarlen`` (imported from ``--peer``'s
  ``vllm/model_executor/layers/fused_top_p_selection_tp_pd.py``; its Triton kernels run under
  TRITON_INTERPRET=1) called in the authors' schedule (``LlamaModel.forward`` /
  ``LlamaDecoderLayer.forward`` of their llama.py): at each layer of ``--authors-layers`` whose
  current rows exceed sink + last_q, the layer's post-RoPE q / k of the current rows score the
  rows, the layer's attention runs over all current rows (its K/V is kept for all of them), and
  only the kept rows run its MLP and every later layer; dropped rows never come back.

Per prompt and column: the gold answer's teacher-forced log-prob after the prompt, whether
greedy decoding gives the gold tokens (argmax at every forced step) and the greedy tokens up to
and including the first that differs from gold, per layer the number of rows that ran the layer's
MLP, the layers after which the needle's tokens (prompt tokens overlapping the first occurrence
of the answer text) were gone, and the mean retention over layers. Decoding after the drop
attends, at each layer, exactly to the keys that layer wrote (dropped tokens: KV at the layers up
to their drop layer only).

What is stubbed from vLLM for the authors' module: ``vllm.distributed.get_tp_group`` (world
size 1), ``all_gather``, ``vllm.logger.init_logger`` and ``fla.utils``' two decorators (unused by
``topselectionvarlen``); its autotuned kernels keep one config each (autotuning under the
interpreter would run every config; the configs only change tiling, not the result).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the authors' kernels on CPU; set before triton loads

import argparse
import importlib.util
import json
import math
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F


SELECTION = "vllm/model_executor/layers/fused_top_p_selection_tp_pd.py"


# ---------------------------------------------------------------------------- the authors' code
def load_authors_selection(peer: Path):
    """The authors' topselectionvarlen from a UniPrefill checkout (the repository root or its
    vllm-releases-* folder), with the few vLLM / fla names it imports stubbed."""
    cands = [peer / SELECTION] + sorted(peer.glob(f"*/{SELECTION}"))
    path = next((c for c in cands if c.is_file()), None)
    if path is None:
        raise SystemExit(f"benchmarks.parity.token_drop: no {SELECTION} under {peer} (pass the UniPrefill checkout)")
    stubs = {
        "fla": types.ModuleType("fla"), "fla.utils": types.ModuleType("fla.utils"),
        "vllm": types.ModuleType("vllm"), "vllm.distributed": types.ModuleType("vllm.distributed"),
        "vllm.logger": types.ModuleType("vllm.logger"),
    }
    stubs["fla.utils"].autocast_custom_fwd = lambda f: f
    stubs["fla.utils"].contiguous = lambda f: f
    stubs["vllm.distributed"].get_tp_group = lambda: types.SimpleNamespace(world_size=1)
    stubs["vllm.distributed"].all_gather = None
    import logging
    stubs["vllm.logger"].init_logger = logging.getLogger
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        spec = importlib.util.spec_from_file_location("authors_selection", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    # one config per autotuned kernel (interpreter: autotuning would run each); pruned configs
    # must stay valid: Q_TILE <= LAST_Q (128), BLOCK_SIZE (64) <= K_TILE
    for name in ("fused_part_gemm_kernel", "fused_block_softmax_kernel", "fused_block_mean_kernel",
                 "fused_top_p_kernel", "expand_block_mask_kernel"):
        tuner = getattr(mod, name)
        ok = [c for c in tuner.configs if c.kwargs.get("K_TILE_SIZE", 128) >= 64 and c.kwargs.get("Q_TILE_SIZE", 32) <= 128]
        # the largest tiles: the fewest interpreted programs
        tuner.configs = [max(ok, key=lambda c: (c.kwargs.get("Q_TILE_SIZE", 0), c.kwargs.get("K_TILE_SIZE", 0)))]
    return mod.topselectionvarlen, path


class AuthorsModel:
    """transformers' decoder driven layer by layer in the authors' schedule (float32, CPU)."""

    def __init__(self, hf, select, drop_layers: list[int], cfg: dict):
        self.hf, self.select, self.drop_layers, self.cfg = hf, select, set(drop_layers), cfg
        from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb
        self.rope = apply_rotary_pos_emb
        m = hf.model
        self.layers, self.norm, self.rotary = m.layers, m.norm, m.rotary_emb
        c = hf.config
        self.hq, self.hkv = c.num_attention_heads, c.num_key_value_heads
        self.d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    def _qkv(self, layer, x, pos):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        T = x.shape[0]
        q = a.q_proj(h).view(T, self.hq, self.d)
        k = a.k_proj(h).view(T, self.hkv, self.d)
        v = a.v_proj(h).view(T, self.hkv, self.d)
        cos, sin = self.rotary(x[None], pos[None])
        q, k = self.rope(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), v  # [T, H, D] post-RoPE

    def _attend(self, q, k, v, q_pos, k_pos, rows: int = 1024):
        """Causal attention (by position) of q over k, v (GQA), `rows` queries at a time: the
        scores of all 8K queries at once ([H, T, T] floats, 3.6 GB at 8K) were OOM-killed here."""
        g = self.hq // self.hkv
        kk = k.repeat_interleave(g, 1).transpose(0, 1).contiguous()
        vv = v.repeat_interleave(g, 1).transpose(0, 1).contiguous()
        out = []
        for r0 in range(0, q.shape[0], rows):
            qb, pb = q[r0:r0 + rows].transpose(0, 1), q_pos[r0:r0 + rows]
            mask = (k_pos[None, :] <= pb[:, None])[None]
            out.append(F.scaled_dot_product_attention(qb, kk, vv, attn_mask=mask).transpose(0, 1))
        return torch.cat(out).reshape(q.shape[0], -1)

    @torch.no_grad()
    def prefill(self, ids: list[int]):
        """-> (last row's logits, per layer kept positions, per layer (k, v, positions) written)."""
        cfg = self.cfg
        pos = torch.arange(len(ids))
        x = self.hf.model.embed_tokens(torch.tensor(ids))
        kept, cache = [], []
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, pos)
            cache.append((k, v, pos))  # the layer's attention runs (and writes KV) over all current rows
            a = layer.self_attn.o_proj(self._attend(q, k, v, pos, pos))
            x = x + a
            if i in self.drop_layers and x.shape[0] > cfg["attention_sink"] + cfg["last_q"]:
                T = x.shape[0]
                cu = torch.tensor([0, T], dtype=torch.int32)
                mask, _, _ = self.select(q.reshape(T, -1).contiguous(), k.reshape(T, -1).contiguous(), self.d, cu, T,
                                         cfg["block_size"], cfg["attention_sink"], cfg["last_q"], cfg["p"])
                x, pos = x[mask], pos[mask]
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            kept.append(pos.clone())
        logits = self.hf.lm_head(self.norm(x[-1:]))[0]
        return logits, kept, cache

    @torch.no_grad()
    def forced(self, cache, start: int, tokens: list[int]) -> torch.Tensor:
        """Logits [len(tokens), vocab] of `tokens` decoded after the prompt (causal among them)."""
        if not tokens:  # a one-token answer: the prefill's logits are all there is
            return torch.empty(0, self.hf.config.vocab_size)
        pos = torch.arange(start, start + len(tokens))
        x = self.hf.model.embed_tokens(torch.tensor(tokens, dtype=torch.int64))
        for layer, (ck, cv, cpos) in zip(self.layers, cache):
            q, k, v = self._qkv(layer, x, pos)
            o = self._attend(q, torch.cat([ck, k]), torch.cat([cv, v]), pos, torch.cat([cpos, pos]))
            x = x + layer.self_attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.hf.lm_head(self.norm(x))


# ---------------------------------------------------------------------------- our engine
def engine_forced(llm, ids: list[int], gold: list[int]):
    """Prefill ids in our engine, then force gold: (log-probs [len(gold), vocab] as list of argmax /
    gold log p, per layer kept positions of the prompt)."""
    from infhip import SamplingParams
    from infhip.runtime.sequence import Sequence
    seq = Sequence(seq_id=50_000 + int(time.time() * 1000) % 1_000_000, prompt_token_ids=list(ids),
                   params=SamplingParams(max_tokens=len(gold), ignore_eos=True))
    llm.scheduler.add(seq)
    lps, arg, j = [], [], 0
    while j < len(gold):
        out = llm.scheduler.schedule()
        logits = llm.runner.execute(out)
        if out.chunks[0].needs_logits:
            lp = torch.log_softmax(logits[0].double(), -1)
            lps.append(lp[gold[j]].item())
            arg.append(int(lp.argmax()))
            llm.scheduler.update(out, {seq.seq_id: gold[j]})
            j += 1
        else:
            llm.scheduler.update(out, {})
    llm.scheduler.finish(seq, "abort")
    from infhip.eval.common import record_kept_positions
    kept_positions = record_kept_positions(llm)  # the dict recording since the engine was made
    kept = {layer: torch.cat(c) for layer, c in kept_positions.get(seq.seq_id, {}).items()}
    return lps, arg, kept


def summarize(lps, arg, gold, kept: dict[int, torch.Tensor], n: int, needle: list[int], num_layers: int, tok):
    """One cell of the table: kept[l] = prompt positions that ran layer l's MLP (absent: all)."""
    counts, gone, sets = [], [], []
    have = set(range(n))
    for layer in range(num_layers):
        if layer in kept:
            have = set(kept[layer].tolist())
        counts.append(len(have))
        sets.append(have)
        if needle and not set(needle) <= have:
            gone.append(layer)
    j = next((i for i, (a, g) in enumerate(zip(arg, gold)) if a != g), len(gold))
    greedy = arg[:j + 1]
    return {"log_p_gold": sum(lps), "greedy_is_gold": j == len(gold), "greedy_prefix": tok.decode(greedy),
            "kept_per_layer": counts, "needle_gone_after_layers": gone,
            "retention": sum(counts) / (num_layers * n)}, sets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", type=Path, help="UniPrefill checkout (needed by the authors column)")
    ap.add_argument("--engine", default="engines/q05-dense", type=Path)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="alias of the GGUF transformers loads")
    ap.add_argument("--tasks", default="niah_single_2")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--samples", default="0")
    ap.add_argument("--template", default="chat")
    ap.add_argument("--column", action="append", default=[], help="dense | authors | NAME=token-drop knobs (repeat)")
    ap.add_argument("--authors-layers", default="auto", help="drop layers of the authors column: comma list, or "
                    "auto = the authors' Llama-3.1-8B list as a depth rule (infhip/methods/token_drop/ AUTHORS_LLAMA_EIGHTHS)")
    ap.add_argument("--p", type=float, default=0.99, help="the authors column's top-p")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the records here (rewritten after every cell)")
    args = ap.parse_args()
    if not args.column:
        raise SystemExit("benchmarks.parity.token_drop: give at least one --column (dense, authors, NAME=knobs)")
    torch.set_num_threads(args.threads)

    from infhip import LLM
    from infhip.eval.common import record_kept_positions
    from infhip.eval.ruler_prompts import ruler_prompt
    from infhip.methods.token_drop import parse_token_drop_knobs
    from infhip.methods.token_drop import AUTHORS_LLAMA_EIGHTHS, default_drop_layers
    from infhip.runtime.engine import load_tokenizer
    from infhip.config import EngineConfig

    tok = load_tokenizer(args.engine)
    plan = EngineConfig.load(args.engine).plan
    num_layers = len(plan.layers)
    full = [lp.index for lp in plan.layers if lp.window is None]
    authors_layers = (list(default_drop_layers(full, num_layers, AUTHORS_LLAMA_EIGHTHS)) if args.authors_layers == "auto"
                      else [int(x) for x in args.authors_layers.split(",") if x.strip()])

    from infhip.methods.token_drop import TokenDropConfig
    engine = None  # one engine for every engine column (float32 weights are 2.4 GB each): the
    # column's token drop is switched on its runner before each prompt (ModelRunner.set_transform)
    columns = []  # (name, runner, token-drop config or None)
    for spec in args.column:
        if spec == "dense" or "=" in spec:
            if engine is None:
                engine = LLM(str(args.engine))
                record_kept_positions(engine)
            if spec == "dense":
                columns.append(("dense", engine, None))
            else:
                name, knobs = spec.split("=", 1)
                columns.append((name, engine, TokenDropConfig().replace(**parse_token_drop_knobs(knobs))))
        elif spec == "authors":
            if args.peer is None:
                raise SystemExit("benchmarks.parity.token_drop: the authors column needs --peer (a UniPrefill checkout)")
            select, path = load_authors_selection(args.peer)
            from infhip.builder import registry
            from transformers import AutoModelForCausalLM
            gguf = registry.resolve_model(args.model).path
            hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
            cfg = dict(block_size=64, attention_sink=128, last_q=128, p=args.p)
            columns.append(("authors", AuthorsModel(hf, select, authors_layers, cfg), None))
            print(f"authors: {path}, drop layers {authors_layers}, {cfg}", flush=True)
        else:
            raise SystemExit(f"benchmarks.parity.token_drop: --column {spec!r}: dense, authors or NAME=knobs")

    records = []
    meta = {"engine": str(args.engine), "model": args.model, "length": args.length, "template": args.template,
            "columns": args.column, "authors_layers": authors_layers, "authors_p": args.p,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for task in args.tasks.split(","):
        for s in [int(x) for x in args.samples.split(",")]:
            p = ruler_prompt(tok, task, args.length, s, template=args.template)
            ids, ans = p.ids, p.answers[0]
            gold = tok.encode(" " + ans + ("." if task.startswith("niah") else ""), add_special_tokens=False)
            offs = tok(p.text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
            c0 = p.text.find(ans)
            needle = [i for i, (a, b) in enumerate(offs) if c0 >= 0 and a < c0 + len(ans) and b > c0]
            authors_sets = None  # the authors column's rows per layer (compared when it ran first)
            print(f"\n== {task} {args.length} sample {s}: {len(ids)} tokens, answer {ans!r}, needle tokens "
                  f"{needle[:1]}..{needle[-1:]}", flush=True)
            for name, runner, drop_config in columns:
                t0 = time.time()
                if name == "authors":
                    last, kept_l, cache = runner.prefill(ids)
                    logits = torch.cat([last[None], runner.forced(cache, len(ids), gold[:-1])]).double().log_softmax(-1)
                    lps = [logits[i, g].item() for i, g in enumerate(gold)]
                    arg = logits.argmax(-1).tolist()
                    kept = dict(enumerate(kept_l))
                else:
                    runner.runner.set_transform("token_drop", drop_config)
                    lps, arg, kept = engine_forced(runner, ids, gold)
                cell, sets = summarize(lps, arg, gold, kept, len(ids), needle, num_layers, tok)
                if name == "authors":
                    authors_sets = sets
                elif authors_sets is not None:  # per layer: |ours xor authors'| rows that ran the MLP
                    cell["rows_differing_from_authors"] = [len(a ^ b) for a, b in zip(sets, authors_sets)]
                cell.update(task=task, sample=s, column=name, num_tokens=len(ids), answer=ans,
                            needle_tokens=needle, seconds=round(time.time() - t0, 1))
                records.append(cell)
                print(f"{name:>14}: greedy = gold {cell['greedy_is_gold']!s:5}  log p(gold) {cell['log_p_gold']:8.3f}  "
                      f"retention {cell['retention']:.3f}  needle gone after layers {cell['needle_gone_after_layers']}  "
                      f"greedy {cell['greedy_prefix']!r}  ({cell['seconds']:.0f} s)\n{'':16}kept per layer "
                      f"{cell['kept_per_layer']}" + (f"\n{'':16}rows differing from the authors' per layer "
                      f"{cell['rows_differing_from_authors']}" if "rows_differing_from_authors" in cell else ""),
                      flush=True)
                if args.json:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps({"meta": meta, "records": records}, indent=1))


if __name__ == "__main__":
    main()
