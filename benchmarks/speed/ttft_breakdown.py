"""Where a long prompt's time to first token goes, per 32K prefill chunk: `3k-flash`, fp8 KV,
Llama-3.1-8B shapes, random weights, bf16 and fp8 weights.

    python3 -m benchmarks.speed.ttft_breakdown --out $OUT                        # H200: 1,040,000 tokens
    python3 -m benchmarks.speed.ttft_breakdown --out $OUT --prompt-lens 131072 --weights bf16
    python -m benchmarks.speed.ttft_breakdown --cpu --out /tmp/ttft               # here: a tiny engine

Each weight dtype runs in a fresh process: build (AOT kernels), `LLM(max_num_seqs=1,
prefix_caching=False)`, then per prompt length a plain TTFT (`generate(max_tokens=1)`, nothing
instrumented: today's figure) and an instrumented one on other random ids. Instrumented, every
engine step (one prefill chunk; the last also samples the first token) is cut into:

  linear        qkv / o / gate_up / down / lm_head modules (forward hooks)
  norm, act     RMSNorm modules; gated activation = the MLP module less its two linears
  kv_write      RoPE + paged K/V write (DenseBackend.rope_and_write)
  dense_attn    dense prefill attention (chunks below dense_threshold: the trained window)
  unrotate      raw keys for dynamic RoPE (unrotate_keys)
  stage1..3     InfiniteHiP pruning stages (pruning_stage, in call order per layer)
  sparse_attn   block-sparse prefill attention (sparse_prefill_attention)
  attn_other    the attention module less all of the above inside it
  offload       page moves to host + waits on staged host pages (0 when the KV is resident)
  gpu_other     the step's GPU span (events at runner.execute's ends) less all of the above:
                embedding, final norm, sampling, and gaps where the GPU waited for the host
  host          the step's wall time less its GPU span (scheduling, planning, the token's sync)
  (outside)     generate() before the first step and after the last: one figure per prompt

CUDA events around each call (wrapping the runtime's functions and modules in this process
only; nothing in runtime/ or plugins/ changes), read once per step after a synchronize. The
instrumented TTFT is printed beside the plain one: their difference is the cost of measuring.
--cpu runs the same code on a tiny 4-layer engine (interpreted Triton, perf_counter instead of
events) whose prompt passes its 128-token trained window, so every category above is exercised.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

CATEGORIES = ["linear", "norm", "act", "kv_write", "dense_attn", "unrotate", "stage1", "stage2", "stage3",
              "sparse_attn", "attn_other", "offload", "gpu_other", "host"]
ATTN_PARTS = ["kv_write", "dense_attn", "unrotate", "stage1", "stage2", "stage3", "sparse_attn"]
TINY_CONFIG = {  # a Llama small enough for the interpreter, with a 128-token trained window
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 300, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
TINY_IH = dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0],
               special_final_k=16, dense_threshold=30)


class Clock:
    """CUDA events on a GPU (read after a synchronize), perf_counter on the CPU (synchronous)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class Breakdown:
    """Spans of named calls per engine step; `rows` holds one dict of milliseconds per step."""

    def __init__(self, clock: Clock):
        self.clock, self.spans, self.rows = clock, [], []
        self.stage_index = 0  # pruning stages seen in the current layer's prefill

    @contextmanager
    def span(self, name: str):
        start = self.clock.mark()
        try:
            yield
        finally:
            self.spans.append((name, start, self.clock.mark()))

    def wrap(self, fn, name):
        """fn, timed as `name` (a str, or a callable of the call's arguments returning one)."""
        def wrapped(*args, **kwargs):
            with self.span(name if isinstance(name, str) else name(*args, **kwargs)):
                return fn(*args, **kwargs)
        return wrapped

    def hook(self, module: torch.nn.Module, name: str) -> list:
        stack = []
        return [module.register_forward_pre_hook(lambda m, a: stack.append(self.clock.mark())),
                module.register_forward_hook(lambda m, a, o: self.spans.append((name, stack.pop(), self.clock.mark())))]

    def end_step(self, wall_ms: float, chunk_end: int, chunk_tokens: int) -> None:
        """Close one engine step: sum its spans by name, derive the exclusive categories."""
        if self.clock.cuda:
            torch.cuda.synchronize()
        t = defaultdict(float)
        for name, a, b in self.spans:
            t[name] += self.clock.ms(a, b)
        self.spans = []
        row = {"chunk_end": chunk_end, "chunk_tokens": chunk_tokens, "wall_ms": wall_ms,
               "linear": sum(v for k, v in t.items() if k.startswith("linear.")), "norm": t["norm"],
               "act": t["mlp"] - t["linear.gate_up"] - t["linear.down"],
               "offload": t["offload.move_pages"] + t["offload.staged_wait"]}
        row.update({k: t[k] for k in ATTN_PARTS})
        row["attn_other"] = t["attn"] - t["linear.qkv"] - t["linear.o"] - sum(t[k] for k in ATTN_PARTS)
        span = t["execute"]
        row["gpu_other"] = span - sum(row[k] for k in CATEGORIES[:-2])
        row["host"] = wall_ms - span
        row["linear_by_module"] = {k[7:]: v for k, v in t.items() if k.startswith("linear.")}
        self.rows.append(row)


