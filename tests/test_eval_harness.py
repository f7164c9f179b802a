"""infhip-eval machinery on tiny random engines (CPU, seconds): teacher-forced log-probs equal
transformers' full-forward ones (whole and chunked prefill, a batch of items, sliding layers),
ppl/agree/passkey/niah through the Python API and the CLI (JSON, markdown, plot), recall on
explicit sparse parameters, the clean refusal of recall on a dense plan, and RULER's retention records
under token drop."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from infhip import LLM
from infhip.eval import cli
from infhip.eval.agree import agreement
from infhip.eval.common import load_llm
from infhip.eval.forcing import target_log_probs
from infhip.eval.ppl import PplConfig, run_ppl
from infhip.eval.recall import NoSparseLayers, measure_recall, sparse_layer_params


_HF: dict[str, torch.nn.Module] = {}


def _tiny(arch: str, tiny_engine, tiny_checkpoint):
    """A tiny random engine with a tokenizer and 1024 positions (built once per arch per session)."""
    hf_overrides = dict(max_position_embeddings=1024)
    src = tiny_checkpoint(arch, tokenizer=True, **hf_overrides)
    engine = tiny_engine(arch, tokenizer=True, hf=hf_overrides, max_seq_len=1024, max_batch_size=4)
    if arch not in _HF:
        _HF[arch] = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return arch, json.loads((src / "config.json").read_text()), engine, _HF[arch]


@pytest.fixture(params=["llama", "gemma3"])  # Gemma-3: sliding + global layers, tied embeddings
def tiny_any(request, tiny_engine, tiny_checkpoint):
    return _tiny(request.param, tiny_engine, tiny_checkpoint)


@pytest.fixture
def tiny(tiny_engine, tiny_checkpoint):  # Gemma-3's mix of sliding and global layers exercises the most paths
    return _tiny("gemma3", tiny_engine, tiny_checkpoint)


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("budget", [256, 24])  # one-step prefill, and chunked prefill + batch interleaving
def test_teacher_forced_log_probs_match_transformers(tiny_any, budget):
    arch, cfg, engine, hf = tiny_any
    llm = LLM(engine, max_num_batched_tokens=budget)
    items = []
    for seed, (n_ctx, n_tgt) in enumerate([(70, 30), (9, 12), (100, 1)]):
        ids = _ids(seed, n_ctx + n_tgt, cfg["vocab_size"])
        items.append((ids[:n_ctx], ids[n_ctx:]))
    ours = target_log_probs(llm, items)
    for (ctx, tgt), lp in zip(items, ours):
        with torch.no_grad():
            logits = hf(torch.tensor([ctx + tgt])).logits[0].double()
        ref = logits.log_softmax(-1)[len(ctx) - 1:-1].gather(1, torch.tensor(tgt)[:, None])[:, 0]
        assert torch.allclose(lp, ref, rtol=1e-4, atol=1e-4), arch
    assert not llm.scheduler.has_unfinished()  # every forced sequence released its pages
    with pytest.raises(ValueError, match="max_seq_len"):
        target_log_probs(llm, [(_ids(0, 1000, cfg["vocab_size"]), _ids(1, 60, cfg["vocab_size"]))])


def test_agree_with_itself(tiny_any):
    _, cfg, engine, _ = tiny_any
    a, b = LLM(engine), LLM(engine, max_num_batched_tokens=32)
    items = [(_ids(5, 90, cfg["vocab_size"]), _ids(6, 20, cfg["vocab_size"]))] * 2
    for top1, kl in agreement(a, b, items):
        assert top1 == 1.0 and 0.0 <= kl < 1e-6


def test_cli_ppl_and_outputs(tiny, tmp_path, capsys):
    _, _, engine, _ = tiny
    out = tmp_path / "res"
    rc = cli.main(["ppl", "--engine", str(engine), "--lengths", "64,128", "--chunk", "16", "--samples", "2",
                   "--json", str(out / "ppl.json"), "--markdown", str(out / "ppl.md"), "--plot", str(out / "ppl.png")])
    assert rc == 0
    data = json.loads((out / "ppl.json").read_text())
    assert [r["length"] for r in data["summary"]] == [64, 128]
    assert all(r["score"] > 1.0 for r in data["summary"])  # random weights: perplexity well above 1
    assert "| engine | metric | 64 | 128 |" in (out / "ppl.md").read_text()
    assert (out / "ppl.png").read_bytes()[:4] == b"\x89PNG"
    # the same numbers through the Python API
    again = run_ppl([str(engine)], PplConfig(lengths=[64], chunk=16, samples=2), log=lambda m: None)
    assert again.summary()[0]["score"] == pytest.approx(data["summary"][0]["score"], rel=1e-9)


def test_cli_generation_tasks_run(tiny, tmp_path):
    """passkey / niah / agree end to end on a random model (scores are ~0: this checks the plumbing)."""
    _, _, engine, _ = tiny
    assert cli.main(["passkey", "--engine", str(engine), "--lengths", "300", "--depths", "0.5",
                     "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")]) == 0
    assert cli.main(["niah", "--engine", str(engine), "--lengths", "640", "--depths", "0.5",
                     "--variants", "single,multiquery", "--haystack", "noise", "--json", str(tmp_path / "n.json")]) == 0
    recs = json.loads((tmp_path / "n.json").read_text())["records"]
    assert {r["variant"] for r in recs} == {"single", "multiquery"}
    assert cli.main(["agree", "--engine", str(engine), "--reference", str(engine), "--lengths", "64",
                     "--chunk", "8", "--samples", "1", "--json", str(tmp_path / "a.json")]) == 0
    summary = json.loads((tmp_path / "a.json").read_text())["summary"]
    assert {r.get("metric"): r["score"] for r in summary}["top1"] == 1.0


def test_bad_input_exits_2(tiny, tmp_path, capsys):
    _, _, engine, _ = tiny
    assert cli.main(["ppl", "--engine", str(tmp_path / "missing")]) == 2
    assert cli.main(["ppl", "--engine", str(engine), "--lengths", "64", "--chunk", "64"]) == 2
    assert cli.main(["passkey", "--engine", str(engine), "--lengths", "4k"]) == 2  # over max_seq_len 1024
    assert cli.main(["agree", "--engine", str(engine), "--lengths", "64"]) == 2  # no --reference
    assert cli.main(["ppl", "--engine", str(engine), "--max-num-seqs", "0"]) == 2
    assert cli.main(["ppl", "--engine", str(engine), "--max-num-batched-tokens", "0"]) == 2
    assert cli.main(["ppl", "--engine", str(engine), "--lengths", "64", "--chunk", "16", "--kv-cache-memory-bytes", "10000"]) == 2
    err = capsys.readouterr().err
    assert "max_seq_len" in err and "--reference" in err and "KV cache budget" in err


def test_recall_refuses_dense_plan_and_measures_explicit_params(tiny, capsys):
    arch, _, engine, _ = tiny
    assert cli.main(["recall", "--engine", str(engine), "--lengths", "128"]) == 3
    assert "no sparse layers" in capsys.readouterr().err
    llm = load_llm(engine)
    with pytest.raises(NoSparseLayers):
        sparse_layer_params(llm)
    layer = next(lp.index for lp in llm.engine.config.plan.layers if lp.attention == "global")
    ids = _ids(9, 160, llm.engine.config.model.vocab_size)
    small = {"n_sink": 4, "n_stream": 8, "stages": [[4, 8, 16]]}
    everything = {"n_sink": 4, "n_stream": 8, "stages": [[4, 4, 256]]}
    r_small = measure_recall(llm, ids, 12, {layer: small})[layer]
    r_all = measure_recall(llm, ids, 12, {layer: everything})[layer]
    assert r_small.shape == (llm.engine.config.model.num_heads,)
    assert ((r_small > 0) & (r_small < 1)).all(), arch
    assert torch.allclose(r_all, torch.ones_like(r_all)), arch  # k covers the whole middle
    # query strides reach the stages: scoring with the last query of each block only keeps
    # other chunks for the block's earlier queries somewhere
    r_strided = measure_recall(llm, ids, 12, {layer: dict(small, query_strides=[4])})[layer]
    assert not torch.equal(r_strided, r_small), arch
    assert not llm.scheduler.has_unfinished()


def test_recall_on_an_infinitehip_engine(tmp_path, tiny_engine):
    """The plan's own InfiniteHiP knobs drive the measurement (tiny stages, CPU references)."""
    knobs = {"n_sink": 4, "n_stream": 16, "stages": [[8, 16, 64], [8, 4, 32]], "refresh_intervals": [2, 1],
             "special_layers": [0], "special_final_k": 16, "dense_threshold": 1000}  # prefill dense: fast
    engine = tiny_engine("llama", tokenizer=True, hf=dict(max_position_embeddings=1024), preset="3k",
                         max_seq_len=1024, max_batch_size=2, infinitehip_overrides=knobs)
    assert cli.main(["recall", "--engine", str(engine), "--lengths", "200", "--chunk", "8",
                     "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]) == 0
    recs = json.loads((tmp_path / "r.json").read_text())["records"]
    plan = load_llm(engine).engine.config.plan
    sparse = {lp.index for lp in plan.layers if lp.backend != "dense"}
    assert {r["layer"] for r in recs} == sparse and len(recs) == len(sparse) * 6  # 6 query heads
    assert all(0.0 < r["score"] < 1.0 for r in recs)  # 52 of 200 keys kept: partial mass
    assert all(r["extra"]["engine_runs_dense"] for r in recs)  # 200 < dense_threshold, and it says so
    # --haystack picks the windows' text (the GPU image has no KJV package: the qwen run uses pg)
    assert cli.main(["recall", "--engine", str(engine), "--lengths", "200", "--chunk", "8", "--haystack", "noise",
                     "--json", str(tmp_path / "n.json")]) == 0
    noise = json.loads((tmp_path / "n.json").read_text())["records"]
    assert len(noise) == len(recs) and [r["score"] for r in noise] != [r["score"] for r in recs]


def test_infinitehip_overrides_flag_parses():
    from infhip.eval.cli import _llm_kwargs, build_parser
    from infhip.eval.common import EvalError

    def kwargs(*flags):
        return _llm_kwargs(build_parser().parse_args(["ppl", "--engine", "e", *flags]))

    assert kwargs()["overrides"] is None
    assert kwargs("--infinitehip-overrides", "chunk_score=head_normalized, dense_threshold=4096,"
                  "refresh_intervals=[32,16,8]")["overrides"] == {"infinitehip": {
        "chunk_score": "head_normalized", "dense_threshold": 4096, "refresh_intervals": [32, 16, 8]}}
    with pytest.raises(EvalError, match="KEY=VALUE"):
        kwargs("--infinitehip-overrides", "chunk_score")


def test_token_drop_flag(tiny, tmp_path):
    """--token-drop lays knobs over every engine of the run: off and p=1 reproduce the engine's
    own perplexity, a forced 30 % retention changes it; a bad key exits 2."""
    _, _, engine, _ = tiny

    def ppl(*extra, chunk=None):
        out = tmp_path / f"ppl{len(list(tmp_path.iterdir()))}.json"
        assert cli.main(["ppl", "--engine", str(engine), "--lengths", "256", "--chunk", "16", "--samples", "1",
                         "--json", str(out), *extra]) == 0
        result = json.loads(out.read_text())
        if chunk is not None:  # the flag reached the engine
            assert [i["max_num_batched_tokens"] for i in result["settings"]["engine_info"].values()] == [chunk]
        return result["summary"][0]["score"]

    base = ppl()
    assert ppl("--token-drop", "off") == base
    assert ppl("--token-drop", "p=1,min_prompt_len=0") == pytest.approx(base, rel=1e-9)
    assert ppl("--max-num-batched-tokens", "64", chunk=64) == pytest.approx(base, rel=1e-4)  # chunked: exact
    # every full layer drops before its attention: the tiny Gemma's one global layer (5) drops its
    # keys (the authors' schedule drops after layer 5's attention, which leaves the decode's keys whole)
    assert ppl("--token-drop", "obs_window=8,block_size=8,num_sink=8,min_prompt_len=0,spare_anchors=0,"
               "drop_layers=every,drop_point=before_attention,reenter=true",
               "--retention", "0.3") != pytest.approx(base, rel=1e-3)
    assert cli.main(["ppl", "--engine", str(engine), "--lengths", "64", "--token-drop", "q=1"]) == 2
    assert cli.main(["ppl", "--engine", str(engine), "--lengths", "64", "--token-drop", "spare_anchors=-1"]) == 2


def test_ruler_with_token_drop_records_retention(tiny, tmp_path):
    """RULER under --token-drop: each record carries token drop's measured retention (forced to
    30 % here, so below 1) and the table gets a retention row (random weights: scores ~0)."""
    import importlib.util
    if importlib.util.find_spec("wonderwords") is None:
        pytest.skip("RULER's keys need wonderwords's word lists: pip install wonderwords")
    _, _, engine, _ = tiny
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    assert cli.main(["ruler", "--engine", str(engine), "--tasks", "niah_single_1", "--lengths", "560",
                     "--samples", "1", "--token-drop", "obs_window=8,block_size=8,num_sink=8,min_prompt_len=0,"
                     "spare_anchors=0", "--retention", "0.3", "--json", str(out), "--markdown", str(md)]) == 0
    records = json.loads(out.read_text())["records"]
    assert len(records) == 1 and 0.0 < records[0]["extra"]["retention"] < 1.0
    assert "| retention ρ |" in md.read_text()
