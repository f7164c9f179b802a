"""Ahead-of-time kernels on the GPU: a kernel compiled by the builder's path launches from the
engine's kernels/ folder without compiling, with an empty, read-only Triton cache; an engine
built for this GPU generates under jit="forbid", every decode graph captured at load. Each check runs in a fresh Python process (a
process that already compiled a kernel would find it in Triton's in-memory cache)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu
# An empty Triton cache that cannot be written, even by root (the GPU machine runs tests as root).
READ_ONLY_CACHE = "/proc/infhip-no-triton-cache"

_STORE_SCRIPT = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path
    import torch, triton
    from infhip.builder.kernels import INDEX_FORMAT, compile_variants
    from infhip.plugins.aot import Target, record
    from infhip.plugins.rms_norm import rms_norm, rms_norm_ref
    from infhip.runtime import kernel_store

    engine = Path(sys.argv[1])
    x = torch.randn(5, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.rand(4096, device="cuda") + 0.5
    if sys.argv[2] == "build":  # the builder's path: record on meta tensors, compile in workers
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        target = Target("sm_%d%d" % torch.cuda.get_device_capability(), sms)
        with record(target) as rec:
            rms_norm(x.to("meta"), w.to("meta"), 1e-6)
        entries = compile_variants(sorted(rec.variants, key=lambda v: v.key), target, engine / "kernels", jobs=1)
        (engine / "kernels" / "index.json").write_text(json.dumps({
            "format": INDEX_FORMAT, "target": target.name, "num_sms": sms,
            "triton": triton.__version__, "kernels": entries}))
    else:  # serving: forbid compiling; the output must be right and nothing compiled
        owner = type("Owner", (), {})()
        store = kernel_store.open_store(engine, "sm_%d%d" % torch.cuda.get_device_capability(), "forbid", owner,
                                        num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
        with kernel_store.serving(store):  # the policy covers an engine's launches only (as LLM's steps)
            got = rms_norm(x, w, 1e-6)
            assert torch.allclose(got.float(), rms_norm_ref(x, w, 1e-6).float(), atol=2e-2, rtol=2e-2)
            cache = Path(triton.knobs.cache.dir)
            compiled = [p.name for p in cache.rglob("*.cubin")]
            assert not compiled, f"compiled while serving: {compiled}"
            try:
                rms_norm(x[:, :2048].contiguous(), w[:2048].contiguous(), 1e-6)  # another variant
            except kernel_store.JitForbidden as e:
                print("FORBIDDEN", e)
        print("OK", cache)
''')


def _run(args, env):
    proc = subprocess.run([sys.executable, "-c", _STORE_SCRIPT, *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_kernel_launches_from_the_engine_with_a_read_only_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "build-cache")
    _run([str(tmp_path / "engine"), "build"], env)
    env["TRITON_CACHE_DIR"] = READ_ONLY_CACHE
    out = _run([str(tmp_path / "engine"), "serve"], env)
    assert "FORBIDDEN" in out and "_rms_norm_kernel" in out and "BLOCK_N=2048" in out
    assert "\nOK " in out


_ENGINE_SCRIPT = textwrap.dedent('''
    import sys
    from infhip import LLM, SamplingParams
    llm = LLM(sys.argv[1], jit="forbid")
    prompts = [[(7 * i + 3 * j) % 290 + 3 for j in range(n)] for i, n in enumerate((90, 41, 300, 5))]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=8, temperature=0,
                                                                                 ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    report = llm.debug_view()["graphs"]["report"]
    assert report["on_request"] == 0, report  # all captured at load
    print("OK", llm.load_report)
''')


@pytest.mark.parametrize("build_kw", [
    dict(),
    dict(preset="3k", kv_dtype="fp8", infinitehip_overrides=dict(
        n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0], special_final_k=16,
        dense_threshold=30)),
], ids=["dense", "3k-fp8"])
def test_engine_generates_under_forbid(tmp_path, build_kw):
    from infhip.builder.build import build_engine
    from tests._tiny import write_tiny_hf_checkpoint

    write_tiny_hf_checkpoint(tmp_path / "hf", "llama")
    engine = build_engine(checkpoint=tmp_path / "hf", output_dir=tmp_path / "engine", dtype="bfloat16",
                          device="cuda", max_seq_len=512, max_batch_size=4, progress=False, **build_kw)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = READ_ONLY_CACHE
    proc = subprocess.run([sys.executable, "-c", _ENGINE_SCRIPT, str(engine)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr[-4000:]
