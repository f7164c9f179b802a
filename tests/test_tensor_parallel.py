"""Tensor parallelism on the CPU (docs/design/tensor_parallel.md): tiny float32 Llama and Gemma-3
engines built with --tp 2 run in 2 processes over gloo and generate exactly the --tp 1 tokens —
dense (with back-to-back decode steps: rank 0 broadcasts the sampled tokens), preset 3k (sparse
prefill and decode, chunk scores maxed over the ranks), 3k with KV offloading (rank 0 decides
the moves, each rank copies its pages) and token drop (block scores summed over the ranks) —
and so does a torchrun launch; the builder's shards are the one-rank weights cut Megatron-style
(kv heads split, or replicated when there are fewer than ranks). Bad input gets one-line
errors, and a failed rank surfaces on rank 0 instead of hanging.

The plugins' torch references run (TRITON_INTERPRET unset, as in test_infinitehip_runtime):
every TP=2 load spawns one worker process, which inherits that.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import infhip.methods.infinitehip.runtime.layer as sa
import infhip.runtime.offload.policy as offload_policy
from infhip import LLM, SamplingParams
from infhip.builder.build import build_engine
from infhip.builder.cli import main as build_main
from infhip.config import EngineConfig, EngineFormatError
from infhip.methods.token_drop import TokenDropConfig
from infhip.runtime.distributed import check_resources
from infhip.runtime.engine import load_engine
from infhip.runtime.model_runner import ModelRunner
from tests._offload import count_moves
from infhip.eval.token_drop_reference import token_drop_view
from tests._tiny import write_tiny_hf_checkpoint

DROP = dict(p=0.5, obs_window=8, block_size=8, num_sink=8, min_prompt_len=0, spare_anchors=0)  # top-p low enough to drop on random weights
IH = dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)], special_layers=[0], special_final_k=16)
LOW = {"dense_threshold": 30}  # the long prompts below go sparse, the short one stays dense
# KV offloading: pages move from the threshold on (RoPE on in the tiny model's whole window)
OFFLOAD = {"infinitehip_overrides": dict(LOW, rope_off_in_trained_window=False), "kv_offload_bytes": 4 << 20}
GEMMA_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt(1, 112), prompt(2, 75), prompt(3, 12)]  # two that drop / go sparse, one too short


@pytest.fixture(autouse=True)
def torch_references(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture(autouse=True, scope="module")
def one_thread_per_rank():
    """Two ranks on a 2-core runner: one torch thread each (workers take rank 0's count), as
    under pytest-xdist; spinning thread pools would double the CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engines(request, tmp_path_factory):
    """arch -> {(preset, tp): engine}. The Llama's dense engines have one kv head (replicated on
    both ranks at tp 2); its 3k engines two (one per rank)."""
    arch, root = request.param, tmp_path_factory.mktemp(request.param)
    extra = dict(num_hidden_layers=4, layer_types=GEMMA_TYPES) if arch == "gemma3" else {}
    write_tiny_hf_checkpoint(root / "hf", arch, **extra)
    dense_hf = root / "hf"
    if arch == "llama":
        write_tiny_hf_checkpoint(root / "hf1", arch, num_key_value_heads=1)
        dense_hf = root / "hf1"
    kw = dict(dtype="float32", device="cpu", max_seq_len=256, max_batch_size=4, progress=False)
    out = {}
    for tp in (1, 2):
        out["dense", tp] = build_engine(checkpoint=dense_hf, output_dir=root / f"dense{tp}", tp=tp, **kw)
        out["3k", tp] = build_engine(checkpoint=root / "hf", output_dir=root / f"3k{tp}", tp=tp, preset="3k",
                                     infinitehip_overrides=IH, **kw)
    return out


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """Dense tiny Llama engines at tp 1 and 2 (launch and error cases: one architecture is enough)."""
    root = tmp_path_factory.mktemp("llama_tp2")
    write_tiny_hf_checkpoint(root / "hf", "llama")
    return [build_engine(checkpoint=root / "hf", output_dir=root / f"tp{tp}", tp=tp, dtype="float32", device="cpu",
                         max_seq_len=256, max_batch_size=4, progress=False) for tp in (1, 2)]


@pytest.fixture(scope="module")
def llama_tp2(llama_pair):
    return llama_pair[1]


def generate(engine, live_token_drop=None, **load):
    """(greedy tokens of PROMPTS, token drop's retention per sequence, pages moved to the host).
    live_token_drop: turned on after the load (ModelRunner.set_transform, mirrored to the ranks)."""
    with LLM(engine, max_num_batched_tokens=64, **load) as llm:
        if live_token_drop is not None:
            llm.runner.set_transform("token_drop", TokenDropConfig(**live_token_drop))
        moved = count_moves(llm)
        tokens = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
        return tokens, token_drop_view(llm)["retention"], len(moved)


@pytest.mark.parametrize("case", ["dense", "3k", "token_drop", "3k_offload"])
def test_tp2_generates_the_tp1_tokens(engines, case, monkeypatch):
    sparse_calls, multi_steps = [], []
    real = sa.sparse_decode_attention
    monkeypatch.setattr(sa, "sparse_decode_attention", lambda *a, **k: sparse_calls.append(1) or real(*a, **k))
    real_steps = ModelRunner.run_decode_plans
    monkeypatch.setattr(ModelRunner, "run_decode_plans",
                        lambda self, *a, **k: multi_steps.append(1) or real_steps(self, *a, **k))
    # dense: 4 decode steps per host sync, so rank 0 broadcasts each step's sampled tokens
    monkeypatch.setattr(offload_policy, "OFFLOAD_BATCH_TOKENS", 16)  # pages move one at a time (rank 0 decides)
    preset, load = {"dense": ("dense", {"num_decode_steps": 4}), "3k": ("3k", {"infinitehip_overrides": LOW}),
                    "token_drop": ("dense", {"token_drop": DROP}), "3k_offload": ("3k", OFFLOAD)}[case]
    one, kept_one, moved_one = generate(engines[preset, 1], **load)
    calls_one = len(sparse_calls)
    if case == "token_drop":  # tp 2: turned on in the live runner, which publishes it to rank 1
        load = {"live_token_drop": DROP}
    two, kept_two, moved_two = generate(engines[preset, 2], **load)
    assert two == one
    if case == "3k_offload":  # pages moved to the host, the same ones (each rank copies its heads' part)
        assert moved_one >= 4 and moved_two == moved_one
    if case == "dense":  # back-to-back decode steps ran (their tokens broadcast from rank 0)
        assert multi_steps
    if case.startswith("3k"):  # the sparse kernels ran, as often on rank 0 as on one rank
        assert calls_one > 0 and len(sparse_calls) == 2 * calls_one
    if case == "token_drop":  # rows were dropped, the same ones (retention per anchor) as on one rank
        assert kept_one and kept_two == kept_one
        assert any(k < t for per in kept_one.values() for k, t in per.values())


def assert_shards_glue_back(one_rank, two_ranks) -> None:
    """Gluing the ranks' shards back (q | k | v rows, gate | up rows, o / down columns; fp8
    scales by their rows) gives the tp 1 file; replicated tensors are equal; config.json
    records the layout."""
    whole = load_file(str(one_rank / "rank0.safetensors"))
    ranks = [load_file(str(two_ranks / f"rank{r}.safetensors")) for r in range(2)]
    config = EngineConfig.load(two_ranks)
    m, d = config.model, config.model.head_dim
    record = json.loads((two_ranks / "config.json").read_text())["tensor_parallel"]
    assert record["size"] == 2 and record["weights"] == ["rank0.safetensors", "rank1.safetensors"]
    replicated = m.num_kv_heads < 2
    assert [r["kv_heads"] for r in record["ranks"]] == ([[0, 1], [0, 1]] if replicated else [[0, 1], [1, 2]])
    assert set(ranks[0]) == set(ranks[1]) == set(whole)
    for name, t in whole.items():
        parts = [r[name] for r in ranks]
        if t.dtype == torch.float8_e4m3fn:  # compare bytes (cat and equal on fp8 are not everywhere)
            t, parts = t.view(torch.uint8), [p.view(torch.uint8) for p in parts]
        if "qkv_proj." in name:
            q = torch.cat([p[:3 * d] for p in parts])
            kv = [p[3 * d:] for p in parts]
            if replicated:  # both ranks hold the one kv head
                assert torch.equal(kv[0], kv[1])
                k, v = kv[0][:d], kv[0][d:]
            else:  # one kv head each
                k, v = torch.cat([x[:d] for x in kv]), torch.cat([x[d:] for x in kv])
            assert torch.equal(torch.cat([q, k, v]), t), name
        elif "gate_up_proj." in name:
            i = m.intermediate_size // 2
            assert torch.equal(torch.cat([p[:i] for p in parts] + [p[i:] for p in parts]), t), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), t), name
        else:  # embeddings, norms, LM head, RoPE, o/down scales (per output row)
            assert all(torch.equal(p, t) for p in parts), name


