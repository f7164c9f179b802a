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
import dataclasses
import sys

from infhip.eval.common import EvalError, parse_floats, parse_lengths
from infhip.eval.text import SOURCES, TextUnavailable
from infhip.runtime.options import add_load_options

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
    p.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="ruler: generate at most N tokens per prompt (default: RULER's budget per task, 128 for "
                        "NIAH); a quick check, since an answer longer than N is cut")
    p.add_argument("--variants", default="single,multikey,multivalue,multiquery", help="niah variants")
    p.add_argument("--chunk", type=int, default=None,
                   help="ppl/agree: scored tail tokens (ppl 256, agree 128); recall: measured queries (64)")
    p.add_argument("--retention", type=float, default=None, metavar="RHO",
                   help="benchmarks: token drop keeps this share of the blocks at every anchor instead of "
                        "top-p (needs token drop: --token-drop on or an engine built with it)")
    add_load_options(p)  # LLM's options, the names of infhip-run / infhip-serve (runtime/options.py)
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
        cfg = RulerConfig(lengths, tasks, args.samples or 1, args.seed, args.template, args.max_new_tokens)
        return run_ruler(args.engine, cfg, args.device, log=_log, **_llm_kwargs(args))
    from infhip.eval.recall import RecallConfig, run_recall
    return run_recall(args.engine, RecallConfig(lengths, args.chunk or 64, args.samples or 1, args.seed,
                                                args.haystack or "kjv"),
                      args.device, log=_log, **_llm_kwargs(args))


def _llm_kwargs(args: argparse.Namespace) -> dict:
    """LLM's keywords of the load flags (the device goes separately), and --retention."""
    from infhip.runtime.options import load_options
    try:
        opts = load_options(args)
    except ValueError as e:
        raise EvalError(str(e)) from None
    kwargs = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts) if f.name != "device"}
    return dict(kwargs, retention=args.retention)


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