def instrument(llm, bd: Breakdown):
    """Wrap the runtime's calls in this process (module globals, the DENSE instance, a class
    method, hooks, the engine core's step and the runner). Returns a function that undoes all of it."""
    import infhip.methods.infinitehip.runtime.layer as ih
    from infhip.runtime.attention.dense import DENSE
    from infhip.runtime.models.common import Attention, GatedMLP, RMSNorm
    from infhip.runtime.offload.staging import StagedStep

    handles, saved = [], []

    def patch(obj, attr, new):
        had = attr in vars(obj)  # an instance attribute (or a class's own) to put back; else delete
        saved.append((obj, attr, vars(obj).get(attr), had))
        setattr(obj, attr, new)

    for name, m in llm.engine.model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
            handles += bd.hook(m, "linear." + leaf.removesuffix("_proj"))
        elif isinstance(m, RMSNorm):
            handles += bd.hook(m, "norm")
        elif isinstance(m, Attention):
            handles += bd.hook(m, "attn")
        elif isinstance(m, GatedMLP):
            handles += bd.hook(m, "mlp")
    patch(DENSE, "rope_and_write", bd.wrap(DENSE.rope_and_write, "kv_write"))
    patch(DENSE, "prefill_run", bd.wrap(DENSE.prefill_run, "dense_attn"))
    patch(ih, "unrotate_keys", bd.wrap(ih.unrotate_keys, "unrotate"))
    patch(ih, "sparse_prefill_attention", bd.wrap(ih.sparse_prefill_attention, "sparse_attn"))

    def stage_name(*a, **k):
        bd.stage_index += 1
        return f"stage{bd.stage_index}"
    patch(ih, "pruning_stage", bd.wrap(ih.pruning_stage, stage_name))
    prefill = ih.InfiniteHipLayer._prefill

    def layer_prefill(self, *a, **k):
        bd.stage_index = 0
        return prefill(self, *a, **k)
    patch(ih.InfiniteHipLayer, "_prefill", layer_prefill)
    patch(StagedStep, "acquire", bd.wrap(StagedStep.acquire, "offload.staged_wait"))
    runner = llm.runner
    patch(runner, "move_pages", bd.wrap(runner.move_pages, "offload.move_pages"))
    execute = runner.execute

    def timed_execute(out, **kw):
        t0 = time.perf_counter()
        with bd.span("execute"):
            logits = execute(out, **kw)
        ch = out.chunks[-1]
        bd.end_step((time.perf_counter() - t0) * 1e3, ch.start + ch.num_tokens, out.num_tokens)
        return logits
    patch(runner, "execute", timed_execute)
    step = llm.core.step

    def timed_step():  # host time outside execute: the scheduler, the sampler, the token's commit
        t0 = time.perf_counter()
        n = len(bd.rows)
        got = step()
        if len(bd.rows) > n:
            wall = (time.perf_counter() - t0) * 1e3
            bd.rows[-1]["host"] += wall - bd.rows[-1]["wall_ms"]
            bd.rows[-1]["wall_ms"] = wall
        return got
    patch(llm.core, "step", timed_step)

    def restore() -> None:
        for h in handles:
            h.remove()
        for obj, attr, old, had in reversed(saved):
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)
    return restore


def ttft(llm, n: int, seed: int) -> float:
    from infhip import SamplingParams
    vocab = llm.engine.config.model.vocab_size
    ids = torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, temperature=0.0,
                                                                        ignore_eos=True))
    return time.perf_counter() - t


def child(engine: str, lens: list[int], plain: bool) -> dict:
    """One fresh process: load, then per length a plain TTFT and an instrumented one."""
    from infhip import LLM
    cuda = torch.cuda.is_available()
    llm = LLM(engine, max_num_seqs=1, prefix_caching=False)
    res = {"load": llm.load_report, "runs": {}}
    if plain:
        if cuda:  # warm-up: allocator, first launches (a first 1.04M request is as fast as a second: benchmarks.md)
            ttft(llm, min(8192, *lens), seed=99)
        for n in lens:
            res["runs"][str(n)] = {"ttft_plain_s": round(ttft(llm, n, seed=n), 3)}
    bd = Breakdown(Clock(cuda))
    instrument(llm, bd)  # this process ends after: nothing to undo
    for n in lens:
        bd.rows = []
        run = res["runs"].setdefault(str(n), {})
        run["ttft_instrumented_s"] = round(ttft(llm, n, seed=n + 1), 3)
        run["steps"] = bd.rows
        run["totals_s"] = {c: round(sum(r[c] for r in bd.rows) / 1e3, 3) for c in CATEGORIES}
        # generate() before the first step (the request, its 1M ids) and after the last one
        run["outside_steps_s"] = round(run["ttft_instrumented_s"] - sum(r["wall_ms"] for r in bd.rows) / 1e3, 3)
    return res


