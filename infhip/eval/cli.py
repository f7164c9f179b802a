"""`infhip-eval`: quality of engines on real models and real text.

    infhip-eval passkey --engine engines/smollm2-135m --lengths 1k,2k,4k --depths 0.1,0.5,0.9 \
        --samples 5 --json results/passkey.json --plot results/passkey.png
    infhip-eval niah    --engine E --lengths 4k --variants single,multikey,multivalue,multiquery --haystack kjv
    infhip-eval ppl     --engine E --lengths 1k,2k,4k --chunk 256 --samples 4 --haystack pg
    infhip-eval ruler   --engine E --tasks niah_single_1,niah_multikey_1,vt,cwe,fwe,qa_1 --lengths 8k,16k --samples 4
    infhip-eval agree   --engine SPARSE --reference DENSE --lengths 8k --chunk 128
    infhip-eval recall  --engine SPARSE --lengths 8k

Prints a markdown table; --json writes every record, --markdown the table, --plot a PNG.
Exit status: 0 done, 2 bad input or a missing data package (message on stderr), 3 the task does not apply to the engine
(e.g. recall on an engine whose plan has no sparse layers).
"""

from __future__ import annotations

import argparse
import sys

from infhip.eval.common import EvalError, parse_floats, parse_lengths
from infhip.eval.text import SOURCES, TextUnavailable

TASKS = ("passkey", "niah", "ppl", "agree", "recall", "ruler")
EXIT_BAD_INPUT, EXIT_NOT_APPLICABLE = 2, 3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infhip-eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("task", choices=TASKS)
    p.add_argument("--engine", action="append", required=True, help="engine directory (repeat to compare engines)")
    p.add_argument("--reference", help="agree: the reference engine (usually the dense one)")
    p.add_argument("--lengths", default="1k,2k,4k", help="token lengths, e.g. 1k,2k,4k,16k (k = 1024)")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="passkey/niah: needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=None,
                   help="samples per (length, depth) (passkey/niah 1, ppl/agree 4, recall 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--haystack", choices=SOURCES, default=None,
                   help="passkey: noise (default); niah: kjv (default); ppl and recall: the text, kjv (default); "
                        "pg = Paul Graham's essays as RULER ships them")
    p.add_argument("--tasks", default=None, help="ruler: comma-separated RULER tasks (default: all 13)")
    p.add_argument("--template", choices=("base", "chat"), default="base",
                   help="ruler: the prompt raw (base, RULER's default) or in the tokenizer's chat template")
    p.add_argument("--variants", default="single,multikey,multivalue,multiquery", help="niah variants")
    p.add_argument("--chunk", type=int, default=None,
                   help="ppl/agree: scored tail tokens (ppl 256, agree 128); recall: measured queries (64)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: the engine's target)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step, i.e. the prefill chunk (default: the engine's); "
                        "smaller values make long prompts prefill in several chunks")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache size (default: 90%% of free GPU memory, 2 GiB on CPU)")
    p.add_argument("--infinitehip", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                   help="runtime InfiniteHiP knobs for every engine of the run, e.g. "
                        "chunk_score=head_normalized,dense_threshold=4096 (builder/presets.RUNTIME_KNOBS)")
    p.add_argument("--token-drop", default=None, metavar="off|on|KEY=VALUE[,KEY=VALUE]",
                   help="UniPrefill for every engine of the run: off, on (the engine's knobs, or the "
                        "defaults), or knobs laid over them, e.g. p=0.98,spare=1 (keys p, n, G, A, "
                        "min_len, rho, spare)")
    p.add_argument("--json", help="write all records to this JSON file")
    p.add_argument("--markdown", help="write the summary table to this file")
    p.add_argument("--plot", help="write a PNG plot (accuracy/ppl vs length, or recall per layer)")
    return p


