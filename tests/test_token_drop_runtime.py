"""UniPrefill token drop in the runtime, on tiny random models (float32, CPU).

* p = 1 keeps everything and reproduces the dense engine (logits, greedy tokens), whole and
  chunked prefill (a chunk starting mid-block included);
* with a forced retention, prefill + decode logits equal a plain-torch reference that masks the
  dropped keys per layer (eval/token_drop_reference.py), and that reference is sensitive: the same
  logits differ from a reference without the drop;
* with top-p, the engine's kept sets at every drop layer and its logits equal the reference
  choosing its own sets by the spec (eval/token_drop_reference.reference_select) from its own stream;
* both checks for each drop schedule that matters (SCHEDULES: the paper's, the authors' code,
  and the two mixes of drop point and re-entry), whole and chunked prefill;
* a batch (two dropping prompts, one too short to drop, mixed with decodes) equals each alone;
* Llama (every layer full attention) and a Gemma-3 with global layers 1 and 4 (sliding layers
  after a drop get compact rows), old engines load with the earlier schedule, bad specs and
  drop layers that are not full-attention layers give one-line errors.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from infhip import LLM, SamplingParams
from infhip.builder.build import build_engine
from infhip.builder.cli import main as build_main
from infhip.config import EngineConfig, EngineFormatError
from infhip.eval.common import forced_retention, record_kept_positions, set_forced_retention
from infhip.eval.token_drop_reference import reference_logits, reference_schedule, run_greedy, token_drop_view
from infhip.methods.token_drop import AUTHORS_LLAMA_EIGHTHS, TokenDropConfig, default_drop_layers, parse_token_drop

TINY = dict(obs_window=8, block_size=8, num_sink=8, min_prompt_len=0, spare_anchors=0)  # knobs scaled to ~200-token prompts
# The drop schedules (TokenDropConfig drop_layers / drop_point / reenter) that matter: the paper's
# (every full-attention layer drops before its attention, dropped rows re-enter at the next),
# the authors' code (a few layers, after attention, no re-entry; the default) and the two mixes.
# drop_layers "arch": Llama (3 full layers) drops at 0 and 2 (layer 1 runs the compact rows
# without dropping), the Gemma-3 at its global layers 1 and 4 (both of them).
SCHEDULES = {
    "paper": dict(drop_layers="every", drop_point="before_attention", reenter=True),
    "authors": dict(drop_layers="arch", drop_point="after_attention", reenter=False),
    "after+reenter": dict(drop_layers="arch", drop_point="after_attention", reenter=True),
    "before-no-reenter": dict(drop_layers="arch", drop_point="before_attention", reenter=False),
}


def schedule_knobs(engine, name: str) -> dict:
    knobs = dict(SCHEDULES[name])
    if knobs["drop_layers"] == "arch":
        knobs["drop_layers"] = [0, 2] if EngineConfig.load(engine).model.architecture == "llama" else [1, 4]
    return knobs


GEMMA_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
               "full_attention", "sliding_attention"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request, tiny_engine):
    hf = dict(num_hidden_layers=6, layer_types=GEMMA_TYPES) if request.param == "gemma3" else {}
    return tiny_engine(request.param, hf=hf, max_seq_len=256, max_batch_size=4)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("budget", [None, 100])  # 100: chunks [0, 100), [100, 200): mid-block start
def test_p_one_reproduces_dense(engine, budget):
    ids = prompt(1, 200)
    dense = LLM(engine, max_num_batched_tokens=budget)
    dropping = LLM(engine, max_num_batched_tokens=budget, token_drop=dict(p=1.0, **TINY))
    tok_d, log_d, _ = run_greedy(dense, ids, 6)
    tok_t, log_t, sid = run_greedy(dropping, ids, 6)
    assert tok_t == tok_d
    assert (log_t - log_d).abs().max() < 1e-4
    per_layer = token_drop_view(dropping)["retention"][sid]
    assert per_layer and all(kept == total for kept, total in per_layer.values())  # drop path ran


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("budget", [None, 100])
def test_decode_after_drop_equals_masked_reference(engine, budget, schedule):
    """Prefill with a forced retention, then decode: every layer attends exactly to the keys it
    wrote (per-layer KV lengths after the drop), whole and chunked prefill, each schedule."""
    if budget and schedule in ("after+reenter", "before-no-reenter"):
        pytest.skip("chunked prefill: the paper's and the authors' schedules cover it")
    ids = prompt(2, 200)
    llm = set_forced_retention(LLM(engine, max_num_batched_tokens=budget,
                                   token_drop=dict(TINY, **schedule_knobs(engine, schedule))), 0.3)
    kept_positions = record_kept_positions(llm)
    tokens, logits, sid = run_greedy(llm, ids, 5)
    assert record_kept_positions(llm) is kept_positions  # one recorder per engine (benchmarks ask again)
    kept = {layer: torch.cat(chunks) for layer, chunks in kept_positions[sid].items()}
    layers = llm.engine.config.plan.layers
    sched = reference_schedule(llm)
    assert set(sched["layers"]) <= set(kept) <= {lp.index for lp in layers if lp.window is None}
    assert all(len(kept[layer]) < 0.6 * len(ids) for layer in sched["layers"])  # really dropped
    if not sched["reenter"]:  # the kept set only shrinks
        runs = [set(kept[layer].tolist()) for layer in sorted(kept)]
        assert all(b <= a for a, b in zip(runs, runs[1:]))
    full = ids + tokens[:-1]
    ref = reference_logits(llm.engine.model, full, len(ids), kept, layers, schedule=sched)[len(ids) - 1:]
    assert (logits.double() - ref).abs().max() < 1e-4
    # the reference can fail: without the drop it computes different logits
    dense_ref = reference_logits(llm.engine.model, full, len(ids), {}, layers)[len(ids) - 1:]
    assert (logits.double() - dense_ref).abs().max() > 1e-2


@pytest.mark.parametrize("p, spare, schedule", [(0.6, 0, "paper"), (0.75, 0, "paper"), (0.6, 1, "paper"),
                                               (0.6, 0, "authors"), (0.75, 0, "authors"), (0.6, 1, "authors"),
                                               (0.6, 0, "after+reenter"), (0.6, 0, "before-no-reenter")])
def test_top_p_selection_equals_reference(engine, p, spare, schedule):
    """The engine's own top-p choice (not a forced retention) at every drop layer equals the
    spec's selection recomputed by the reference from its own stream, and so do the decode
    logits: checks importance, top-p, sinks, tail, the drop point and re-entry (or none) end to
    end, not only with the engine's kept sets. Odd prompt length (a partial last block); one
    prefill chunk. spare: the first drop layers keep every token (TokenDropConfig.spare_anchors)
    and record no drop."""
    ids = prompt(6, 203)
    llm = LLM(engine, token_drop=dict(TINY, p=p, spare_anchors=spare, **schedule_knobs(engine, schedule)))
    kept_positions = record_kept_positions(llm)
    tokens, logits, sid = run_greedy(llm, ids, 4)
    kept = {layer: torch.cat(chunks) for layer, chunks in kept_positions[sid].items()}
    layers = llm.engine.config.plan.layers
    view = token_drop_view(llm)
    cfg = view["knobs"]
    chosen: dict[int, torch.Tensor] = {}
    sched = reference_schedule(llm)
    spared = set(sched["layers"][:spare])
    drops = set(sched["layers"]) - spared
    assert drops == set(view["drop_layers"])
    select = dict(p=p, n=cfg["obs_window"], G=cfg["block_size"], A=cfg["num_sink"], tail=view["tail"], spare=spared)
    ref = reference_logits(llm.engine.model, ids + tokens[:-1], len(ids), chosen, layers, select=select,
                           schedule=sched)
    assert set(chosen) == drops and drops <= set(kept) and not spared & set(kept)
    for layer in drops:
        assert torch.equal(kept[layer], chosen[layer]), f"layer {layer}"
    assert sum(len(kept[layer]) for layer in drops) < 0.9 * len(drops) * len(ids)  # really dropped
    assert (logits.double() - ref[len(ids) - 1:]).abs().max() < 1e-4


def test_batch_equals_each_alone(engine):
    knobs = dict(TINY, p=0.9, min_prompt_len=150)
    prompts = [prompt(3, 200), prompt(4, 170), prompt(5, 60)]  # the last one is too short to drop
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(engine, token_drop=knobs, max_num_batched_tokens=256)
    batch = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]
    batch_ret = list(token_drop_view(llm)["retention"].values())
    assert len(batch_ret) == 2  # the short prompt never dropped
    alone = []
    for p in prompts:
        one = LLM(engine, token_drop=knobs)
        alone.append(one.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids)
    assert batch == alone
    # decodes mixed into the dropping prefills' steps: the short prompt starts first
    llm2 = LLM(engine, token_drop=knobs, max_num_batched_tokens=256)
    reqs = [llm2.core.add_request(None, prompts[2], sp)]
    llm2.core.step()
    assert reqs[0].seq.num_output_tokens == 1
    reqs += [llm2.core.add_request(None, p, sp) for p in prompts[:2]]
    while not all(r.seq.is_finished for r in reqs):
        llm2.core.step()
    assert [r.seq.output_token_ids for r in reqs] == [alone[2], alone[0], alone[1]]


def test_drop_histories_live_with_the_kv_and_go_with_it(engine):
    """The transform keeps the drop histories by seq_id (its DropRecords' histories) while a
    sequence holds its KV: a dropping prefill starts one, finishing (or aborting) ends it;
    nothing is left behind. A finished request's history stays readable for /metrics
    (drop_history)."""
    knobs = dict(TINY, **schedule_knobs(engine, "paper"))  # dropped rows write no KV at drop layers
    llm = set_forced_retention(LLM(engine, token_drop=knobs, max_num_batched_tokens=400), 0.3)
    transform = llm.runner.transforms["token_drop"]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    done, aborted = (llm.core.add_request(None, prompt(s, 200), sp) for s in (6, 7))
    llm.core.step()  # both prompts whole, both drop
    live = {sid: list(h) for sid, h in transform.stats.histories.items()}
    assert set(live) == {done.seq.seq_id, aborted.seq.seq_id} and all(any(h) for h in live.values())
    llm.core.abort(aborted)
    assert set(transform.stats.histories) == {done.seq.seq_id}
    while not done.seq.is_finished:
        llm.core.step()
    assert transform.stats.histories == {}
    assert transform.drop_history(done.seq.seq_id) == live[done.seq.seq_id]


def test_metrics_count_the_requests_that_dropped(engine):
    """/metrics (the transform's request counters): a finished request whose prefill dropped adds
    one to infhip_token_drop_requests and its history's sum to infhip_token_drop_skipped_kv; a
    load with token drop off has neither counter."""
    from infhip.runtime.serving.metrics import ServerMetrics

    knobs = dict(TINY, **schedule_knobs(engine, "paper"))
    llm = set_forced_retention(LLM(engine, token_drop=knobs, max_num_batched_tokens=400), 0.3)
    metrics = ServerMetrics(llm.core.info())
    req = llm.core.add_request(None, prompt(8, 200), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while not req.seq.is_finished:
        llm.core.step()
    metrics.gone(req, aborted=False)
    history = llm.runner.transforms["token_drop"].drop_history(req.seq.seq_id)
    text = metrics.render().decode()
    assert history and any(history)
    assert "infhip_token_drop_requests_total 1.0" in text
    assert f"infhip_token_drop_skipped_kv_total {float(sum(history))}" in text
    assert "infhip_token_drop" not in ServerMetrics(LLM(engine, token_drop=False).core.info()).render().decode()


def test_build_flag_config_round_trip_and_old_engines(engine, tmp_path):
    out = tmp_path / "token_drop"
    src = EngineConfig.load(engine)
    assert src.plan.knobs_of("token_drop") is None
    shutil.copytree(engine, out)
    cfg = json.loads((out / "config.json").read_text())
    assert "token_drop" not in cfg["plan"]["knobs"]  # off: absent (format 1 wrote null; older engines nothing)
    cfg["plan"]["knobs"]["token_drop"] = None
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineFormatError, match="token_drop"):  # format 2 has no null knobs: damaged
        EngineConfig.load(out)
    hf = engine.parent / "hf"
    rc = build_main(["--checkpoint", str(hf), "--output", str(tmp_path / "b"), "--dtype", "float32",
                     "--device", "cpu", "--quiet", "--token-drop", "p=0.98,block_size=32,min_prompt_len=0"])
    assert rc == 0
    knobs = EngineConfig.load(tmp_path / "b").plan.knobs_of("token_drop")
    assert knobs == TokenDropConfig(p=0.98, block_size=32, min_prompt_len=0)
    rc = build_main(["--checkpoint", str(hf), "--output", str(tmp_path / "c"), "--dtype", "float32",
                     "--device", "cpu", "--quiet", "--token-drop"])
    assert rc == 0 and EngineConfig.load(tmp_path / "c").plan.knobs_of("token_drop") == TokenDropConfig()
    # the default is the authors' schedule; engines from before the schedule knobs keep theirs:
    # every full-attention layer drops before its attention, dropped rows re-enter, their stored
    # spare_anchors (0 when it is absent: engines from before that knob)
    assert TokenDropConfig().drop_layers == "auto" and TokenDropConfig().drop_point == "after_attention"
    assert not TokenDropConfig().reenter
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["plan"]["knobs"]["token_drop"]["drop_layers"] == "auto"
    old = {"paper": dict(drop_layers="every", drop_point="before_attention", reenter=True)}
    for k in ("drop_layers", "drop_point", "reenter"):
        del cfg["plan"]["knobs"]["token_drop"][k]
    cfg["plan"]["knobs"]["token_drop"]["spare_anchors"] = 1
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    assert EngineConfig.load(tmp_path / "c").plan.knobs_of("token_drop") == TokenDropConfig(spare_anchors=1, **old["paper"])
    del cfg["plan"]["knobs"]["token_drop"]["spare_anchors"]
    (tmp_path / "c" / "config.json").write_text(json.dumps(cfg))
    assert EngineConfig.load(tmp_path / "c").plan.knobs_of("token_drop") == TokenDropConfig(spare_anchors=0, **old["paper"])
    assert token_drop_view(LLM(tmp_path / "c", token_drop=False))["knobs"] is None
    # an explicit list round-trips through config.json as a list (Llama: layers 0 and 2; Gemma: its globals)
    full = [lp.index for lp in src.plan.layers if lp.window is None][-2:]
    rc = build_main(["--checkpoint", str(hf), "--output", str(tmp_path / "d"), "--dtype", "float32", "--device",
                     "cpu", "--quiet", "--token-drop", f"drop_layers={full[1]}:{full[0]},reenter=true"])
    assert rc == 0 and json.loads((tmp_path / "d" / "config.json").read_text())["plan"]["knobs"]["token_drop"]["drop_layers"] == full
    assert EngineConfig.load(tmp_path / "d").plan.knobs_of("token_drop") == TokenDropConfig(drop_layers=tuple(full), reenter=True)


def test_retention_is_a_benchmark_setting_not_an_engine_knob(engine, tmp_path):
    """retention (rho) left the engine format: a new engine's config.json does not name it, one
    built before that still loads (the key ignored), a load naming it or an old short key gets
    the right name, and benchmarks force it on the runner (set_forced_retention, range-checked)."""
    from infhip.eval.common import EvalError

    rc = build_main(["--checkpoint", str(engine.parent / "hf"), "--output", str(tmp_path / "token_drop"), "--dtype",
                     "float32", "--device", "cpu", "--quiet", "--token-drop", "min_prompt_len=0"])
    assert rc == 0
    cfg = json.loads((tmp_path / "token_drop" / "config.json").read_text())
    assert "retention" not in cfg["plan"]["knobs"]["token_drop"]
    cfg["plan"]["knobs"]["token_drop"]["retention"] = 0.3  # as engines built before wrote it
    (tmp_path / "token_drop" / "config.json").write_text(json.dumps(cfg))
    assert EngineConfig.load(tmp_path / "token_drop").plan.knobs_of("token_drop") == TokenDropConfig(min_prompt_len=0)
    with pytest.raises(ValueError, match="benchmark setting"):
        LLM(engine, token_drop=dict(retention=0.3))
    with pytest.raises(ValueError, match="'G' is now called 'block_size'"):
        LLM(engine, token_drop=dict(G=8))
    llm = LLM(tmp_path / "token_drop")
    with pytest.raises(EvalError, match=r"retention must be in \[0, 1\]"):
        set_forced_retention(llm, 2.0)
    assert forced_retention(set_forced_retention(llm, 0.3)) == 0.3
    assert token_drop_view(llm)["selection"] == "forced_retention(rho=0.3)"  # TokenDrop.set_selection's read-out
    assert forced_retention(set_forced_retention(llm, None)) is None  # top-p again
    assert token_drop_view(llm)["selection"] is None
    with pytest.raises(EvalError, match="needs token drop"):
        set_forced_retention(LLM(engine), 0.3)


@pytest.mark.parametrize("spec,msg", [
    ("p=1.5", "p must be in"), ("q=3", "unknown key 'q'"), ("block_size=abc", "must be an integer"),
    ("p", "not key=value"), ("block_size=0", "block_size must be an int >= 1"), ("p=0.9,p=0.8", "given twice"),
    ("spare_anchors=-1", "spare_anchors must be an int >= 0"),
    ("drop_layers=some", "drop_layers must be 'auto', 'every' or layer indices"),
    ("drop_point=middle", "drop_point must be one of before_attention, after_attention"),
    ("reenter=maybe", "reenter='maybe' must be true or false"),
    # one name per knob: the old short keys say which name to use; retention is a benchmark setting
    ("G=32", "is now called 'block_size'"), ("min_len=0", "is now called 'min_prompt_len'"),
    ("rho=0.3", "benchmark setting"),
])
def test_bad_specs(spec, msg, capsys, tmp_path):
    with pytest.raises(ValueError, match=msg):
        parse_token_drop(spec)
    rc = build_main(["--checkpoint", str(tmp_path), "--output", str(tmp_path / "x"), "--token-drop", spec])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0 and msg.split("'")[0] in err


def test_drop_layers_must_be_full_attention_layers(engine):
    """An explicit drop layer that the model does not have as a full-attention layer is refused
    at load with the layers it could name; the API takes a list, the config a tuple."""
    arch = EngineConfig.load(engine).model.architecture
    bad, full = (7, [0, 1, 2]) if arch == "llama" else (2, [1, 4])  # Gemma layer 2 slides
    with pytest.raises(ValueError, match=rf"names \[{bad}\], which are not full-attention layers.*{full}"):
        LLM(engine, token_drop=dict(TINY, drop_layers=[bad]))
    with pytest.raises(ValueError, match="drop_layers is empty"):
        LLM(engine, token_drop=dict(TINY, drop_layers=[]))
    one = LLM(engine, token_drop=dict(TINY, drop_layers=[full[-1]]))
    assert token_drop_view(one)["drop_layers"] == [full[-1]]


def test_prompt_logprobs_of_a_dropping_prompt_are_refused_with_the_way_out(engine):
    """prompt_logprobs need every prompt position: a prompt that would drop is refused at
    add_request with what drops it and how to keep it whole; one under min_prompt_len is served."""
    llm = LLM(engine, token_drop=dict(TINY, min_prompt_len=64))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    with pytest.raises(ValueError, match="'token_drop'.*UniPrefill.*token_drop=False"):
        llm.generate(prompt_token_ids=[prompt(1, 200)], sampling_params=params)
    assert llm.debug_view()["requests"] == {}  # nothing queued
    out = llm.generate(prompt_token_ids=[prompt(2, 40)], sampling_params=params)[0]
    assert len(out.prompt_logprobs) == 40 and out.prompt_logprobs[0] is None and out.prompt_logprobs[1]


def test_drop_over_fp8_cache_tracks_the_float32_one(engine, tmp_path):
    """UniPrefill over an fp8 KV cache (two chunks: the second gathers the first's compacted keys
    from the fp8 cache; Gemma's sliding layers between anchors gather theirs) keeps nearly the
    same tokens as over a float32 cache (a later anchor's top-p boundary may move a few on fp8's
    error) and the prompt's logits stay within fp8's error of that run (3 % here, as without a
    drop; a cache read without its scales would be far off). Only the first logits: later greedy
    tokens of this random model may flip on fp8's error."""
    from pathlib import Path

    fp8 = build_engine(checkpoint=Path(engine).parent / "hf", output_dir=tmp_path / "fp8", dtype="float32",
                       kv_dtype="fp8", device="cpu", max_seq_len=256, max_batch_size=4, progress=False)
    ids = prompt(2, 200)
    logits, kept = [], []
    # Drops from the first full layers on (the authors' Llama rule): the deeper default rule drops
    # after more random layers, where fp8's error has moved more of this random model's near-tied scores.
    plan = EngineConfig.load(engine).plan
    full = [lp.index for lp in plan.layers if lp.window is None]
    drop = dict(TINY, drop_layers=list(default_drop_layers(full, len(plan.layers), AUTHORS_LLAMA_EIGHTHS)))
    for e in (engine, fp8):
        llm = set_forced_retention(LLM(e, max_num_batched_tokens=100, token_drop=drop), 0.3)
        kept_positions = record_kept_positions(llm)
        _, lg, sid = run_greedy(llm, ids, 1)
        logits.append(lg[0])
        kept.append({layer: torch.cat(chunks).tolist() for layer, chunks in kept_positions[sid].items()})
    assert llm.engine.model.layers[0].self_attn.kv.k.dtype == torch.float8_e4m3fn
    assert kept[1].keys() == kept[0].keys() and all(len(v) < 0.6 * len(ids) for v in kept[1].values())
    for layer, want in kept[0].items():  # the same drop, up to a few tokens at the boundary
        got = set(kept[1][layer])
        assert len(got & set(want)) >= 0.9 * len(got | set(want)), layer
    rel = ((logits[1] - logits[0]).norm() / logits[0].norm()).item()
    assert 1e-7 < rel < 0.1
