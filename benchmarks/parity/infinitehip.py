"""InfiniteHiP parity with the authors' code: their mask (hip-attention v1_2, run from the path
given) and ours (plugins/infinitehip pruning) on the same real Q/K, per head and query block.

    python -m benchmarks.parity.infinitehip --hip-attn /path/to/hip-attention (or an unpacked
        hip-attn wheel / site-packages) --lengths 32768,131072 --prompts niah_single_2:0,passkey:0.5 \
        [--template chat] [--layers all] [--query-blocks 4] [--layouts shared,kv_head,q_head] [--out DIR]
    # CPU (their kernels under TRITON_INTERPRET=1, ours as the float64 reference), 8K, a few layers:
    TRITON_INTERPRET=1 python -m benchmarks.parity.infinitehip --hip-attn ~/hip-attn-1.2.9 \
        --lengths 8192 --layers 3,9,15,21 --query-blocks 2
    # H200 (one device call, with the GGUF and the hip-attn wheel staged):
    bash benchmarks/gpu/run.sh window suspects   (beside the suspects' runs; CI: tests/test_quality_tools.py)

Per (length, prompt): one prefill of Qwen2.5-Coder-0.5B (transformers, GGUF of the `real-qwen`
extra) captures the rotated q and k of every layer (an attention function registered with
transformers that records them, then runs SDPA). Per layer and for the newest --query-blocks
blocks of 64 queries:

* reference: their `dual_stage_quadratic_hip_attention` with their default HiPAttentionConfig
  (benchmarks/parity/hip_attn_ref.py says what is patched at run time), its final mask as their
  block-sparse attention receives it (sink + kept blocks + window);
* ours: `pruning_stage` with the `3k` preset's knobs (infhip.methods.infinitehip.InfiniteHipConfig defaults:
  stages, query strides, special layers, chunk score; RoPE style none inside the trained window,
  as rope_off_in_trained_window does), then sink + survivors + stream (blocks.block_key_mask);
  one mask per --layouts entry that our pruning_stage accepts (`mask_layout`; "shared" always).
  On CUDA our Triton kernels run; on CPU their float64 reference (pruning_ref.py, same contract).
* with --ref-per-head, also their mask with HIP_HEAD_REDUCE=0: their chunk scores are not maxed
  over heads, so each query head keeps its own chunks (their default, 1, shares one selection).
  Our masks are those the engine would use at this length even where dense_threshold (33K) would
  run the layer dense (as the issue's gates force InfiniteHiP on at 32K).

Reported per head and block: `overlap` = share of the reference's kept keys that ours keeps
(last query of the block), `jaccard` of the two key sets, the attention-mass recall of each
against exact float64 attention (mean over the block's queries; plugins' attention_recall), and
per layer the share of needle tokens the last query keeps (in each head) and the needle's dense
attention mass (the head that reads it most; the table shows the share that head's mask keeps,
the JSON also the worst head's). Raw JSON per run under --out (default $OUT, else
the current folder); a markdown table of per-layer means is printed last.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks.parity import hip_attn_ref

from infhip.methods.infinitehip import InfiniteHipConfig
from infhip.plugins.infinitehip import (attention_recall, block_key_mask, plan_query_blocks,
                                        pruning_stage, pruning_stage_ref)
from infhip.plugins.paged_kv import PagedKV

MODEL = "qwen2.5-coder-0.5b"
BLOCK_Q = 64
PAGE = 16


def load_model(device: str, dtype: torch.dtype, name: str = MODEL):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infhip.builder import registry

    gguf = registry.resolve_model(name).path
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    return tok, model.to(device).eval()


def prompt_ids(tok, spec: str, length: int, template: str = "base") -> tuple[list[int], list[str]]:
    """(ids, answers) of "TASK:SAMPLE" (a RULER task in `template`, infhip.eval.ruler_prompts) or
    "passkey:DEPTH" (infhip.eval.passkey, PG haystack, sample 0)."""
    kind, _, arg = spec.partition(":")
    if kind == "passkey":
        from infhip.eval.passkey import passkey_prompt_ids, passkey_value

        depth = float(arg or 0.5)
        key = passkey_value(0, length, depth, 0)
        return passkey_prompt_ids(tok, length, depth, key, haystack="pg"), [str(key)]
    from infhip.eval.ruler_prompts import ruler_prompt

    p = ruler_prompt(tok, kind, length, int(arg or 0), template=template)
    return p.ids, p.answers


def needle_tokens(tok, ids: list[int], answers: list[str]) -> list[int]:
    """Positions of the answers' tokens in the prompt (each spelling with and without a space)."""
    found = set()
    for ans in answers:
        for text in (f" {ans}", ans):
            needle = tok.encode(text, add_special_tokens=False)
            for s in range(len(ids) - len(needle) + 1):
                if ids[s:s + len(needle)] == needle:
                    found.update(range(s, s + len(needle)))
    return sorted(found)


