"""Token drop (UniPrefill) vs the dense engine: time to first token, random weights, bf16, one GPU.

    python -m benchmarks.speed.bench_token_drop --out $OUT                      # ~4 min on an H200
    python -m benchmarks.speed.bench_token_drop --out /tmp/x --dry-run          # the plan, no GPU
    python -m benchmarks.speed.bench_token_drop --out $OUT --retention 1,0.3 --spare-anchors 0,1   # cost of spare_anchors=1

For each model shape (llama-3.1-8b, gemma-3-12b; random weights: no checkpoint travels) one
engine is built on the GPU from the bundled config and loaded once; the dense engine and token
drop with a forced retention rho (``TokenDropConfig(min_prompt_len=0)`` and
``set_forced_retention(llm, rho)``, switched on the same runner between runs, so both share
weights and KV cache) prefill the same random
prompt. Random weights give no meaningful attention, so the share of blocks kept is forced
(top-p ratios are measured on real models: docs/quality.md); rho = 1 keeps every block and
measures the overhead of the machinery (importance, selection, gathers, kept-query attention).
TTFT = wall time of ``generate(max_tokens=1)`` with the GPU synchronised, best of --reps (the
128K runs: one rep). Prefill runs in the engine's chunks (32K on GPU: a 128K prompt is four
passes, each dropping from its own last 128 queries).

Fewer layers: --llama-layers / --gemma-layers (the same 5:1 sliding/global pattern; fewer layers
after the first anchor means a smaller speedup, so a truncated run understates it); the output
says when a model ran truncated. Prints a ratio table last and writes JSON to --out.
`--smoke` (benchmarks/speed/tiny.py): the same runs on the CPU, tiny models, prompts cut to 200.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.speed import tiny

MODELS = ("llama-3.1-8b", "gemma-3-12b")


def parse_len(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for bench_token_drop.json")
    p.add_argument("--work", type=Path, default=Path("/tmp/infhip-bench-token-drop"), help="engines are built here")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--lengths", default="8k,32k,128k")
    p.add_argument("--retention", default="1,0.5,0.3,0.1", help="forced retention ratios rho")
    p.add_argument("--llama-layers", type=int, default=None, help="default: all 32")
    p.add_argument("--gemma-layers", type=int, default=None, help="default: all 48 (24 halves the time)")
    p.add_argument("--spare-anchors", default="0", help="spare_anchors values to time each rho with (e.g. 0,1: the "
                   "first anchor keeps every token, the quality remedy of docs/quality.md)")
    p.add_argument("--drop-layers", default="auto", help="drop_layers schedules to time each rho with, comma-"
                   "separated (each 'auto', 'every' or layers joined by ':', e.g. auto,15:19:23:27)")
    p.add_argument("--knobs", default="", help="more token-drop knobs for every drop run (as infhip-eval "
                   "--token-drop), e.g. drop_point=before_attention,reenter=true: the schedule of the README's "
                   "figure (since the schedule knobs, the default is the authors' no re-entry, under which a "
                   "forced rho compounds over the anchors)")
    p.add_argument("--reps", type=int, default=2, help="best of this many runs below 128K")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU: the code path, not speed")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = make_parser().parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        raise SystemExit(f"bench_token_drop: unknown model(s) {bad}; choose from {MODELS}")
    args.lengths = list(dict.fromkeys(tiny.cap(parse_len(x), args.smoke) for x in args.lengths.split(",") if x.strip()))
    args.retention = [float(x) for x in args.retention.split(",") if x.strip()]
    if any(not 0.0 <= r <= 1.0 for r in args.retention):
        raise SystemExit(f"bench_token_drop: every retention must be in [0, 1], got {args.retention}")
    args.spare_anchors = [int(x) for x in args.spare_anchors.split(",") if x.strip()]
    if not args.spare_anchors or any(n < 0 for n in args.spare_anchors):
        raise SystemExit(f"bench_token_drop: --spare-anchors takes anchor counts >= 0, got {args.spare_anchors}")
    args.drop_layers = [x.strip() for x in args.drop_layers.split(",") if x.strip()] or ["auto"]
    from infhip.methods.token_drop import parse_token_drop_knobs
    try:
        args.knobs = parse_token_drop_knobs(args.knobs)
    except ValueError as e:
        raise SystemExit(f"bench_token_drop: --knobs: {e}") from None
    clash = sorted(set(args.knobs) & {"min_prompt_len", "spare_anchors", "drop_layers"})
    if clash:
        raise SystemExit(f"bench_token_drop: --knobs {clash} are set by the benchmark's own flags; use those")
    return args


def layers_of(args, model: str) -> int | None:
    return args.llama_layers if model.startswith("llama") else args.gemma_layers


def build(model: str, num_layers: int | None, max_len: int, work: Path, smoke: bool = False) -> Path:
    """A random-weight bf16 engine of `model`'s shape (optionally truncated), built on the GPU
    (smoke: the tiny shape in float32 on the CPU)."""
    from infhip.builder.build import build_engine
    from infhip.builder.registry import bundled_config

    cfg = tiny.tiny_config(model) if smoke else json.loads(bundled_config(model).read_text())
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
        cfg.pop("layer_types", None)  # re-derived from the sliding-window pattern
    src = work / model / "config.json"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(json.dumps(cfg))
    kw = tiny.BUILD if smoke else dict(dtype="bfloat16", device="cuda")
    return build_engine(checkpoint=src, output_dir=work / model / "engine", **kw, random_weights=True,
                        max_seq_len=max_len, max_batch_size=1, force=True,
                        progress=False, token_drop=True)  # token drop's kernels in the engine: none compile while timed


def ttft_s(llm, ids: list[int], reps: int) -> float:
    import torch

    from infhip import SamplingParams
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for _ in range(reps):
        tiny.sync()
        t = time.perf_counter()
        llm.generate(prompt_token_ids=[ids], sampling_params=sp)
        tiny.sync()
        best = min(best, time.perf_counter() - t)
    return best


def run_model(args, model: str, res: dict) -> None:
    import torch

    from infhip import LLM
    from infhip.methods.token_drop import TokenDropConfig
    from infhip.eval.common import set_forced_retention

    t0 = time.perf_counter()
    max_len = max(args.lengths)
    engine = build(model, layers_of(args, model), max_len, args.work, args.smoke)
    llm = LLM(engine, max_num_seqs=1, kv_cache_memory_bytes=(64 << 20) if args.smoke else 28 << 30, enforce_eager=True,
              prefix_caching=False)
    cfg = llm.engine.config
    num_layers = cfg.model.num_layers
    info = res.setdefault("models", {}).setdefault(model, {
        "num_layers": num_layers, "drop_layers": sorted(llm.runner.transforms["token_drop"].drop_at),
        "truncated": layers_of(args, model) is not None, "chunk": cfg.build.max_num_batched_tokens,
        "setup_s": time.perf_counter() - t0, "runs": []})
    print(f"{model}: {num_layers} layers (drop layers {info['drop_layers']}), built+loaded in "
          f"{info['setup_s']:.0f} s{' — TRUNCATED' if info['truncated'] else ''}", flush=True)
    vocab = cfg.model.vocab_size
    configs = [("dense", None, None)] + [
        (name, TokenDropConfig(min_prompt_len=0, spare_anchors=n, drop_layers=d, **args.knobs), r)
        for name, r, n, d in drop_configs(args)]
    warm = [(i * 7919) % (vocab - 10) + 10 for i in range(tiny.cap(4096, args.smoke))]
    for _, drop_config, rho in configs:  # compile the Triton kernels of every path once
        llm.runner.set_transform("token_drop", drop_config)
        set_forced_retention(llm, rho)
        ttft_s(llm, warm, 1)
    for length in args.lengths:
        n = min(length, cfg.build.max_seq_len - 8)
        ids = torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(length)).tolist()
        reps = 1 if n > 65536 else args.reps
        row = {"length": length, "prompt_tokens": n}
        for name, drop_config, rho in configs:
            llm.runner.set_transform("token_drop", drop_config)
            set_forced_retention(llm, rho)
            llm.runner.transforms["token_drop"].stats.retention.clear()
            row[name] = ttft_s(llm, ids, reps)
            kept = [v for per in llm.runner.transforms["token_drop"].stats.retention.values() for v in per.values()]
            if kept:
                row[f"{name} kept"] = sum(k for k, _ in kept) / max(1, sum(t for _, t in kept))
            print(f"  {model} {n:>7} tokens {name:>8}: TTFT {row[name] * 1e3:9.1f} ms"
                  + (f" (kept {row[name + ' kept']:.3f} of tokens per anchor)" if kept else ""), flush=True)
        info["runs"].append(row)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def drop_configs(args) -> list[tuple[str, float, int, str]]:
    """(name, retention, spare_anchors, drop_layers) of every token-drop run."""
    return [(f"rho={r:g}" + (f" spare_anchors={n}" if n else "") + (f" layers={d}" if d != "auto" else ""), r, n, d)
            for d in args.drop_layers for n in args.spare_anchors for r in args.retention]


def table(res: dict, names: list[str]) -> str:
    lines = ["| model | tokens | dense TTFT (ms) | " + " | ".join(f"{n} speedup" for n in names) + " |",
             "|---" * (3 + len(names)) + "|"]
    for model, info in res.get("models", {}).items():
        label = model + (f" ({info['num_layers']} layers)" if info["truncated"] else "")
        for row in info["runs"]:
            cells = [f"{row['dense'] / row[n]:.2f}×" for n in names]
            lines.append(f"| {label} | {row['prompt_tokens']} | {row['dense'] * 1e3:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    names = [name for name, *_ in drop_configs(args)]
    plan = [(m, layers_of(args, m) or "all", args.lengths, ["dense"] + names) for m in args.models]
    if args.dry_run:
        for m, layers, lengths, configs in plan:
            print(f"{m}: layers {layers}, lengths {lengths}, configs {configs}")
        return
    import torch
    import triton
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"gpu": tiny.gpu_name(), "torch": torch.__version__, "triton": triton.__version__,
           "lengths": args.lengths, "retention": args.retention, "spare_anchors": args.spare_anchors,
           "knobs": args.knobs}
    t = time.perf_counter()
    for model in args.models:
        run_model(args, model, res)
    res["total_s"] = time.perf_counter() - t
    (args.out / "bench_token_drop.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"\ntotal {res['total_s']:.0f} s; speedup = dense TTFT / token-drop TTFT (same engine, same prompt)")
    print(table(res, names))


if __name__ == "__main__":
    main()
