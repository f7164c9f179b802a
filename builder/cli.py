"""``infhip-build``: the command-line front of :func:`infhip.builder.build.build_engine`.

    infhip-build --model smollm2-135m --output engines/smollm2-135m --dtype float32
    infhip-build --checkpoint ~/models/Llama-3.2-1B --output engines/llama-1b --max-seq-len 32768
    infhip-build --model llama-3.1-8b --random-weights --device cuda --output engines/l8b-random
    infhip-build --model llama-3.1-8b --preset 3k --output engines/l8b-3k
    infhip-build --model smollm2-135m --token-drop p=0.98,block_size=32 --output engines/smollm2-td
    infhip-build --model llama-3.1-8b --weight-dtype fp8 --output engines/l8b-fp8
    infhip-build --model llama-3.1-8b --tp 2 --output engines/l8b-tp2       # 2 GPUs, one process each
    infhip-build --model gemma-3-12b --preset 3k-flash --random-weights      # -> engines/gemma-3-12b-3k-flash

User errors (missing/corrupt checkpoint, unknown architecture or alias, bad flag values) print one
line on stderr and exit with status 1 (argparse's own usage errors: 2); no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infhip.cli_args import add_renamed_flag, positive_int
from infhip.config import DTYPES, KV_DTYPES, WEIGHT_DTYPES
from infhip.methods import BACKEND, methods, presets, renamed_flags


def _add_method_flags(p: argparse.ArgumentParser) -> None:
    """A flag per registered method: a backend's ``--<name>-overrides KEY=VALUE,...`` (knobs of its
    preset), a transform's ``--<name> [KEY=VALUE,...]`` (bare: its defaults)."""
    for m in methods():
        dest = "method_" + m.name
        if m.kind == BACKEND:
            p.add_argument(m.flag(), dest=dest, default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                           help=f"change knobs of a {m.name} preset ({', '.join(m.presets)}); every knob: docs/knobs.md")
        else:
            p.add_argument(m.flag(), dest=dest, nargs="?", const="", default=None, metavar="SPEC",
                           help=m.summary + "; every knob: docs/knobs.md")