def capture_qk(model, ids: list[int], layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (q [T, Hq, D], k [T, Hkv, D])} after RoPE, from one prefill: the model's attention
    function (transformers' registry entry for its implementation, e.g. sdpa) is wrapped for the
    call by one that records its inputs first."""
    from transformers import AttentionInterface

    name = model.config._attn_implementation
    original = AttentionInterface._global_mapping[name]
    store = {}

    def capture(module, query, key, *args, **kwargs):  # query [1, Hq, T, D], key [1, Hkv, T, D]
        if module.layer_idx in layers:
            store[module.layer_idx] = (query[0].transpose(0, 1).contiguous(), key[0].transpose(0, 1).contiguous())
        return original(module, query, key, *args, **kwargs)

    AttentionInterface.register(name, capture)
    all_layers = model.model.layers
    model.model.layers = all_layers[:max(layers) + 1]  # nothing after the last captured layer runs
    try:
        with torch.no_grad():
            model.model(torch.tensor([ids], device=model.device), use_cache=False)
    finally:
        AttentionInterface.register(name, original)
        model.model.layers = all_layers
    return store


def _stage_ref(q, kv, tables, q_start, q_lens, ends, sel, num, *, block_q, **kw):
    return pruning_stage_ref(q, kv.k, tables, q_start, q_lens, ends, sel, num, **kw)


def our_masks(cfg: InfiniteHipConfig, layer: int, q, k, T: int, layouts: list[str], rope: str, inv_freq,
              needle: list[int] = ()):
    """({layout: bool [NB, Hq, T]} key sets of the newest NB blocks (the keys their last query
    sees), ends, {layout: [share of the needle's tokens the last block keeps after stage i (its
    survivors, the sink, the stream), for i in stages]} (per-head layouts: the best head's share))."""
    C, Hq, _ = q.shape
    dev = q.device
    q_start, q_lens, ends, _ = plan_query_blocks([C], [T], BLOCK_Q, device=dev)
    pages = -(-T // PAGE)
    k_cache = torch.zeros(pages * PAGE, *k.shape[1:], dtype=k.dtype, device=dev)
    k_cache[:T] = k
    kv = PagedKV(k_cache.view(pages, PAGE, *k.shape[1:]), None)
    tables = torch.arange(pages, dtype=torch.int32, device=dev)[None].expand(len(ends), -1).contiguous()
    # CPU: our float64 reference of the same stage (pruning_ref.py, the kernels' contract; the
    # interpreter would take hours on a shared CPU); CUDA: the Triton kernels the engine runs.
    stage_fn = pruning_stage if q.is_cuda else _stage_ref
    accepts = "mask_layout" in inspect.signature(pruning_stage).parameters and \
        "mask_layout" in inspect.signature(pruning_stage_ref).parameters
    out, survival = {}, {}
    # the needle's tokens the stages decide on: those in the sink and the stream are kept anyway
    end = int(ends[-1])
    middle = [t for t in needle if cfg.n_sink <= t < end - cfg.n_stream]
    wanted = torch.tensor(middle, dtype=torch.int32, device=dev)
    for layout in layouts:
        if layout != "shared" and not accepts:
            continue
        extra = {"mask_layout": layout} if accepts else {}
        sel = num = None
        for st, stride in zip(cfg.stages_of(layer), cfg.query_strides):
            sel, num = stage_fn(q, kv, tables, q_start, q_lens, ends, sel, num, chunk_size=st.chunk_size,
                                     k=st.k, block_q=st.block_q, n_sink=cfg.n_sink, n_stream=cfg.n_stream,
                                     rope_style=rope, inv_freq=inv_freq if rope != "none" else None,
                                     head_normalized=cfg.chunk_score == "head_normalized", query_stride=stride,
                                     **extra)
            if len(needle):  # where the needle leaves our mask: its tokens among the survivors
                last = sel[-1][None] if sel.dim() == 2 else sel[-1]  # [H, n]
                share = (torch.isin(last, wanted).sum(-1).max().item() + len(needle) - len(middle)) / len(needle)
                survival.setdefault(layout, []).append(share)
        rows = sel[:, None] if sel.dim() == 2 else sel  # [NB, H, n], H = 1 (shared), Hkv or Hq
        per = torch.stack([block_key_mask(rows[:, h], ends, cfg.n_sink, cfg.n_stream, T) for h in range(rows.shape[1])], 1)
        out[layout] = per.repeat_interleave(Hq // per.shape[1], dim=1).cpu()  # [NB, Hq, T]
    return out, ends.cpu(), survival


def compare(q, k, keep: torch.Tensor, ref_keep: torch.Tensor, scale: float, ends, T: int):
    """Per block and head: recall of `keep` [NB, Hq, T] and overlap / jaccard with ref_keep."""
    rows = []
    for b, e in enumerate(ends.tolist()):
        qb = q[b * BLOCK_Q:(b + 1) * BLOCK_Q]
        qpos = torch.arange(e - qb.shape[0], e)
        kb = keep[b].to(q.device)[:, None, :e].expand(-1, qb.shape[0], -1)
        rec, _ = attention_recall(qb, k[:e], kb, scale=scale, q_positions=qpos.to(q.device))
        inter = (keep[b] & ref_keep[b]).sum(-1).double()
        rows.append({"recall": rec.cpu().tolist(),
                     "overlap": (inter / ref_keep[b].sum(-1)).tolist(),
                     "jaccard": (inter / (keep[b] | ref_keep[b]).sum(-1)).tolist()})
    return rows


def needle_stats(q_last, k, needle: list[int], keeps: dict[str, torch.Tensor], scale: float, T: int):
    """Dense attention mass of the last query on the needle per head, and per mask the share of
    needle tokens kept (worst head, and in the head that reads the needle most)."""
    if not needle:
        return {}
    Hq, Hkv = q_last.shape[0], k.shape[1]
    kk = k.double().repeat_interleave(Hq // Hkv, dim=1)  # [T, Hq, D]
    probs = torch.softmax(torch.einsum("hd,thd->ht", q_last.double(), kk) * scale, -1).cpu()
    idx = torch.tensor(needle)
    mass = probs[:, idx].sum(-1)
    top = int(mass.argmax())
    out = {"needle_mass_per_head": mass.tolist(), "reading_head": top}
    for name, keep in keeps.items():  # keep [Hq, T] of the last block
        kept = keep[:, idx].double().mean(-1)
        out[name] = {"kept_worst_head": float(kept.min()), "kept_reading_head": float(kept[top])}
    return out


def run_one(hip, tok, model, spec: str, length: int, layers: list[int], nb: int, layouts: list[str], log,
            template: str = "base", ref_per_head: bool = False, paged: bool | None = None, runs=None, save=None):
    """One prompt at one length, every layer; the run is appended to `runs` first and `save()` is
    called after each layer, so a run cut at a deadline keeps the layers it finished."""
    ids, answers = prompt_ids(tok, spec, length, template)
    T, C = len(ids), nb * BLOCK_Q
    needle = needle_tokens(tok, ids, answers)
    t0 = time.perf_counter()
    qk = capture_qk(model, ids, layers)
    log(f"{spec} T={T}: prefill {time.perf_counter() - t0:.1f} s, needle tokens {needle[:8]}")
    trained = model.config.max_position_embeddings
    cfg = InfiniteHipConfig()
    rot = model.model.rotary_emb
    cos, sin = rot(qk[layers[0]][0][None], torch.arange(T, device=model.device)[None])
    out = {"prompt": spec, "length": T, "answers": answers, "needle": needle, "layers": {}}
    if runs is not None:
        runs.append(out)
    for layer in layers:
        q, k = qk[layer]
        scale = q.shape[-1] ** -0.5
        t0 = time.perf_counter()
        ref = hip_attn_ref.reference_mask(hip, q, k, layer, C, model_context_length=trained,
                                          cos=cos[0], sin=sin[0], scale=scale, paged=paged)
        t_ref = time.perf_counter() - t0
        rope = "none" if (cfg.rope_off_in_trained_window and T <= trained) else cfg.pruning_rope_of(layer)
        t0 = time.perf_counter()
        ours, ends, survival = our_masks(cfg, layer, q[-C:], k, T, layouts, rope, rot.inv_freq, needle)
        t_ours = time.perf_counter() - t0
        ref_keep = torch.stack([ref.keep(b, int(e), T) for b, e in enumerate(ends.tolist())])  # [NB, Hq, T]
        qC = q[-C:]
        masks = {"reference": ref_keep, **{f"ours_{n}": m for n, m in ours.items()}}
        if ref_per_head:  # their code with HIP_HEAD_REDUCE=0: each query head keeps its own chunks
            prev = os.environ.get("HIP_HEAD_REDUCE")
            os.environ["HIP_HEAD_REDUCE"] = "0"
            try:
                ph = hip_attn_ref.reference_mask(hip, q, k, layer, C, model_context_length=trained,
                                                 cos=cos[0], sin=sin[0], scale=scale, paged=paged)
            finally:
                os.environ.pop("HIP_HEAD_REDUCE") if prev is None else os.environ.update(HIP_HEAD_REDUCE=prev)
            masks["reference_q_head"] = torch.stack([ph.keep(b, int(e), T) for b, e in enumerate(ends.tolist())])
        entry = {name: compare(qC, k, m, ref_keep, scale, ends, T) for name, m in masks.items()}
        entry["keys_kept_last_block"] = {name: m[-1].sum(-1).tolist() for name, m in masks.items()}
        entry["needle"] = needle_stats(q[-1], k, needle, {n: m[-1] for n, m in masks.items()}, scale, T)
        entry["seconds"] = {"reference": t_ref, "ours": t_ours}
        entry["rope_ours"] = rope
        entry["needle_after_stage_ours"] = survival
        out["layers"][layer] = entry
        if save is not None:
            save()
        s = summary_row(entry)
        log(f"  layer {layer}: " + ", ".join(f"{n} recall {v['recall']:.3f} overlap {v['overlap']:.3f}"
                                             for n, v in s.items()) + f" ({t_ref:.0f} s / {t_ours:.0f} s)")
    return out


def summary_row(entry) -> dict[str, dict[str, float]]:
    res = {}
    for name, blocks in entry.items():
        if not isinstance(blocks, list):
            continue
        mean = lambda key: sum(sum(b[key]) / len(b[key]) for b in blocks) / len(blocks)  # noqa: E731
        res[name] = {"recall": mean("recall"), "overlap": mean("overlap"), "jaccard": mean("jaccard")}
    return res


def markdown(runs) -> str:
    names = [n for n in runs[0]["layers"][next(iter(runs[0]["layers"]))] if isinstance(
        runs[0]["layers"][next(iter(runs[0]["layers"]))][n], list)]
    head = "| prompt | T | layer | " + " | ".join(f"{n} recall" for n in names) + " | " + \
        " | ".join(f"{n} overlap" for n in names[1:]) + " | needle kept by the reading head: " + \
        ", ".join(names) + " | needle mass (reading head) | needle among our survivors after each stage (shared) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for run in runs:
        for layer, entry in run["layers"].items():
            s = summary_row(entry)
            nd = entry["needle"]
            kept = ", ".join(f"{nd[n]['kept_reading_head']:.2f}" for n in names) if nd else "—"
            mass = f"{max(nd['needle_mass_per_head']):.3f} (h{nd['reading_head']})" if nd else "—"
            stages = entry.get("needle_after_stage_ours", {}).get("shared")
            surv = " → ".join(f"{x:.2f}" for x in stages) if stages else "—"
            lines.append(f"| {run['prompt']} | {run['length']} | {layer} | "
                         + " | ".join(f"{s[n]['recall']:.3f}" for n in names) + " | "
                         + " | ".join(f"{s[n]['overlap']:.3f}" for n in names[1:]) + f" | {kept} | {mass} | {surv} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hip-attn", help="hip-attention checkout, unpacked wheel or site-packages")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--prompts", default="niah_single_2:0,niah_single_2:1,passkey:0.5")
    ap.add_argument("--template", default="base", choices=("base", "chat"), help="RULER prompt template")
    ap.add_argument("--layers", default="all", help="comma-separated 0-based layers, or all")
    ap.add_argument("--query-blocks", type=int, default=4, help="newest query blocks of 64 measured (>= 2)")
    ap.add_argument("--layouts", default="shared,kv_head,q_head", help="our mask layouts, where supported")
    ap.add_argument("--ref-per-head", action="store_true",
                    help="also their mask with HIP_HEAD_REDUCE=0 (one selection per query head; their default is 1)")
    ap.add_argument("--model", default=MODEL, help="a registry model with a GGUF (infhip-build --model names; "
                    "CI runs smollm2-135m at a few hundred tokens)")
    ap.add_argument("--ref-cache", choices=("auto", "paged", "contiguous"), default="auto",
                    help="how their mask reads the keys: auto = paged on the CPU, contiguous on CUDA (the branch "
                    "Triton 3.6 compiles there)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--table-from", nargs="+", metavar="JSON", help="only print the table of earlier runs' raw JSON")
    a = ap.parse_args()
    if a.table_from:
        print(markdown([r for f in a.table_from for r in json.loads(Path(f).read_text())["runs"]]))
        return
    if not a.hip_attn:
        ap.error("--hip-attn is required (a hip-attention checkout, unpacked wheel or site-packages)")
    if a.query_blocks < 2:
        ap.error("--query-blocks must be >= 2: their landmark scan runs for more than one query block")
    hip = hip_attn_ref.load(a.hip_attn)
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    tok, model = load_model(a.device, dtype, a.model)
    n_layers = model.config.num_hidden_layers
    layers = list(range(n_layers)) if a.layers == "all" else [int(x) for x in a.layers.split(",")]
    if any(not 0 <= i < n_layers for i in layers):
        ap.error(f"--layers must be in [0, {n_layers})")
    log = lambda m: print(m, flush=True)  # noqa: E731
    log(f"hip-attn {hip.version} from {hip.package}; torch {torch.__version__}; {a.device} {dtype}")
    runs = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "hip_attn": hip.version, "torch": torch.__version__,
            "device": a.device if a.device == "cpu" else torch.cuda.get_device_name(),
            "machine": platform.node(), "interpret": os.environ.get("TRITON_INTERPRET", "0"),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def save():
        (out / "parity_infinitehip.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))

    paged = {"auto": None, "paged": True}.get(a.ref_cache, False)
    for length in [int(x) for x in a.lengths.split(",")]:
        for spec in a.prompts.split(","):
            run_one(hip, tok, model, spec, length, layers, a.query_blocks, a.layouts.split(","), log,
                    a.template, a.ref_per_head, paged, runs=runs, save=save)
    print(markdown(runs))


if __name__ == "__main__":
    main()
