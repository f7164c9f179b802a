"""infhip against vLLM 0.20.0 on one H200: the same safetensors checkpoint, the same workloads, one run.

    bash benchmarks/gpu/stage/vllm.sh --unpack          # first, in the call carrying the last wheel part
    python3 -m benchmarks.peers.bench_vs_vllm --out $OUT --parts offline,serving,cold,memory
    python -m benchmarks.peers.bench_vs_vllm --dry-run --out /tmp/vs   # here, CPU: our side on a tiny engine

1. The checkpoint: Llama-3.1-8B shapes (the shipped config), random bf16 weights (seed 0), saved
   once as safetensors with a word-level tokenizer whose token i is the word `t<i>` (random ids
   decode to text and encode back to the same ids, so `vllm bench serve`'s random prompts have
   the asked length on both servers). infhip builds its dense engine from that directory (and a
   `3k-flash` fp8-KV engine for the memory rows); vLLM loads the directory itself.
2. offline (`LLM.generate`, each engine in its own process, vs_vllm_sides.py): decode b=1, batch
   16 / 64, prefill 8K / 32K / 128K and TTFT at 128K.
3. serving: `vllm bench serve` (the staged client) drives `vllm serve` and then `infhip-serve` on the
   same port: random 1K in / 128 out at concurrency 1, 32, 128; 32K in / 256 out; prefix repetition
   (one shared 30K-token document, many 256-token questions). Request throughput, TTFT, TPOT
   mean / p50 / p99.
4. cold: a fresh process to its first token (vLLM twice: an empty compile cache, then its own).
5. memory: KV capacity (tokens) of each at its default memory use, bf16 and fp8 KV; decode at 130,816
   tokens (128K less the 256 that vLLM's 131072-token window keeps for the output): infhip
   `3k-flash` fp8 KV beside vLLM dense fp8 KV.

Raw JSON under --out (one file per child and per `vllm bench serve` row, and bench_vs_vllm.json);
the table is printed last. --dry-run (CPU): builds a tiny checkpoint and engine, runs our side of
every part (the serving part with a client that sends `vllm bench serve`'s exact request body and
reads the stream as it does), prints every vLLM command it would run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peers.vs_vllm_client import dry_run_serving, free_port, start_server, stop_server

HERE = Path(__file__).resolve().parent
SIDES = HERE / "vs_vllm_sides.py"
NAME = "llama8b"  # the served model name on both servers
PORT = free_port()  # both servers, in turn
LEN_128K = 131008  # 128K less room for the output inside Llama-3.1's 131072 positions
LEN_DECODE = 130816  # memory rows' decode context: + 144 generated tokens stays inside vLLM's 131072
RANDOM_1K = ["--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "128"]
SERVING_ROWS = [  # (row, dataset args, max concurrency, number of prompts)
    ("random_1k_c1", RANDOM_1K, 1, 16),
    ("random_1k_c32", RANDOM_1K, 32, 128),
    ("random_1k_c128", RANDOM_1K, 128, 512),
    ("random_32k_c4", ["--dataset-name", "random", "--random-input-len", "32768", "--random-output-len", "256"], 4, 16),
    ("prefix_rep_30k", ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "30000",
                        "--prefix-repetition-suffix-len", "256", "--prefix-repetition-num-prefixes", "1",
                        "--prefix-repetition-output-len", "128"], 16, 64),
]
METRICS = ["request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms"]


def vllm_cmd(*args: str) -> list[str]:
    return ["python3", "-m", "vllm.entrypoints.cli.main", *args]


# -- the checkpoint and the engines ---------------------------------------------------------------
def write_checkpoint(path: Path, tiny: bool) -> Path:
    """Llama-3.1-8B shapes (or a tiny Llama for the dry run), random bf16, + the t<i> tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from infhip.builder.registry import bundled_config
    cfg = json.loads(bundled_config("llama-3.1-8b").read_text())
    if tiny:
        cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, head_dim=16, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    write_tokenizer(path, cfg["vocab_size"])
    return path