def make_parser() -> argparse.ArgumentParser:
    from infhip.builder.registry import ALIASES

    p = argparse.ArgumentParser(
        prog="infhip-build",
        description="Build an infhip engine (converted weights, plan, tokenizer) from a checkpoint.",
        epilog="model names: " + ", ".join(ALIASES) + ", or a Hugging Face repo id in the local cache")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="PATH",
                     help="Hugging Face model directory, .gguf file, or a config.json (with --random-weights)")
    src.add_argument("--model", metavar="NAME", help="model alias or Hugging Face repo id (offline cache)")
    p.add_argument("--output", metavar="DIR",
                   help="engine directory to write (default: engines/<model>[-<preset>] under the current "
                        "directory, <model> being --model's last path part or --checkpoint's folder / file stem)")
    table = presets()
    p.add_argument("--preset", default="dense", choices=tuple(table),
                   help="execution preset: dense (default), or " + "; ".join(
                       f"{m.name} {' | '.join(m.presets)}" for m in methods(BACKEND)) +
                   " on the layers it runs (knobs in config.json, plan.knobs)")
    _add_method_flags(p)
    for old, hint in renamed_flags().items():
        add_renamed_flag(p, old, hint)
    p.add_argument("--rope-scaling", default=None, metavar="TYPE:FACTOR",
                   help="scale RoPE as a model card's long-context recipe does: yarn:4 (Qwen2.5's recipe for "
                        "128K) or linear:F; the trained window becomes FACTOR times the checkpoint's")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weight dtype (default bfloat16)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES,
                   help="KV-cache dtype: --dtype (the default) or fp8 (e4m3 with a scale per token and kv "
                        "head: half the memory of bf16, so twice the tokens)")
    p.add_argument("--weight-dtype", default="bf16", choices=WEIGHT_DTYPES,
                   help="linear-layer weights: bf16 (default: in --dtype) or fp8 (e4m3 with a float32 scale "
                        "per output channel: half the bytes; FP8 tensor cores on sm_89+, a dequantizing "
                        "path elsewhere); embeddings and norms stay in --dtype")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --weight-dtype fp8: the LM head in fp8 too (a tied one gets an fp8 copy; "
                        "the embeddings stay in --dtype)")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor parallelism: an engine for N GPUs (N processes on the CPU), its weights cut "
                        "Megatron-style into rank0..rank{N-1}.safetensors; N must divide the query heads and the "
                        "MLP width, and divide or be a multiple of the kv heads (default 1)")
    p.add_argument("--max-seq-len", type=positive_int,
                   help="longest sequence served (default: the model's window, at most 131072)")
    p.add_argument("--max-batch-size", type=positive_int, default=16, help="most concurrent sequences (16)")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page, a power of two (16)")
    p.add_argument("--max-num-batched-tokens", type=positive_int,
                   help="token budget of one scheduler step (default max(8192, max batch size))")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="target device (default: cuda when a GPU is visible, else cpu)")
    p.add_argument("--target", metavar="sm_XY",
                   help="GPU to compile the kernels for (default: this GPU; sm_90 builds an H100/H200 "
                        "engine on a machine without one)")
    p.add_argument("--random-weights", action="store_true",
                   help="random weights of the model's shape (no checkpoint weights needed)")
    p.add_argument("--seed", type=int, default=0, help="seed of --random-weights (0)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing engine at --output (an infhip engine only, never the checkpoint)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def default_output(model: str | None, checkpoint: str | None, preset: str) -> Path:
    """engines/<model>[-<preset>] (relative: under the current directory, like TensorRT-LLM's
    builder). <model> is --model's last path part (a repo id "Qwen/Qwen2.5-7B" gives "Qwen2.5-7B"),
    or --checkpoint's folder name / file stem (a config.json: its folder's name); the default
    preset "dense" adds no suffix."""
    if model is not None:
        name = model.rstrip("/").rsplit("/", 1)[-1]
    else:
        path = Path(checkpoint).expanduser().resolve()
        name = path.parent.name if path.name == "config.json" else path.stem if path.is_file() else path.name
    if not name or name in (".", ".."):
        raise ValueError(f"cannot name a default output folder after {model or checkpoint!r}; pass --output DIR")
    return Path("engines") / (name if preset == "dense" else f"{name}-{preset}")


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    from infhip.builder.build import build_engine
    from infhip.errors import BuildError

    knobs = {}
    try:
        for m in methods():  # a transform's bare flag (""): its defaults
            value = getattr(args, "method_" + m.name)
            if value is not None:
                knobs[m.name] = m.parse(value) if m.kind == BACKEND else m.build_knobs(value or True)
        if args.output is None:
            args.output = default_output(args.model, args.checkpoint, args.preset)
    except ValueError as e:
        print(f"infhip-build: error: {e}", file=sys.stderr)
        return 1

    try:
        out = build_engine(
            checkpoint=args.checkpoint, model=args.model, output_dir=args.output, preset=args.preset, dtype=args.dtype, kv_dtype=args.kv_dtype,
            max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size, page_size=args.page_size,
            max_num_batched_tokens=args.max_num_batched_tokens, device=args.device,
            random_weights=args.random_weights, seed=args.seed, force=args.force, progress=not args.quiet,
            knobs=knobs, target=args.target,
            weight_dtype=args.weight_dtype, quantize_lm_head=args.quantize_lm_head, tp=args.tp,
            rope_scaling=args.rope_scaling)
    except BuildError as e:
        print(f"infhip-build: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # unwritable --output, disk full, ...: the environment, not a bug
        print(f"infhip-build: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("infhip-build: interrupted; nothing was written", file=sys.stderr)
        return 130
    report = json.loads((out / "build_report.json").read_text())
    size_mb = report["sizes_bytes"]["total"] / 2**20
    print(f"engine written to {out}: {report['architecture']}, {report['num_parameters']:,} parameters, "
          f"{report['dtype']}{', fp8 weights' if report.get('weight_dtype') == 'fp8' else ''}{', tp ' + str(report['tp']) if report.get('tp', 1) > 1 else ''}, target {report['target']}, {report['kernels']['count']} kernels, "
          f"{size_mb:.1f} MiB in {report['timings_s']['total']:.1f} s")
    for w in report["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
