"""The public runtime surface on a tiny engine with a tokenizer: generate vs stream, stop strings,
sampling seeds, infhip-run, and every bad input getting a clear error."""

from __future__ import annotations

import json
import shutil

import pytest

from infhip import LLM, SamplingParams
from infhip.config import EngineFormatError
from infhip.runtime import cli as run_cli
from tests._tiny import API_ENGINE


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine(**API_ENGINE)


@pytest.fixture(scope="module")
def llm(engine):
    return LLM(engine)


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_stream_equals_generate(llm):
    whole = llm.generate(["hello world"], GREEDY)[0]
    deltas = list(llm.generate_stream("hello world", GREEDY))
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert "".join(d.text for d in deltas) == whole.text
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])


def test_stop_string_cuts_text(llm):
    whole = llm.generate(["abc"], GREEDY)[0]
    assert len(whole.text) >= 4, "tiny model must produce some text for this test"
    stop = whole.text[2:4]
    out = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == whole.text[:whole.text.find(stop)]
    streamed = "".join(d.text for d in llm.generate_stream("abc", SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])))
    assert streamed == out.text


def test_stop_token_ids_and_seeds(llm):
    whole = llm.generate(["xyz"], GREEDY)[0]
    out = llm.generate(["xyz"], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[whole.token_ids[3]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == whole.token_ids[:whole.token_ids.index(whole.token_ids[3]) + 1]
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    a, b = llm.generate(["xyz", "xyz"], [sp, sp])
    assert a.token_ids == b.token_ids  # same seed, same tokens, even in one batch
    c = llm.generate(["xyz"], SamplingParams(max_tokens=10, temperature=1.0, seed=8, ignore_eos=True))[0]
    assert c.token_ids != a.token_ids


def test_bad_requests(llm):
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.generate(prompt_token_ids=[[5] * 200], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="exactly one"):
        llm.generate()
    with pytest.raises(ValueError, match=r"\[0, "):
        llm.generate(prompt_token_ids=[[10**6]], sampling_params=GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    # The engine keeps serving after rejected requests.
    assert len(llm.generate(["ok"], GREEDY)[0].token_ids) == 12


def _copy_with(engine, tmp_path, **build_changes):
    bad = tmp_path / "bad"
    shutil.copytree(engine, bad)
    cfg = json.loads((bad / "config.json").read_text())
    for key, value in build_changes.items():
        if key == "format_version":
            cfg[key] = value
        else:
            cfg["build"][key] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


def test_bad_engines(engine, tmp_path):
    with pytest.raises(EngineFormatError, match="format version 99"):
        LLM(_copy_with(engine, tmp_path / "v", format_version=99))
    with pytest.raises(EngineFormatError, match="sm_90"):
        LLM(_copy_with(engine, tmp_path / "t", target="sm_90"), device="cpu")
    with pytest.raises(EngineFormatError, match="not an infhip engine"):
        LLM(tmp_path)
    broken = tmp_path / "w"
    shutil.copytree(engine, broken)
    (broken / "rank0.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(EngineFormatError, match="rebuild"):
        LLM(broken)


def test_infhip_run_cli(engine, capsys):
    assert run_cli.main(["--engine", str(engine), "--prompt", "hello", "--max-tokens", "5", "--ignore-eos",
                         "--stats"]) == 0
    assert "5 tokens" in capsys.readouterr().err
    assert run_cli.main(["--engine", str(engine), "--prompt", "x", "--top-p", "2"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert run_cli.main(["--engine", str(engine) + "-missing", "--prompt", "x"]) == 2
    assert "not an infhip engine" in capsys.readouterr().err


def test_multi_step_decode_equals_single_step(engine, llm):
    """Decode steps run back to back on the device (tokens fed forward without a host look)
    give exactly what single steps give, stops included (tokens past a stop are discarded)."""
    multi = LLM(engine, num_decode_steps=4)
    fused_runs, run_fused = [], multi.runner.execute_decode_steps
    multi.runner.execute_decode_steps = lambda out, k, sample: fused_runs.append(k) or run_fused(out, k, sample)
    whole = llm.generate(["stop here"], GREEDY)[0]
    cases = [
        (["a", "bbbbbbbbbb", "hello there"], SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)),
        (["stop here"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[whole.text[3:5]])),
        (["stop here"], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[whole.token_ids[5]])),
        (["xyz", "q"], SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)),
    ]
    for prompts, sp in cases:
        single = llm.generate(prompts, sp)
        fused = multi.generate(prompts, sp)
        assert [o.token_ids for o in fused] == [o.token_ids for o in single]
        assert [(o.text, o.finish_reason) for o in fused] == [(o.text, o.finish_reason) for o in single]
    assert len(fused_runs) >= 5 and set(fused_runs) == {4}  # the fused path really ran
    streamed = list(multi.generate_stream("a", cases[0][1]))
    assert [t for d in streamed for t in d.token_ids] == llm.generate(["a"], cases[0][1])[0].token_ids
    # Near max_seq_len (128) the fused steps fall back to single steps and still stop on "length".
    long = multi.generate(prompt_token_ids=[[7] * 120], sampling_params=GREEDY)[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 8


def test_rejected_or_abandoned_requests_leave_nothing_behind(engine):
    """A batch with one bad prompt queues none of them; a stream the caller stops early frees its
    request: afterwards no sequence is left and every KV page is free again."""
    llm = LLM(engine)
    free = llm.stats().kv_pages_free
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.generate(prompt_token_ids=[[5] * 10, [6] * 200], sampling_params=GREEDY)
    stream = llm.generate_stream("hello", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(stream)
    stream.close()
    view = llm.debug_view()
    assert (view["requests"], view["running"], view["waiting"]) == ({}, [], [])
    assert llm.stats().kv_pages_free == free
    assert len(llm.generate(["ok"], GREEDY)[0].token_ids) == 12


def test_debug_view_is_json_and_gathers_the_contracts_read_outs(llm):
    """EngineCore.debug_view: JSON-able; each attached step transform's and attention backend's
    own view by name (a dense engine: token drop attached and off, no backend); no graphs on the
    CPU; one rank, no worker process."""
    llm.generate(["abc"], GREEDY)
    view = json.loads(json.dumps(llm.debug_view()))
    assert set(view) == {"requests", "running", "waiting", "stats", "transforms", "backends", "graphs",
                         "grammar_compiler", "tp_worker_pids"}
    assert view["transforms"] == {"token_drop": {"knobs": None, "drop_layers": [], "tail": 0, "max_context": None,
                                                 "selection": None, "retention": {}}}
    assert view["backends"] == {} and view["graphs"] is None and view["tp_worker_pids"] == []
    assert view["stats"]["kv_pages_used"] == {"global": 0}