def build(work: Path, weights: str, max_seq_len: int, cpu: bool, cpu_chunk: int = 64) -> Path:
    """The `3k-flash` fp8-KV engine (Llama-3.1-8B shapes, random weights); with cpu, the tiny one
    in float32 with chunks of cpu_chunk tokens and TINY_IH's stages."""
    from infhip.builder.build import build_engine
    from infhip.builder.registry import bundled_config
    cfg = work / ("tiny.json" if cpu else "llama-3.1-8b.json")
    cfg.write_text(json.dumps(TINY_CONFIG) if cpu else bundled_config("llama-3.1-8b").read_text())
    out = work / f"3k-flash-fp8kv-{weights}"
    kw = (dict(dtype="float32", device="cpu", max_num_batched_tokens=cpu_chunk, infinitehip_overrides=TINY_IH)
          if cpu else dict(dtype="bfloat16", device="cuda"))
    build_engine(checkpoint=cfg, output_dir=out, preset="3k-flash", kv_dtype="fp8", weight_dtype=weights,
                 max_seq_len=max_seq_len, max_batch_size=1, random_weights=True, force=True, progress=False, **kw)
    return out


def table(name: str, n: int, run: dict, every: int) -> str:
    rows = run["steps"]
    head = f"{'chunk':>5} {'ctx end':>9} {'wall':>8} " + " ".join(f"{c:>10}" for c in CATEGORIES)
    lines = [f"\n{name}, {n} tokens: TTFT plain {run.get('ttft_plain_s', '-')} s, instrumented "
             f"{run['ttft_instrumented_s']} s ({run['outside_steps_s']} s of it outside the engine steps); "
             "per step (ms):", head]
    for i, r in enumerate(rows):
        if i % every == 0 or i == len(rows) - 1:
            lines.append(f"{i:>5} {r['chunk_end']:>9} {r['wall_ms']:>8.1f} "
                         + " ".join(f"{r[c]:>10.1f}" for c in CATEGORIES))
    tot = run["totals_s"]
    wall = sum(r["wall_ms"] for r in rows) / 1e3
    lines.append(f"{'all':>5} {'':>9} {wall * 1e3:>8.0f} " + " ".join(f"{tot[c] * 1e3:>10.0f}" for c in CATEGORIES))
    lines.append(f"{'%':>5} {'':>9} {'':>8} " + " ".join(f"{100 * tot[c] / wall:>10.1f}" for c in CATEGORIES))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/ttft-breakdown"))
    ap.add_argument("--weights", default="bf16,fp8", help="weight dtypes, one engine each")
    ap.add_argument("--prompt-lens", default=None, help="default 1040000 (GPU), 200 (--cpu)")
    ap.add_argument("--no-plain", action="store_true", help="skip the uninstrumented TTFT (saves one prefill)")
    ap.add_argument("--cpu", "--smoke", action="store_true", help="a tiny engine on the CPU (the code path, not speed)")
    ap.add_argument("--interpret", action="store_true",
                    help="--cpu with TRITON_INTERPRET=1: the Triton launchers, interpreted (minutes), "
                         "instead of the plugins' torch references")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    lens = [int(x) for x in (args.prompt_lens or ("200" if args.cpu else "1040000")).split(",")]
    if args.interpret:  # the Triton launchers through the interpreter (before infhip imports triton)
        os.environ["TRITON_INTERPRET"] = "1"
    if args.child:
        print(json.dumps(child(args.child, lens, not args.no_plain)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "prompt_lens": lens, "configs": {}}
    for weights in args.weights.split(","):
        t = time.perf_counter()
        engine = build(args.work, weights, max(lens) + 256, args.cpu)
        build_s = round(time.perf_counter() - t, 1)
        cmd = [sys.executable, __file__, "--child", str(engine), "--out", str(args.out),
               "--prompt-lens", ",".join(map(str, lens))] + (["--no-plain"] if args.no_plain else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            res["configs"][weights] = {"build_s": build_s, "error": proc.stderr[-3000:]}
            print(f"{weights}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        res["configs"][weights] = {"build_s": build_s, **json.loads(proc.stdout.strip().splitlines()[-1])}
        (args.out / "ttft_breakdown.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"{res['gpu']}, torch {res['torch']}; 3k-flash, fp8 KV, Llama-3.1-8B shapes"
          + (" (tiny CPU engine: the code path, not speed)" if args.cpu else ""))
    for weights, r in res["configs"].items():
        for n, run in r.get("runs", {}).items():
            print(table(f"{weights} weights", int(n), run, every=1 if args.cpu else 4))
    return 1 if any("error" in r for r in res["configs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