def test_shards_are_the_one_rank_weights_cut_megatron_style(engines):
    for preset in ("dense", "3k"):
        assert_shards_glue_back(engines[preset, 1], engines[preset, 2])


def test_fp8_engines_are_cut_after_quantization(tmp_path):
    write_tiny_hf_checkpoint(tmp_path / "hf", "qwen2")  # qkv biases too
    kw = dict(checkpoint=tmp_path / "hf", dtype="float32", device="cpu", max_seq_len=128, progress=False,
              weight_dtype="fp8")
    assert_shards_glue_back(build_engine(output_dir=tmp_path / "one", **kw),
                            build_engine(output_dir=tmp_path / "two", tp=2, **kw))


def test_torchrun_launch_generates_the_tp1_tokens(llama_pair, tmp_path):
    """Under torchrun every process calls LLM(engine): rank 0's returns, rank 1 serves inside it
    and exits when rank 0 closes (so infhip-run / infhip-serve run unchanged under torchrun)."""
    script = tmp_path / "run.py"
    script.write_text(
        "import json, os, sys\n"
        "from infhip import LLM, SamplingParams\n"
        "with LLM(sys.argv[1]) as llm:\n"
        "    out = llm.generate(prompt_token_ids=json.loads(sys.argv[2]),\n"
        "                       sampling_params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))\n"
        "    print('TOKENS', json.dumps([o.token_ids for o in out]))\n"
        "from pathlib import Path\n"  # closed: the groups' threads are gone (see the assert below)
        "print('THREADS', json.dumps([p.read_text().strip() for p in Path('/proc/self/task').glob('*/comm')]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(llama_pair[1]), json.dumps(PROMPTS[1:])],
                         capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stderr[-8000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1  # rank 0 only
    with LLM(llama_pair[0]) as llm:
        expected = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS[1:], sampling_params=GREEDY)]
    assert json.loads(lines[0][len("TOKENS "):]) == expected
    # gloo threads still running at interpreter teardown aborted ~1 exit in 40 (TPGroup.end)
    threads = [line for line in run.stdout.splitlines() if line.startswith("THREADS ")]
    assert len(threads) == 1 and not [t for t in json.loads(threads[0][len("THREADS "):]) if "gloo" in t]


