"""Presets in the engine: --preset round trip through config.json, the knobs of every preset,
validation, backward compatibility of dense engines, and the runtime's safe overrides."""

from __future__ import annotations

import dataclasses
import json

import pytest

from infhip.builder import cli as build_cli
from infhip.builder.presets import make_plan, preset_names
from infhip.config import EngineConfig, Plan
from infhip.methods.infinitehip import InfiniteHipConfig, PruningStage, infinitehip_config
from tests._tiny import write_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    write_tiny_hf_checkpoint(root / "llama", "llama")
    write_tiny_hf_checkpoint(root / "gemma3", "gemma3")
    return root


def test_preset_knobs():
    assert preset_names() == ("dense", "3k", "3k-fast", "3k-flash", "5k")
    c = infinitehip_config("3k")
    assert (c.n_sink, c.n_stream) == (256, 1024)
    assert c.stages == (PruningStage(64, 256, 32768), PruningStage(64, 32, 8192), PruningStage(64, 8, 2048))
    assert c.special_layers == (0, 1, 2) and c.special_final_k == 4096
    assert c.stages_of(1)[-1].k == 4096 and c.stages_of(3)[-1].k == 2048
    assert c.pruning_rope_of(0) == "chunk_indexed" and c.pruning_rope_of(5) == "relative"
    assert c.dense_threshold == 256 + 1024 + 32768
    assert [infinitehip_config(p).refresh_intervals for p in ("3k", "3k-fast", "3k-flash", "5k")] == [
        (16, 8, 4), (32, 16, 8), (96, 24, 8), (16, 8, 4)]
    five = infinitehip_config("5k")
    assert [(s.chunk_size, s.k) for s in five.stages] == [(64, 32768), (32, 16384), (16, 4096)]
    tiny = infinitehip_config("3k", dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)],
                                         special_final_k=16))
    assert tiny.dense_threshold == 4 + 8 + 32  # the rule follows overridden stages
    # never past the trained window (dense fails there and the sparse path must take over), but
    # a context filling it exactly stays dense: the first token past it is sparse
    assert infinitehip_config("3k", trained_window=8192).dense_threshold == 8193
    assert infinitehip_config("3k", trained_window=131072).dense_threshold == 256 + 1024 + 32768
    assert infinitehip_config("3k", dict(n_sink=4, n_stream=8, stages=[(8, 4, 32), (8, 2, 16), (8, 1, 8)],
                                         special_final_k=16), trained_window=20).dense_threshold == 21


@pytest.mark.parametrize("bad, needle", [
    (dict(refresh_intervals=(16, 6, 4)), "multiple"),
    (dict(refresh_intervals=(16, 8)), "refresh intervals for"),
    (dict(stages=[(64, 24, 48)], refresh_intervals=[4]), "power of two"),
    (dict(stages=[(64, 32, 100)], refresh_intervals=[4]), "multiple of chunk_size"),
    (dict(n_stream=32), "n_stream must be >= block_q"),
    (dict(special_final_k=16384), "exceeds"),
    (dict(attention_rope="relative"), "attention_rope"),
    (dict(chunk_score="mean"), "chunk_score"),
    (dict(query_strides=(4, 4)), "query strides for"),
    (dict(query_strides=(4, 0, 1)), r"query strides must be in \[1, block_q=64\]"),
    (dict(query_strides=(128, 4, 1)), "query strides must be in"),
    (dict(key_bank="False"), "key_bank must be true or false"),
    (dict(key_bank_slots=0), "key_bank_slots must be an integer >= 1"),
    (dict(key_bank_slots=True), "key_bank_slots must be an integer >= 1"),
])
def test_validation(bad, needle):
    with pytest.raises(ValueError, match=needle):
        InfiniteHipConfig().replace(**bad)