def write_tokenizer(path: Path, vocab: int) -> None:
    """Word-level tokenizer: id i <-> `t<i>`, whitespace-split, no special tokens added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "model_max_length": 1 << 30}))


def build(ckpt: Path, out: Path, tiny: bool, **kw) -> Path:
    from infhip.builder.build import build_engine
    device = "cpu" if tiny else "cuda"
    build_engine(checkpoint=ckpt, output_dir=out, dtype="bfloat16", device=device, progress=False, force=True, **kw)
    return out


# -- children -------------------------------------------------------------------------------------
def run_child(out: Path, tag: str, args: list[str], timeout: float, env: dict | None = None) -> dict:
    """One vs_vllm_sides.py task in a fresh process; its JSON (or an error) also to out/<tag>.json."""
    cmd = [sys.executable, str(SIDES), *args]
    print(f"[bench_vs_vllm] {tag}: {' '.join(cmd[1:])}", flush=True)
    spawned = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        lines = [x for x in stdout.splitlines() if x.startswith("{")]
        res = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"error": stderr[-3000:]}
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: vLLM's engine-core child goes too
        proc.wait()
        res = {"error": f"timed out after {timeout:.0f} s"}
    if "first_token_wall" in res:
        res["spawn_to_first_token_s"] = round(res["first_token_wall"] - spawned, 3)
    res["wall_s"] = round(time.time() - spawned, 1)
    (out / f"{tag}.json").write_text(json.dumps(res, indent=1) + "\n")
    if "error" in res:
        print(f"[bench_vs_vllm] {tag} failed: {res['error'][-800:]}", flush=True)
    return res


# -- serving --------------------------------------------------------------------------------------
def bench_serve_cmd(ckpt: Path, out: Path, server: str, row: str, dataset: list[str], conc: int,
                    n: int) -> list[str]:
    return vllm_cmd("bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{PORT}",
                    "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", str(ckpt), *dataset,
                    "--max-concurrency", str(conc), "--num-prompts", str(n), "--ignore-eos", "--temperature", "0",
                    "--seed", "0",
                    "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles",
                    "50,99", "--disable-tqdm", "--save-result", "--result-dir", str(out),
                    "--result-filename", f"serve_{server}_{row}.json")


def server_cmds(ckpt: Path, engine: Path) -> dict[str, list[str]]:
    return {"vllm": vllm_cmd("serve", str(ckpt), "--served-model-name", NAME, "--port", str(PORT),
                             "--dtype", "bfloat16", "--seed", "0"),
            "infhip": [sys.executable, "-m", "infhip.runtime.server", "--engine", str(engine),
                       "--served-model-name", NAME, "--port", str(PORT), "--backlog", "4096",
                       "--max-waiting-requests", "100000", "--max-waiting-tokens", str(1 << 40)]}  # no 429: vLLM has none


def serving(ckpt: Path, engine: Path, out: Path, rows: list) -> dict:
    res = {}
    for server, cmd in server_cmds(ckpt, engine).items():
        t = time.time()
        proc = start_server(cmd, PORT, out / f"server_{server}.log", ready_s=600)
        res[f"{server}_ready_s"] = round(time.time() - t, 1)
        try:
            for row, dataset, conc, n in rows:
                r = subprocess.run(bench_serve_cmd(ckpt, out, server, row, dataset, conc, n), capture_output=True,
                                   text=True)
                (out / f"serve_{server}_{row}.log").write_text(r.stdout + r.stderr)
                f = out / f"serve_{server}_{row}.json"
                res[f"{server}/{row}"] = ({k: json.loads(f.read_text()).get(k) for k in METRICS} if f.is_file()
                                          else {"error": (r.stdout + r.stderr)[-1500:]})
                print(f"[bench_vs_vllm] serve {server} {row}: {res[f'{server}/{row}']}", flush=True)
        finally:
            stop_server(proc)
    return res


# -- the table ------------------------------------------------------------------------------------
def ratio(a, b, lower_is_better=False):
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or not a or not b:
        return "-"
    return f"{(b / a if lower_is_better else a / b):.2f}"


def table(res: dict) -> str:
    lines = [f"| row | infhip | vLLM | infhip / vLLM (higher = infhip better) |", "|---|---:|---:|---:|"]

    def row(name, a, b, lower=False, fmt="{:.1f}"):
        show = [fmt.format(x) if isinstance(x, (int, float)) else "-" for x in (a, b)]
        lines.append(f"| {name} | {show[0]} | {show[1]} | {ratio(a, b, lower)} |")
    o_i, o_v = res.get("offline", {}).get("infhip", {}), res.get("offline", {}).get("vllm", {})
    for k in [k for k in o_i if k.endswith("tok_s")]:
        row(f"offline {k}", o_i.get(k), o_v.get(k))
    for k in [k for k in o_i if k.startswith("ttft_")]:
        row(f"offline {k}", o_i.get(k), o_v.get(k), lower=True, fmt="{:.3f}")
    s = res.get("serving", {})
    for r in dict.fromkeys(k.split("/", 1)[1] for k in s if "/" in k):  # rows in run order
        a, b = s.get(f"infhip/{r}", {}), s.get(f"vllm/{r}", {})
        for m in [m for m in METRICS if m in a or m in b]:
            row(f"serve {r} {m}", a.get(m), b.get(m), lower=m.endswith("_ms"), fmt="{:.2f}")
    c = res.get("cold", {})
    row("cold: process start to first token (s)", c.get("infhip", {}).get("spawn_to_first_token_s"),
        c.get("vllm_second", {}).get("spawn_to_first_token_s"), lower=True, fmt="{:.2f}")
    row("  vLLM with an empty compile cache (s)", c.get("infhip", {}).get("spawn_to_first_token_s"),
        c.get("vllm_first", {}).get("spawn_to_first_token_s"), lower=True, fmt="{:.2f}")
    m = res.get("memory", {})
    for kv in ("bf16", "fp8"):
        row(f"KV capacity, dense, {kv} KV (tokens)", m.get(f"infhip_dense_{kv}", {}).get("kv_capacity_tokens"),
            m.get(f"vllm_{kv}", {}).get("kv_capacity_tokens"), fmt="{:.0f}")
    row("KV capacity, infhip 3k-flash fp8 vs vLLM dense fp8 (tokens)",
        m.get("infhip_3k-flash_fp8", {}).get("kv_capacity_tokens"), m.get("vllm_fp8", {}).get("kv_capacity_tokens"),
        fmt="{:.0f}")
    sp, vf = m.get("infhip_3k-flash_fp8", {}), m.get("vllm_fp8", {})
    for key in [k for k in sp if k.endswith("_decode_tok_s")]:
        row(f"decode at {key[3:-13]} tokens: 3k-flash fp8 vs vLLM dense fp8 (tok/s)", sp.get(key), vf.get(key))
    if any(x.get("kv_capacity_is_lower_bound") for x in m.values() if isinstance(x, dict)):
        lines.append("(an infhip capacity marked a lower bound was capped by max_num_seqs x max_seq_len, not memory)")
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vs-vllm"))
    ap.add_argument("--parts", default="offline,serving,cold,memory")
    ap.add_argument("--serving-rows", default=",".join(r[0] for r in SERVING_ROWS))
    ap.add_argument("--dry-run", action="store_true", help="CPU: our side on a tiny engine; print vLLM's commands")
    ap.add_argument("--child-timeout", type=float, default=540)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    tiny = args.dry_run
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if not tiny:
        # the staged vLLM (benchmarks/gpu/stage/vllm.sh --unpack), and fastapi / uvicorn for infhip-serve
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = "/tmp/site" + (":" + old if old else "")
    ckpt, dense = args.work / "ckpt", args.work / "engine-dense"
    dense_fp8, sparse = args.work / "engine-dense-fp8", args.work / "engine-3k-flash-fp8"
    t = time.time()
    if not (ckpt / "config.json").is_file():
        write_checkpoint(ckpt, tiny)
    if not (dense / "config.json").is_file():
        build(ckpt, dense, tiny, max_seq_len=2048 if tiny else 131072, max_batch_size=8 if tiny else 128)
    if "memory" in parts and not (dense_fp8 / "config.json").is_file():
        # max_seq_len x max_batch_size above what memory affords, so the page count read is memory's
        build(ckpt, dense_fp8, tiny, kv_dtype="fp8", max_seq_len=2048 if tiny else 1048576 + 8192, max_batch_size=4)
    if "memory" in parts and not (sparse / "config.json").is_file():
        build(ckpt, sparse, tiny, preset="3k-flash", kv_dtype="fp8", max_seq_len=4096 if tiny else 1048576 + 8192,
              max_batch_size=4)
    res: dict = {"setup_s": round(time.time() - t, 1), "dry_run": tiny, "parts": parts}
    print(f"[bench_vs_vllm] checkpoint and engines ready in {res['setup_s']} s", flush=True)
    scale = ["--scale", "8", "--device", "cpu"] if tiny else []
    lens = "256,512,1024" if tiny else f"8192,32768,{LEN_128K}"
    ctx = "1024" if tiny else str(LEN_DECODE)
    would = []  # the vLLM commands of a dry run

    def both(tag, task, infhip_model, extra_i, extra_v, env_v=None):
        vcmd = [task, "--side", "vllm", "--model", str(ckpt), *extra_v]
        out = {"infhip": run_child(args.out, f"{tag}_infhip", [task, "--side", "infhip", "--model", str(infhip_model),
                                                                *extra_i, *scale], args.child_timeout)}
        if tiny:
            would.append(" ".join([f"{k}={v}" for k, v in (env_v or {}).items()] + ["python3", str(SIDES), *vcmd]))
        else:
            out["vllm"] = run_child(args.out, f"{tag}_vllm", vcmd, args.child_timeout, env_v)
        return out

    if "offline" in parts:
        res["offline"] = both("offline", "offline", dense, ["--prefill-lens", lens], ["--prefill-lens", lens])
    if "serving" in parts:
        rows = [r for r in SERVING_ROWS if r[0] in args.serving_rows.split(",")]
        if tiny:
            cmd = server_cmds(ckpt, dense)["infhip"] + ["--device", "cpu"]
            res["serving"] = dry_run_serving(cmd, args.out, NAME, PORT)
            would += [" ".join(c) for c in server_cmds(ckpt, dense).values()]
            would += [" ".join(bench_serve_cmd(ckpt, args.out, s, *r)) for s in ("vllm", "infhip") for r in rows]
        else:
            res["serving"] = serving(ckpt, dense, args.out, rows)
    if "cold" in parts:
        cache = args.work / "vllm-cache"
        shutil.rmtree(cache, ignore_errors=True)
        env_i = {"TRITON_CACHE_DIR": str(args.work / "triton-empty")}
        shutil.rmtree(env_i["TRITON_CACHE_DIR"], ignore_errors=True)
        c = {"infhip": run_child(args.out, "cold_infhip", ["cold", "--side", "infhip", "--model", str(dense), *scale],
                                 args.child_timeout, env_i)}
        for tag in ("vllm_first", "vllm_second"):  # an empty compile cache, then the one the first filled
            vcmd = ["cold", "--side", "vllm", "--model", str(ckpt)]
            if tiny:
                would.append(f"VLLM_CACHE_ROOT={cache} python3 {SIDES} " + " ".join(vcmd))
            else:
                c[tag] = run_child(args.out, f"cold_{tag}", vcmd, args.child_timeout, {"VLLM_CACHE_ROOT": str(cache)})
        res["cold"] = c
    if "memory" in parts:
        m = {"infhip_dense_bf16": run_child(args.out, "memory_dense_bf16_infhip",
                                            ["memory", "--side", "infhip", "--model", str(dense), *scale],
                                            args.child_timeout),
             "infhip_dense_fp8": run_child(args.out, "memory_dense_fp8_infhip",
                                           ["memory", "--side", "infhip", "--model", str(dense_fp8), *scale],
                                           args.child_timeout),
             "infhip_3k-flash_fp8": run_child(args.out, "memory_3k-flash_fp8_infhip",
                                              ["memory", "--side", "infhip", "--model", str(sparse), "--contexts",
                                               ctx, *scale], args.child_timeout)}
        for kv in ("bf16", "fp8"):  # vLLM dense, its KV dtype; decode at 128K beside 3k-flash with fp8
            vcmd = ["memory", "--side", "vllm", "--model", str(ckpt), "--kv-dtype", kv] + (
                ["--contexts", ctx] if kv == "fp8" else [])
            if tiny:
                would.append(f"python3 {SIDES} " + " ".join(vcmd))
            else:
                m[f"vllm_{kv}"] = run_child(args.out, f"memory_{kv}_vllm", vcmd, args.child_timeout)
        res["memory"] = m
    (args.out / "bench_vs_vllm.json").write_text(json.dumps(res, indent=1) + "\n")
    if would:
        print("\nvLLM commands this run would make on the GPU (PYTHONPATH=/tmp/site):")
        print("\n".join("  " + w for w in would))
    print("\n" + table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
