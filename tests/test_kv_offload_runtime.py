"""KV offloading in the runtime (tiny CPU engines): requests past the InfiniteHiP threshold move
their middle pages to the host pool after each step, and generate exactly the tokens they
generate with every page on the GPU — through the torch references and through the Triton
kernels under the interpreter, over float32 and fp8 caches. Prefill chunks read the offloaded
pages from staged GPU copies (runtime/offload/staging.py; tests/test_offload_staging.py)."""

from __future__ import annotations

import pytest

import infhip.runtime.offload.policy as offload_policy
from infhip import LLM, SamplingParams

from ._offload import count_moves, poison_host_during_staged_prefill

from .test_infinitehip_runtime import LOW, PROMPTS, TINY

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MiB = 1 << 20


@pytest.fixture(scope="module")
def engines(tiny_engine):  # the same engines as tests/test_infinitehip_runtime.py's (built once)
    kw = dict(max_seq_len=200, max_batch_size=4)
    return {"3k": tiny_engine("llama", preset="3k", infinitehip_overrides=TINY, **kw),
            "3k-fp8": tiny_engine("llama", preset="3k", infinitehip_overrides=TINY, kv_dtype="fp8", **kw),
            "dense": tiny_engine("llama", **kw),
            # the interpreted cases': 2 layers (special layer 0 and one regular, every kernel path
            # of 3; test_infinitehip_runtime's two_layer["3k"])
            "3k-2-layers": tiny_engine("llama", hf=dict(num_hidden_layers=2), preset="3k", infinitehip_overrides=TINY,
                                       **kw)}


# The tiny model's window (256) holds every context here: RoPE on in it, so pages move from the
# threshold on (with it off they would move only past the window, runtime/offload/policy.py offload_spec).
PAST = dict(LOW, rope_off_in_trained_window=False)


def run(engine, offload_bytes, budget=48, overrides=PAST, prompts=PROMPTS, params=GREEDY):
    """Generated tokens, and how many pages moved to the host while generating them."""
    llm = LLM(engine, max_num_batched_tokens=budget, infinitehip_overrides=overrides, kv_offload_bytes=offload_bytes)
    moved = count_moves(llm)
    out = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert llm.stats().host_pages_used.get("global", 0) == 0, "finished requests return their host pages"
    return out, len(moved)


@pytest.fixture
def small_batches(monkeypatch):
    """Move pages one at a time (tiny contexts: 16-token pages, a few of them eligible)."""
    monkeypatch.setattr(offload_policy, "OFFLOAD_BATCH_TOKENS", 16)


# fp8 kernels over host pages are covered by the plugin tests: one interpreted run is enough here
@pytest.mark.parametrize("kernels,engine", [("references", "3k"), ("references", "3k-fp8"),
                                            ("interpreter", "3k-2-layers")])
def test_offloaded_pages_generate_the_same_tokens(engines, small_batches, monkeypatch, engine, kernels):
    """Prefill kernels run while the host pools are NaN: they read only the staged copies (the
    interpreted run: a twin at another address, reached by the same element offsets)."""
    prompts, params, min_moved = PROMPTS, GREEDY, 10
    if kernels == "references":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:  # the interpreter is slow: the 120-token request alone (6 pages move), fewer tokens
        prompts, params, min_moved = [PROMPTS[2]], SHORT, 4
    expected, none_moved = run(engines[engine], 0, prompts=prompts, params=params)
    staged = poison_host_during_staged_prefill(monkeypatch)
    got, moved = run(engines[engine], 4 * MiB, prompts=prompts, params=params)
    assert none_moved == 0 and moved >= min_moved, f"only {moved} pages moved: the test would not exercise host pages"
    assert len(staged) >= 4, "no prefill step read staged pages"
    assert got == expected


def test_offloaded_decode_reads_the_value_bank(engines, small_batches, monkeypatch, reference_pruning):
    """Dynamic RoPE on (the key bank's case): with offloading, last-stage refreshes also copy the
    selected values into a value bank and decode reads both banks; the tokens equal the
    resident run's (interpreted kernels: the banks are a kernel path; pruning by its reference)."""
    import infhip.methods.infinitehip.runtime.layer as sa

    seen = []
    real = sa.sparse_decode_attention

    def spy(*a, **k):
        seen.append(k.get("value_bank") is not None)
        return real(*a, **k)
    monkeypatch.setattr(sa, "sparse_decode_attention", spy)
    knobs = dict(PAST, refresh_intervals=[4, 2, 1])
    prompts = [PROMPTS[2]]
    expected, _ = run(engines["3k-2-layers"], 0, overrides=knobs, prompts=prompts, params=SHORT)
    assert seen and not any(seen)
    seen.clear()
    got, moved = run(engines["3k-2-layers"], 4 * MiB, overrides=knobs, prompts=prompts, params=SHORT)
    assert moved >= 4 and seen and all(seen)
    assert got == expected


def test_offloading_starts_past_the_window_when_rope_is_off_inside_it(engines):
    """Inside the trained window prefill stages would read every offloaded key once per query
    block (no raw-keys scratch without dynamic RoPE): pages move only past the window there."""
    inside = LLM(engines["3k"], infinitehip_overrides=LOW, kv_offload_bytes=4 * MiB).runner
    window = inside.engine.config.model.max_position_embeddings
    assert inside.kv.groups["global"].offload.min_context == window + 1
    past = LLM(engines["3k"], infinitehip_overrides=PAST, kv_offload_bytes=4 * MiB).runner
    assert past.kv.groups["global"].offload.min_context == PAST["dense_threshold"]
    assert past.backends["infinitehip"].planner.offloading and not LLM(engines["3k"]).runner.backends["infinitehip"].planner.offloading


def test_offloading_is_refused_where_dense_kernels_would_read_host_pages(engines):
    with pytest.raises(ValueError, match="InfiniteHiP"):
        LLM(engines["dense"], kv_offload_bytes=4 * MiB)
    with pytest.raises(ValueError, match="token_drop cannot be combined"):
        LLM(engines["3k"], kv_offload_bytes=4 * MiB, token_drop=True)
    with pytest.raises(ValueError, match="holds no page"):
        LLM(engines["3k"], kv_offload_bytes=100)


def test_a_prompt_larger_than_the_host_pool_is_refused(engines, small_batches):
    llm = LLM(engines["3k"], kv_offload_bytes=40 * 1024, infinitehip_overrides=PAST)
    with pytest.raises(ValueError, match="host pool"):
        llm.generate(prompt_token_ids=[[5] * 190], sampling_params=GREEDY)


def test_cli_flags_pass_the_host_pool_and_refuse_bad_values(engines, capsys):
    """infhip-run --kv-offload-bytes: a clear error on a dense engine and on a negative size; the
    old --kv-offload-gib names the new flag."""
    from infhip.runtime import cli, server

    assert cli.main(["--engine", str(engines["dense"]), "--prompt", "hi", "--kv-offload-bytes", "0.01GiB"]) == 2
    assert "InfiniteHiP" in capsys.readouterr().err
    assert cli.main(["--engine", str(engines["3k"]), "--prompt", "hi", "--kv-offload-bytes", "-1"]) == 2
    assert ">= 0" in capsys.readouterr().err
    assert server.main(["--engine", str(engines["dense"]), "--kv-offload-bytes", "10MiB"]) == 2
    assert "InfiniteHiP" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--engine", str(engines["3k"]), "--prompt", "hi", "--kv-offload-gib", "1"])
    assert exit_.value.code == 2 and "--kv-offload-bytes" in capsys.readouterr().err