def test_bad_tp_at_build_is_one_line(tmp_path, capsys):
    write_tiny_hf_checkpoint(tmp_path / "hf", "llama")  # 6 query heads, 2 kv heads, MLP 80
    write_tiny_hf_checkpoint(tmp_path / "hf1", "llama", num_key_value_heads=1)
    capsys.readouterr()
    base = ["--checkpoint", str(tmp_path / "hf"), "--dtype", "float32", "--device", "cpu", "--quiet"]
    assert build_main(base + ["--output", str(tmp_path / "a"), "--tp", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "infhip-build: error: --tp 4 does not divide the model's 6 query heads; choose --tp from 1, 2"
    one = ["--checkpoint", str(tmp_path / "hf1"), "--dtype", "float32", "--device", "cpu", "--quiet"]
    assert build_main(one + ["--output", str(tmp_path / "b"), "--tp", "2", "--preset", "3k"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--tp 2 replicates the model's 1 kv heads" in err and "--preset dense" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_too_few_devices_or_processes_is_one_line(llama_tp2, monkeypatch):
    engine = llama_tp2
    monkeypatch.setenv("WORLD_SIZE", "1")  # a torchrun launch of the wrong size
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(EngineFormatError, match=r"built for tensor parallelism 2 but torchrun started 1 "
                                                r"process\(es\); launch it with torchrun --nproc-per-node 2"):
        LLM(engine)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(EngineFormatError, match=r"\(2 GPUs\) but 1 GPU\(s\) are visible; .* --tp 1"):
        check_resources(EngineConfig.load(engine), "cuda", engine)
    with pytest.raises(ValueError, match=r"tensor-parallel \(tp 2\): load it with LLM\(engine\)"):
        ModelRunner(load_engine(engine), 4, 64)


def wait_until_dead(pid: int, timeout_s: float) -> bool:
    """Whether process pid has exited (a zombie: its parent, rank 0's TPSession, reaps it) within
    timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.01)
    return False


def test_a_worker_that_fails_surfaces_on_rank0(llama_tp2, tmp_path):
    """At load (its shard is missing): LLM() raises the worker's reason. In a step (the worker
    killed): the step's requests fail with a message naming the rank, and nothing hangs."""
    broken = shutil.copytree(llama_tp2, tmp_path / "broken")
    (broken / "rank1.safetensors").unlink()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 could not load the engine: .*rank1\.safetensors "
                                           r"is missing; rebuild the engine"):
        LLM(broken)
    with LLM(llama_tp2) as llm:
        assert llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=GREEDY)[0].finish_reason == "length"
        [pid] = llm.debug_view()["tp_worker_pids"]
        os.kill(pid, signal.SIGKILL)
        assert wait_until_dead(pid, 10)
        out = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=GREEDY)[0]
        assert out.finish_reason == "error"
        assert "tensor parallelism broke down (rank 1 exited with code -9)" in out.error


