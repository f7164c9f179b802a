"""The two engines of bench_vs_vllm.py behind one interface, and the tasks each runs in its own process.

Each task runs as `python3 -m benchmarks.peers.vs_vllm_sides TASK --side infhip|vllm --model PATH ...`
in a fresh process (so one engine holds the GPU at a time, and a cold start is cold) and prints
one JSON line last. `--side infhip` takes an engine directory, `--side vllm` the safetensors
checkpoint the engine was built from: the same weights.

    offline  decode b=1 tok/s (128-token prompt), batch 16 / 64 output tok/s (128 in, 256 out),
             prefill tok/s at each --prefill-lens (fresh prompts: no prefix-cache hit), TTFT of
             the longest
    memory   KV capacity in tokens at the default memory use, and decode tok/s at --contexts
             (prefill once, then two runs over the cached prompt: the difference is decode)
    cold     import + load + first token of a 16-token prompt, from process start
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

T_START = time.time()  # the parent compares this process's start with its own spawn time


class InfhipSide:
    def __init__(self, engine: str, device: str | None, kv_dtype: str | None):
        from infhip import LLM, SamplingParams
        self.SamplingParams = SamplingParams
        self.llm = LLM(engine, device=device)
        self.vocab = self.llm.engine.config.model.vocab_size
        self.load_report = self.llm.load_report

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        sp = self.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        return [len(o.token_ids) for o in outs]

    def kv_capacity_tokens(self) -> int:
        """Pages of the smallest KV group x page size. The runtime sizes the cache to
        min(what memory affords, max_num_seqs x max_seq_len): see kv_capacity_is_lower_bound."""
        s = self.llm.stats()
        page = self.llm.engine.config.build.page_size
        return min(s.kv_pages_used[g] + s.kv_pages_free[g] for g in s.kv_pages_free) * page

    def capacity_capped(self, tokens: int) -> bool:
        return tokens >= self.llm.core.max_num_seqs * self.llm.engine.config.build.max_seq_len

    def info(self) -> dict:
        import torch

        import infhip
        b = self.llm.engine.config.build
        return {"engine": "infhip", "version": infhip.__version__, "torch": torch.__version__,
                "dtype": b.dtype, "kv_dtype": b.kv_dtype, "max_seq_len": b.max_seq_len}


class VllmSide:
    """vLLM's LLM with its defaults (CUDA graphs, torch.compile, prefix caching, chunked prefill)."""

    def __init__(self, checkpoint: str, max_model_len: int, kv_dtype: str | None):
        from vllm import LLM, SamplingParams
        self.SamplingParams = SamplingParams
        kw = {"kv_cache_dtype": "fp8"} if kv_dtype == "fp8" else {}
        t = time.perf_counter()
        self.llm = LLM(model=checkpoint, tokenizer=checkpoint, dtype="bfloat16", max_model_len=max_model_len,
                       seed=0, **kw)
        self.load_report = {"total_s": round(time.perf_counter() - t, 3)}
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()
        self.kv_dtype = kv_dtype

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[int]:
        sp = self.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]

    def kv_capacity_tokens(self) -> int:
        cache = self.llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)

    def capacity_capped(self, tokens: int) -> bool:
        return False  # vLLM sizes its blocks from memory alone

    def info(self) -> dict:
        import torch
        import vllm
        return {"engine": "vllm", "version": vllm.__version__, "torch": torch.__version__, "dtype": "bfloat16",
                "kv_dtype": self.kv_dtype or "auto"}


def make_side(args):
    if args.side == "infhip":
        return InfhipSide(args.model, args.device, args.kv_dtype)
    return VllmSide(args.model, args.max_model_len, args.kv_dtype)


class Prompts:
    """Fresh random token ids for every call (so no prefix-cache hit unless asked for)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.rng, self.vocab = random.Random(seed), vocab

    def __call__(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(10, self.vocab) for _ in range(length)] for _ in range(n)]


def timed(side, prompts, max_tokens: int) -> float:
    t = time.perf_counter()
    got = side.generate(prompts, max_tokens)
    dt = time.perf_counter() - t
    if any(g != max_tokens for g in got):
        raise RuntimeError(f"asked {max_tokens} tokens per request, got {got[:8]}")
    return dt


def offline(side, args) -> dict:
    p = Prompts(side.vocab)
    s = args.scale  # the CPU dry run scales every length down
    res = {}
    timed(side, p(1, 128 // s), 8)  # warm-up
    n1, n2 = 32 // s, 160 // s
    t1, t2 = timed(side, p(1, 128 // s), n1), timed(side, p(1, 128 // s), n2)
    res["decode_b1_tok_s"] = (n2 - n1) / (t2 - t1)
    for b in (16, 64):
        timed(side, p(b, 128 // s), 8)
        res[f"batch{b}_out_tok_s"] = b * (256 // s) / timed(side, p(b, 128 // s), 256 // s)
    for n in args.prefill_lens:
        timed(side, p(1, min(n, 1024)), 1)
        reps = 1 if n > 65536 else 2
        t = min(timed(side, p(1, n), 1) for _ in range(reps))
        res[f"prefill_{n}_tok_s"], res[f"ttft_{n}_s"] = n / t, t
    return res


def memory(side, args) -> dict:
    cap = side.kv_capacity_tokens()
    res = {"kv_capacity_tokens": cap, "kv_capacity_is_lower_bound": side.capacity_capped(cap)}
    p = Prompts(side.vocab, seed=1)
    for n in args.contexts:
        prompt = p(1, n)
        res[f"ctx{n}_ttft_s"] = timed(side, prompt, 1)  # computes and caches the prompt's pages
        n1, n2 = 16 // args.scale, 144 // args.scale
        t1, t2 = timed(side, prompt, n1), timed(side, prompt, n2)
        res[f"ctx{n}_decode_tok_s"] = (n2 - n1) / (t2 - t1)
    return res


def cold(side, args) -> dict:
    prompt = Prompts(side.vocab, seed=2)(1, 16)
    timed(side, prompt, 1)
    return {"first_token_wall": time.time(), "process_start": T_START}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=["offline", "memory", "cold"])
    ap.add_argument("--side", choices=["infhip", "vllm"], required=True)
    ap.add_argument("--model", required=True, help="infhip: engine directory; vllm: the HF checkpoint")
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default=None, help="vllm: its fp8 KV; infhip: as built")
    ap.add_argument("--max-model-len", type=int, default=131072, help="vllm only")
    ap.add_argument("--device", default=None, help="infhip only (cpu for the dry run)")
    ap.add_argument("--prefill-lens", default="8192,32768,131008")
    ap.add_argument("--contexts", default="", help="memory: decode at these prompt lengths")
    ap.add_argument("--scale", type=int, default=1, help="divide decode/batch lengths (CPU dry run)")
    args = ap.parse_args(argv)
    args.prefill_lens = [int(x) for x in args.prefill_lens.split(",") if x]
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    side = make_side(args)
    res = {"info": side.info(), "load": side.load_report}
    res.update({"offline": offline, "memory": memory, "cold": cold}[args.task](side, args))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
