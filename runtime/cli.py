"""`infhip-run`: generate from the command line, streaming the completion to stdout.

    infhip-run --engine engines/smollm2-135m --prompt "The capital of France is" --max-tokens 16
    infhip-run --engine engines/smollm2-135m --prompt-file long.txt --max-tokens 32 --temperature 0
    infhip-run --engine engines/l8b-3k --prompt-file long.txt --kv-offload-bytes 64GiB --token-drop off

The load options (--max-num-seqs, --kv-cache-memory-bytes, --infinitehip-overrides, ...) are
LLM's (runtime/options.py LoadOptions), with the same names.

SIGTERM / SIGINT while generating: the completion goes on for up to --drain-timeout seconds,
then stops (finish_reason "abort", its KV pages freed); a second signal stops it after the
current step. Either way what was generated is printed, and the exit status is 0.
"""

from __future__ import annotations

import argparse
import signal
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
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds the generation may go on before it stops (default 30)")
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
        prompt_ids = None
        if args.chat:  # as LLM.chat and the chat endpoint render it (the template writes the special tokens)
            from infhip.runtime.chat_template import render_chat
            prompt, prompt_ids = render_chat(llm.tokenizer, [{"role": "user", "content": prompt}])
        if args.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
        start, num_tokens, reason = time.perf_counter(), 0, None
        with _Drain(args.drain_timeout) as drain:
            for delta in _stream(llm, prompt, params, drain, prompt_ids):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                num_tokens += len(delta.token_ids)
                reason = delta.finish_reason
        sys.stdout.write("\n")
        sys.stdout.flush()
        if drain.signal is not None:
            print(f"[infhip-run] {drain.signal}: stopped after {num_tokens} tokens, finish_reason={reason}",
                  file=sys.stderr)
        if args.stats:
            dt = time.perf_counter() - start
            print(f"[infhip-run] {num_tokens} tokens in {dt:.2f} s, finish_reason={reason}", file=sys.stderr)
    except (ValueError, EngineFormatError, MemoryError) as e:
        print(f"infhip-run: error: {e}", file=sys.stderr)
        return 2
    return 0


class _Drain:
    """SIGINT/SIGTERM handlers while generating: the first sets a stop time drain_timeout_s
    ahead, a second one makes it now. The handlers only record; the generation loop looks."""

    def __init__(self, drain_timeout_s: float):
        self.timeout_s = drain_timeout_s
        self.stop_at: float | None = None
        self.signal: str | None = None  # the name of the first signal received
        self._previous: dict = {}

    def __enter__(self) -> "_Drain":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            self.stop_at = now + self.timeout_s
        else:
            self.stop_at = now

    @property
    def due(self) -> bool:
        return self.stop_at is not None and time.monotonic() >= self.stop_at


def _stream(llm, prompt: str, params, drain: _Drain, prompt_ids: list[int] | None = None):
    """The request's deltas through the engine thread (`EngineLoop`, as infhip-serve's), ended
    with a last "abort" delta once the drain is due (looked at every 50 ms)."""
    from infhip.runtime.engine_loop import EngineLoop

    loop = EngineLoop(llm).start()
    ended = False
    try:
        for delta in loop.stream(loop.submit(prompt, prompt_ids, params), wait_s=0.05):
            if delta is not None:
                yield delta
            if drain.due and not ended:
                loop.end_all()  # finish_reason "abort"; pages freed
                ended = True
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
