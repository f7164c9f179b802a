"""`infhip-run`: generate from the command line, streaming the completion to stdout.

    infhip-run --engine engines/smollm2-135m --prompt "The capital of France is" --max-tokens 16
    infhip-run --engine engines/smollm2-135m --prompt-file long.txt --max-tokens 32 --temperature 0
    infhip-run --engine engines/l8b-3k --prompt-file long.txt --kv-offload-bytes 64GiB --token-drop off

The load options (--max-num-seqs, --kv-cache-memory-bytes, --infinitehip-overrides, ...) are
LLM's (runtime/options.py LoadOptions), with the same names.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from infhip.runtime.options import add_load_options, load_options


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infhip-run", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="engine directory written by infhip-build")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", type=Path, help="file holding the prompt text")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--stats", action="store_true", help="print timing to stderr at the end")
    add_load_options(p)  # LLM's options, same names (runtime/options.py)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from infhip.config import EngineFormatError
    from infhip.runtime.llm import LLM
    from infhip.runtime.sampling_params import SamplingParams

    try:
        if args.prompt_file is not None and not args.prompt_file.is_file():
            raise ValueError(f"--prompt-file {args.prompt_file} does not exist")
        prompt = args.prompt if args.prompt is not None else args.prompt_file.read_text()
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
        llm = LLM(args.engine, load_options(args))
        if args.chat:
            if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
                raise ValueError("--chat needs an engine whose tokenizer has a chat template")
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       tokenize=False, add_generation_prompt=True)
        start, num_tokens, reason = time.perf_counter(), 0, None
        for delta in llm.generate_stream(prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            num_tokens += len(delta.token_ids)
            reason = delta.finish_reason
        sys.stdout.write("\n")
        if args.stats:
            dt = time.perf_counter() - start
            print(f"[infhip-run] {num_tokens} tokens in {dt:.2f} s, finish_reason={reason}", file=sys.stderr)
    except (ValueError, EngineFormatError, MemoryError) as e:
        print(f"infhip-run: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