def test_a_closed_llm_refuses_steps_and_leaves_no_group_thread(llama_tp2):
    """close() ends the process groups here and now (TPGroup.end): no gloo thread is left to
    abort the interpreter's teardown, and a later request fails with a one-line reason."""
    def gloo_threads() -> set[str]:  # thread ids: only this load's threads count, not other tests'
        return {p.parent.name for p in Path("/proc/self/task").glob("*/comm") if "gloo" in p.read_text()}

    before = gloo_threads()
    llm = LLM(llama_tp2)
    assert gloo_threads() - before  # the groups' threads while the engine is open
    llm.close()
    assert gloo_threads() <= before
    out = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=GREEDY)[0]
    assert out.finish_reason == "error" and "this tensor-parallel LLM is closed: load the engine again" in out.error


def test_a_failed_step_on_rank0_ends_the_engine(llama_tp2):
    """The workers may be inside that step's collectives: later steps refuse (one line) instead
    of meeting them out of order."""
    def boom(hidden):
        raise RuntimeError("boom")

    with LLM(llama_tp2) as llm:
        llm.engine.model.compute_logits = boom
        out = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=GREEDY)[0]
        assert out.finish_reason == "error" and "boom" in out.error
        del llm.engine.model.compute_logits
        out = llm.generate(prompt_token_ids=[PROMPTS[2]], sampling_params=GREEDY)[0]
        assert out.finish_reason == "error"
        assert "a step failed on rank 0 (RuntimeError: boom); the tensor-parallel ranks are out of step" in out.error