def test_cli_preset_round_trip(hf, tmp_path, capsys):
    for preset in preset_names():
        out = tmp_path / preset
        assert build_cli.main(["--checkpoint", str(hf / "gemma3"), "--output", str(out), "--device", "cpu",
                               "--preset", preset, "--quiet"]) == 0
        d = json.loads((out / "config.json").read_text())
        assert d["plan"]["preset"] == d["preset"]["name"] == preset
        plugins = [layer["backend"] for layer in d["plan"]["layers"]]
        types = json.loads((hf / "gemma3" / "config.json").read_text())["layer_types"]
        if preset == "dense":
            assert d["plan"]["knobs"] == {} and set(plugins) == {"dense"}
            continue
        # full-attention layers get InfiniteHiP, sliding ones stay dense
        assert plugins == ["infinitehip" if t == "full_attention" else "dense" for t in types]
        ih = d["plan"]["knobs"]["infinitehip"]
        window = json.loads((hf / "gemma3" / "config.json").read_text())["max_position_embeddings"]
        want = infinitehip_config(preset, trained_window=window)
        assert ih == json.loads(json.dumps(dataclasses.asdict(want)))  # every knob visible
        for key in ("n_sink", "n_stream", "stages", "refresh_intervals", "special_layers", "special_final_k",
                    "dense_threshold", "pruning_rope", "special_pruning_rope", "attention_rope",
                    "rope_off_in_trained_window"):
            assert key in ih
        assert EngineConfig.load(out).plan.knobs_of("infinitehip") == want


def test_dense_engine_without_infinitehip_key_loads(hf, tmp_path):
    out = tmp_path / "old"
    assert build_cli.main(["--checkpoint", str(hf / "llama"), "--output", str(out), "--device", "cpu", "--quiet"]) == 0
    d = json.loads((out / "config.json").read_text())
    # format 1 as written before InfiniteHiP existed: no plan.infinitehip, each layer's "plugin"
    d["format_version"] = 1
    d["plan"] = {"preset": "dense", "layers": [{**{k: v for k, v in lp.items() if k != "backend"}, "plugin": "dense"}
                                               for lp in d["plan"]["layers"]]}
    (out / "config.json").write_text(json.dumps(d))
    cfg = EngineConfig.load(out)
    assert cfg.plan.knobs_of("infinitehip") is None and cfg.format_version == 2
    assert cfg.plan == EngineConfig.load(out).plan.dense(cfg.model)


def test_infinitehip_config_from_an_engine_without_query_strides():
    """Engines written before query_strides existed load with the exact default (all 1)."""
    d = json.loads(json.dumps(dataclasses.asdict(infinitehip_config("3k"))))
    del d["query_strides"]
    assert InfiniteHipConfig.from_dict(d).query_strides == (1, 1, 1)
    # other stage counts get matching defaults unless strides are given
    assert InfiniteHipConfig().replace(stages=[(64, 32, 100 * 32)], refresh_intervals=[4]).query_strides == (1,)


def test_runtime_overrides():
    plan = Plan(preset="3k", layers=make_plan_layers(), knobs={"infinitehip": infinitehip_config("3k")})
    new = plan.at_load({"infinitehip": {"refresh_intervals": [32, 16, 8], "dense_threshold": 4096}}).knobs_of("infinitehip")
    assert new.refresh_intervals == (32, 16, 8) and new.dense_threshold == 4096
    strided = plan.at_load({"infinitehip": {"query_strides": [4, 4, 1]}}).knobs_of("infinitehip")
    assert strided.query_strides == (4, 4, 1)
    with pytest.raises(ValueError, match="rebuild"):
        plan.at_load({"infinitehip": {"n_sink": 8}})
    with pytest.raises(ValueError, match="multiple"):
        plan.at_load({"infinitehip": {"refresh_intervals": (16, 6, 4)}})
    dense = Plan(preset="dense", layers=tuple(dataclasses.replace(x, backend="dense") for x in plan.layers))
    with pytest.raises(ValueError, match="no infinitehip layers"):
        dense.at_load({"infinitehip": {"dense_threshold": 5}})


def make_plan_layers():
    from infhip.config import LayerPlan
    return tuple(LayerPlan(index=i, attention="global", window=None, backend="infinitehip",
                           rope_group="full_attention") for i in range(4))


def test_make_plan_refuses_overrides_for_dense(hf):
    from infhip.builder.hf_config import model_config_from_hf
    model, _ = model_config_from_hf(json.loads((hf / "llama" / "config.json").read_text()), "x")
    assert make_plan(model).knobs_of("infinitehip") is None
    with pytest.raises(ValueError, match="dense preset"):
        make_plan(model, "dense", {"n_sink": 4})
    with pytest.raises(ValueError, match="unknown preset"):
        make_plan(model, "7k")