def run(args: argparse.Namespace):
    """Dispatch to the task's Python API; returns its EvalResult."""
    lengths = parse_lengths(args.lengths)
    if args.samples is not None and args.samples < 1:
        raise EvalError(f"--samples must be >= 1, got {args.samples}")
    if args.chunk is not None and args.chunk < 1:
        raise EvalError(f"--chunk must be >= 1, got {args.chunk}")
    if args.task == "passkey":
        from infhip.eval.passkey import PasskeyConfig, run_passkey
        cfg = PasskeyConfig(lengths, parse_floats(args.depths, "depths", 0, 1), args.samples or 1, args.seed,
                            args.haystack or "noise")
        return run_passkey(args.engine, cfg, args.device, log=_log, **_llm_kwargs(args))
    if args.task == "niah":
        from infhip.eval.niah import NiahConfig, run_niah
        cfg = NiahConfig(lengths, [v.strip() for v in args.variants.split(",") if v.strip()],
                         parse_floats(args.depths, "depths", 0, 1), args.samples or 1, args.seed,
                         args.haystack or "kjv")
        return run_niah(args.engine, cfg, args.device, log=_log, **_llm_kwargs(args))
    if args.task == "ppl":
        from infhip.eval.ppl import PplConfig, run_ppl
        return run_ppl(args.engine, PplConfig(lengths, args.chunk or 256, args.samples or 4, args.seed,
                                              args.haystack or "kjv"), args.device, log=_log, **_llm_kwargs(args))
    if args.task == "agree":
        from infhip.eval.agree import AgreeConfig, run_agree
        if not args.reference:
            raise EvalError("agree needs --reference DIR (the engine to compare against, usually the dense one)")
        cfg = AgreeConfig(lengths, args.chunk or 128, args.samples or 4, args.seed)
        return run_agree(args.engine, args.reference, cfg, args.device, log=_log, **_llm_kwargs(args))
    if args.task == "ruler":
        from infhip.eval.ruler import TASKS as RULER_TASKS, RulerConfig, run_ruler
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else list(RULER_TASKS)
        cfg = RulerConfig(lengths, tasks, args.samples or 1, args.seed, args.template)
        return run_ruler(args.engine, cfg, args.device, log=_log, **_llm_kwargs(args))
    from infhip.eval.recall import RecallConfig, run_recall
    return run_recall(args.engine, RecallConfig(lengths, args.chunk or 64, args.samples or 1, args.seed,
                                                args.haystack or "kjv"),
                      args.device, log=_log, **_llm_kwargs(args))


def _llm_kwargs(args: argparse.Namespace) -> dict:
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise EvalError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise EvalError(f"--kv-cache-gib must be positive, got {args.kv_cache_gib}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise EvalError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    gib = None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30))
    return {"max_num_seqs": args.max_num_seqs, "kv_cache_memory_bytes": gib,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "infinitehip_overrides": parse_overrides(args.infinitehip),
            "token_drop": parse_token_drop_arg(args.token_drop)}


def parse_token_drop_arg(spec: str | None) -> bool | dict | None:
    """--token-drop: None (the engine's setting), off -> False, on -> True, else knobs."""
    if spec is None:
        return None
    if spec.strip().lower() in ("off", "on"):
        return spec.strip().lower() == "on"
    from infhip.builder.token_drop_spec import parse_token_drop_knobs
    try:
        return parse_token_drop_knobs(spec)
    except ValueError as e:
        raise EvalError(str(e)) from None


def parse_overrides(spec: str | None) -> dict | None:
    """'a=1,b=x,c=[32,16,8]' -> {'a': 1, 'b': 'x', 'c': [32, 16, 8]} (builder/presets.parse_knobs)."""
    if not spec:
        return None
    from infhip.builder.presets import parse_knobs
    try:
        return parse_knobs(spec)
    except ValueError as e:
        raise EvalError(f"--infinitehip: {e}") from None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from infhip.eval.recall import NoSparseLayers
    try:
        result = run(args)
    except NoSparseLayers as e:
        print(f"infhip-eval: {e}", file=sys.stderr)
        return EXIT_NOT_APPLICABLE
    except (EvalError, ValueError, FileNotFoundError, TextUnavailable) as e:
        print(f"infhip-eval: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    table = result.markdown()
    print(table)
    if args.json:
        result.save(args.json)
    if args.markdown:
        from pathlib import Path
        Path(args.markdown).write_text(table + "\n")
    if args.plot:
        from infhip.eval.plot import plot_result
        plot_result(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
