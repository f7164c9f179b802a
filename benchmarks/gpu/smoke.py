"""The GPU smoke call: the first thing to run whenever a GPU is lent (about 2-3 minutes, nothing
to stage). For each engine configuration below it builds a tiny random Llama engine for this GPU
(every kernel compiled ahead of time), then loads it in a fresh process under ``jit="forbid"``
with an empty, unwritable Triton cache and generates a batch that reaches every path the
configuration has: sparse prefill and decode (prompts past the tiny dense threshold), the
sampling kernels (logprobs 1 and 5, penalties, logit bias) and the captured decode graphs. One
table; the raw rows in ``$OUT/gpu_smoke.json``. Exit status 1 if any row failed.

    python3 -m benchmarks.gpu.smoke                      # on the GPU machine, repo root
    python3 -m benchmarks.gpu.smoke --only dense,3k-flash-fp8
    python3 -m benchmarks.gpu.smoke --device cpu         # dry run of the script itself (interpreted)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path


# An empty Triton cache that cannot be written, even by root: a kernel missing from the engine fails
# the load or the run instead of compiling quietly.
READ_ONLY_CACHE = "/proc/infhip-no-triton-cache"

# Stages small enough for a 64-token context to go sparse (dense below 30 tokens of context).
_TINY = dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0],
             special_final_k=16, dense_threshold=30)
_TINY_5K = dict(_TINY, stages=[(8, 8, 32), (8, 4, 16), (8, 2, 8)])

# name -> build_engine keywords
CASES: dict[str, dict] = {
    "dense": dict(),
    "3k": dict(preset="3k", infinitehip_overrides=_TINY),
    "3k-fast": dict(preset="3k-fast", infinitehip_overrides=_TINY),
    "3k-flash": dict(preset="3k-flash", infinitehip_overrides=_TINY),
    "5k": dict(preset="5k", infinitehip_overrides=_TINY_5K),
    "3k-flash-fp8": dict(preset="3k-flash", infinitehip_overrides=_TINY, kv_dtype="fp8", weight_dtype="fp8"),
    "dense-token-drop": dict(token_drop=dict(min_prompt_len=32, obs_window=8, block_size=8, num_sink=8,
                                             drop_layers=[1, 2])),
}

_GENERATE = textwrap.dedent('''
    import json, sys, time
    from infhip import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(sys.argv[1], jit=sys.argv[2])
    load_s = time.perf_counter() - t0
    prompts = [[(7 * i + 3 * j) % 290 + 3 for j in range(n)] for i, n in enumerate((90, 41, 300, 5))]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    features = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True, logprobs=5,
                              repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={5: 2.0})
    top1 = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[greedy, features, top1, greedy])
    gen_s = time.perf_counter() - t0
    bad = [o.finish_reason for o in outs if len(o.token_ids) != 12]
    assert not bad, f"short or failed outputs: {bad}"
    assert all(len(o.logprobs) == 12 for o in outs[1:3]), "logprobs missing"
    report = (llm.debug_view()["graphs"] or {}).get("report")  # None on the CPU (no graphs)
    if sys.argv[2] == "forbid":
        assert report["on_request"] == 0, f"decode graphs captured on request: {report}"
    print("RESULT " + json.dumps(dict(load_s=round(load_s, 2), generate_s=round(gen_s, 3),
                                      graphs=report, first_tokens=outs[0].token_ids[:6])))
''')


def _run_case(name: str, kw: dict, device: str, work: Path) -> dict:
    from infhip.builder.build import build_engine
    from infhip.builder.tiny_checkpoint import write_tiny_hf_checkpoint

    row = dict(case=name, build_s=None, kernels=None, load_s=None, generate_s=None, ok=False, error="")
    hf = work / "hf"
    if not hf.exists():
        write_tiny_hf_checkpoint(hf, "llama")
    try:
        t0 = time.perf_counter()
        engine = build_engine(checkpoint=hf, output_dir=work / name, dtype="bfloat16", device=device,
                              max_seq_len=512, max_batch_size=4, progress=False, force=True, **kw)
        row["build_s"] = round(time.perf_counter() - t0, 1)
        report = json.loads((engine / "build_report.json").read_text())
        row["kernels"] = (report.get("kernels") or {}).get("count")
    except Exception as e:  # the build's own message names the kernel and the Triton version
        row["error"] = f"build: {type(e).__name__}: {str(e)[-600:]}"
        return row
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    jit = "forbid"
    if device == "cuda":
        env["TRITON_CACHE_DIR"] = READ_ONLY_CACHE
    else:
        # interpreted Triton, unless the caller asked for the plugins' torch references ("0": faster)
        env["TRITON_INTERPRET"], jit = os.environ.get("TRITON_INTERPRET", "1"), "allow"
    proc = subprocess.run([sys.executable, "-c", _GENERATE, str(engine), jit], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        row["error"] = "generate: " + (proc.stderr.strip().splitlines() or ["(no output)"])[-1][-600:]
        return row
    row.update(json.loads(lines[-1][len("RESULT "):]), ok=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", dest="device", action="store_const", const="cpu",
                    help="--device cpu (the benchmarks' tiny CPU mode: benchmarks/speed/tiny.py)")
    ap.add_argument("--only", default="", help=f"comma-separated cases (default all: {', '.join(CASES)})")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/infhip-out"))
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; the cases are: {', '.join(CASES)}")

    import torch
    import triton
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device visible: run on the GPU machine, or --device cpu for a dry run")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"# {gpu}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="infhip-smoke-") as tmp:
        for name in names:
            rows.append(_run_case(name, CASES[name], args.device, Path(tmp)))
            r = rows[-1]
            print(f"{r['case']:<18} {'ok' if r['ok'] else 'FAIL':<5} build {r['build_s']!s:>6} s  kernels "
                  f"{r['kernels']!s:>4}  load {r['load_s']!s:>6} s  generate {r['generate_s']!s:>7} s  "
                  f"{r['error']}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, date=time.strftime("%Y-%m-%d"))
    (Path(args.out) / "gpu_smoke.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    failed = [r["case"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