def test_cli_infinitehip_knobs(hf, tmp_path, capsys):
    """infhip-build --infinitehip-overrides changes preset knobs at build time (the layers that keep the
    larger final budget, the stages); bad specs, unknown knobs, invalid values and layers past
    the model fail with one line naming the problem, and write nothing."""
    out = tmp_path / "special"
    stages = "[[16,32,256],[16,8,64],[16,4,32]]"
    assert build_cli.main(["--checkpoint", str(hf / "llama"), "--output", str(out), "--device", "cpu", "--quiet",
                           "--preset", "3k", "--infinitehip-overrides", f"special_layers=[0,1],stages={stages},special_final_k=48"
                           ]) == 0
    ih = EngineConfig.load(out).plan.knobs_of("infinitehip")
    assert ih.special_layers == (0, 1) and ih.special_final_k == 48
    assert ih.stages == (PruningStage(16, 32, 256), PruningStage(16, 8, 64), PruningStage(16, 4, 32))
    assert ih.stages_of(0)[-1].k == 48 and ih.stages_of(2)[-1].k == 32
    capsys.readouterr()
    for spec, needle in (("special_layers", "KEY=VALUE"), ("n_sinks=4", "unknown InfiniteHiP knob"),
                         ("special_final_k=5001", "special_final_k"), ("special_layers=[0,99]", "past the model")):
        bad = tmp_path / spec.split("=")[0]
        rc = build_cli.main(["--checkpoint", str(hf / "llama"), "--output", str(bad), "--device", "cpu", "--quiet",
                             "--preset", "3k", "--infinitehip-overrides", spec])
        err = capsys.readouterr().err
        assert rc == 1 and err.startswith("infhip-build: error:") and needle in err and "Traceback" not in err, err
        assert not bad.exists()
    rc = build_cli.main(["--checkpoint", str(hf / "llama"), "--output", str(tmp_path / "d"), "--device", "cpu",
                         "--quiet", "--infinitehip-overrides", "n_sink=4"])
    assert rc == 1 and "preset 'dense' does not run infinitehip" in capsys.readouterr().err


def test_engine_with_another_kv_dtype_is_refused_at_load(hf, tmp_path):
    """An engine whose KV dtype differs from its weights' (writable before the builder refused
    it) fails to load with the reason, instead of at the first attention call."""
    from infhip.config import EngineFormatError
    out = tmp_path / "kv"
    assert build_cli.main(["--checkpoint", str(hf / "llama"), "--output", str(out), "--device", "cpu", "--quiet"]) == 0
    d = json.loads((out / "config.json").read_text())
    d["build"]["kv_dtype"] = "float32" if d["build"]["dtype"] != "float32" else "bfloat16"
    (out / "config.json").write_text(json.dumps(d))
    with pytest.raises(EngineFormatError, match="differs from dtype"):
        EngineConfig.load(out)


def test_presets_fit_selectrep_query_tiles_into_shared_memory():
    """Under relative pruning RoPE a stride-1 stage's query tile of GQA 7 x head_dim 128
    (Qwen2.5-7B) or GQA 4 x 256 (Gemma-3-270m) does not fit an sm_90 block's shared memory (the
    compile matrix refuses it): the preset takes stride 2 there; Llama-8B and Qwen2.5-0.5B keep
    4, 4, 1, and strides a user gives are kept (the build then names the kernel that cannot fit)."""
    from infhip.builder.matrix_configs import _model_config
    from infhip.methods.infinitehip import InfiniteHip

    strides = {m: InfiniteHip.preset_knobs("3k", _model_config(m)).query_strides
               for m in ("qwen2.5-7b", "gemma-3-270m", "llama-3.1-8b", "qwen2.5-coder-0.5b")}
    assert strides == {"qwen2.5-7b": (4, 4, 2), "gemma-3-270m": (4, 4, 2), "llama-3.1-8b": (4, 4, 1),
                       "qwen2.5-coder-0.5b": (4, 4, 1)}
    given = InfiniteHip.preset_knobs("3k", _model_config("qwen2.5-7b"), {"query_strides": (4, 4, 1)})
    assert given.query_strides == (4, 4, 1)
    inside = InfiniteHip.preset_knobs("3k", _model_config("qwen2.5-7b"), {"pruning_rope": "chunk_indexed"})
    assert inside.query_strides == (4, 4, 1)  # chunk-indexed: one query tile, it fits
