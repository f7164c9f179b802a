"""One source of defaults (issue 23): InfiniteHipConfig() is preset 3k and the other presets are
differences from it; the knobs a load may change are marked in the config; one name per knob;
LLM's options are one typed object whose fields are the flags of infhip-run / infhip-serve /
infhip-eval; docs/knobs.md is generated from the metadata and kept in sync."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from infhip.methods import methods
from infhip.methods.infinitehip import PRESET_CHANGES, RUNTIME_KNOBS, InfiniteHipConfig, infinitehip_config
from infhip.methods.token_drop import TokenDropConfig, parse_token_drop_knobs
from infhip.runtime.options import LoadOptions, load_options, parse_size

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_preset_3k_and_presets_are_differences():
    assert InfiniteHipConfig() == infinitehip_config("3k")
    base = dataclasses.asdict(InfiniteHipConfig())
    for preset, changes in PRESET_CHANGES.items():
        cfg = dataclasses.asdict(infinitehip_config(preset))
        assert {k for k in base if cfg[k] != base[k]} <= set(changes), preset
    # the builder's dense_threshold rule reads the config's numbers (no second copy of them)
    d = InfiniteHipConfig()
    assert d.dense_threshold == d.n_sink + d.n_stream + d.stages[0].k


def test_runtime_knobs_are_marked_in_the_config():
    assert set(RUNTIME_KNOBS) == {"refresh_intervals", "dense_threshold", "rope_off_in_trained_window",
                                  "stagger_refresh", "chunk_score", "query_strides", "key_bank", "key_bank_slots"}
    for cls in (InfiniteHipConfig, TokenDropConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata["doc"] and f.metadata["measured"], f"{cls.__name__}.{f.name} needs doc and measured"


def test_old_engines_keep_the_knob_values_they_ran_with():
    """Absent knobs read as what engines ran before they existed, not as today's defaults."""
    d = json.loads(json.dumps(dataclasses.asdict(infinitehip_config("3k"))))
    del d["key_bank"], d["query_strides"]
    old = InfiniteHipConfig.from_dict(d)
    assert old.key_bank is False and old.query_strides == (1, 1, 1)


def test_the_runtime_does_not_import_the_builder():
    code = ("import sys, infhip.runtime.llm, infhip.runtime.cli, infhip.runtime.server, infhip.runtime.options; "
            "bad = sorted(m for m in sys.modules if m.startswith('infhip.builder')); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("spec, needle", [
    ("G=8", "'G' is now called 'block_size'"), ("n=8", "now called 'obs_window'"), ("A=8", "now called 'num_sink'"),
    ("min_len=0", "now called 'min_prompt_len'"), ("spare=0", "now called 'spare_anchors'"),
    ("rho=0.3", "benchmark setting"), ("retention=0.3", "benchmark setting"),
])
def test_old_token_drop_names_are_errors_naming_the_field(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_token_drop_knobs(spec)
    key = spec.split("=")[0]
    with pytest.raises(ValueError, match=needle):
        TokenDropConfig().replace(**{key: 0})
    with pytest.raises(ValueError, match=needle):
        LoadOptions.of(token_drop={key: 0})


def _parsers():
    from infhip.eval.cli import build_parser
    from infhip.runtime.cli import make_parser as run_parser
    from infhip.runtime.server import make_parser as serve_parser
    return {"infhip-run": run_parser(), "infhip-serve": serve_parser(), "infhip-eval": build_parser()}


def test_every_load_option_is_a_flag_of_the_same_name():
    import inspect

    from infhip.runtime.llm import LLM

    assert list(inspect.signature(LLM).parameters)[:2] == ["engine_dir", "options"]
    for name, parser in _parsers().items():
        flags = set(re.findall(r"--[a-z0-9-]+", parser.format_usage()))  # every option string, once
        for f in dataclasses.fields(LoadOptions):
            if f.metadata["kind"] == "methods":  # a flag per plan method (its build flag's name)
                for m in methods():
                    assert m.flag() in flags, f"{name} has no flag for the {m.name} overrides"
                continue
            assert "--" + f.name.replace("_", "-") in flags, f"{name} has no flag for LoadOptions.{f.name}"


def test_flags_build_the_same_options_as_keywords():
    parser = _parsers()["infhip-run"]
    args = parser.parse_args(["--engine", "e", "--prompt", "x", "--max-num-seqs", "4", "--kv-offload-bytes", "2GiB",
                              "--kv-cache-memory-bytes", "512MiB", "--enforce-eager", "--num-decode-steps", "3",
                              "--infinitehip-overrides", "chunk_score=head_normalized,refresh_intervals=[32,16,8]",
                              "--token-drop", "p=0.98,min_prompt_len=4096", "--jit", "forbid", "--device", "cpu"])
    assert load_options(args) == LoadOptions.of(
        device="cpu", max_num_seqs=4, kv_offload_bytes=2 << 30, kv_cache_memory_bytes=512 << 20, enforce_eager=True,
        num_decode_steps=3, infinitehip_overrides={"chunk_score": "head_normalized", "refresh_intervals": [32, 16, 8]},
        token_drop={"p": 0.98, "min_prompt_len": 4096}, jit="forbid")
    assert load_options(args).overrides == {"infinitehip": {"chunk_score": "head_normalized",
                                                            "refresh_intervals": [32, 16, 8]},
                                            "token_drop": {"p": 0.98, "min_prompt_len": 4096}}
    off = load_options(parser.parse_args(["--engine", "e", "--prompt", "x", "--token-drop", "off"]))
    assert off.override("token_drop") is False and off == LoadOptions(overrides={"token_drop": False})
    assert load_options(parser.parse_args(["--engine", "e", "--prompt", "x"])) == LoadOptions()
    with pytest.raises(ValueError, match="--kv-offload-bytes"):
        load_options(parser.parse_args(["--engine", "e", "--prompt", "x", "--kv-offload-bytes", "lots"]))


@pytest.mark.parametrize("old, new", [("--kv-offload-gib", "--kv-offload-bytes"),
                                      ("--kv-cache-gib", "--kv-cache-memory-bytes"),
                                      ("--infinitehip", "--infinitehip-overrides")])
def test_renamed_flags_name_the_new_one(old, new, capsys):
    required = {"infhip-run": ["--engine", "e", "--prompt", "x"], "infhip-serve": ["--engine", "e"],
                "infhip-eval": ["ppl", "--engine", "e"]}
    for name, parser in _parsers().items():
        with pytest.raises(SystemExit):
            parser.parse_args(required[name] + [old, "1"])
        assert new in capsys.readouterr().err, name


@pytest.mark.parametrize("bad, needle", [
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(num_decode_steps=0), "num_decode_steps must be an integer >= 1"),
    (dict(kv_offload_bytes=-1), "kv_offload_bytes must be an integer >= 0"),
    (dict(kv_cache_memory_bytes=1.5), "kv_cache_memory_bytes must be an integer"),
    (dict(enforce_eager="yes"), "enforce_eager must be true or false"),
    (dict(jit="sometimes"), "jit must be one of"),
    (dict(infinitehip_overrides={"n_sink": 8}), "needs a rebuild"),
    (dict(token_drop={"p": 2.0}), "p must be in"),
    (dict(overrides={"nope": {}}), "no plan method 'nope'"),
])
def test_load_options_validate(bad, needle):
    with pytest.raises(ValueError, match=needle):
        LoadOptions.of(**bad)


def test_unknown_llm_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unknown load option"):
        LoadOptions.of(kv_offload_gib=1)
    assert LoadOptions.of(LoadOptions(max_num_seqs=2), enforce_eager=True) == LoadOptions(max_num_seqs=2,
                                                                                           enforce_eager=True)


def test_parse_size():
    assert parse_size("8GiB") == 8 << 30 and parse_size("8g") == 8 << 30 and parse_size("0.5 MiB") == 1 << 19
    assert parse_size("1024") == 1024 and parse_size("2KiB") == 2048 and parse_size("1T") == 1 << 40
    for bad in ("", "lots", "-1", "5QiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_knobs_doc_is_up_to_date_and_its_links_resolve():
    import re

    from infhip.knobs_doc import markdown
    text = markdown()
    assert (ROOT / "docs" / "knobs.md").read_text() == text, \
        "docs/knobs.md is out of date: python -m infhip.knobs_doc > docs/knobs.md"

    def slug(heading: str) -> str:  # GitHub's anchors
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    for path, anchor in sorted(set(re.findall(r"\]\(([\w./-]+\.md)(?:#([\w-]+))?\)", text))):
        target = ROOT / "docs" / path
        assert target.is_file(), f"docs/knobs.md links a missing {path}"
        headings = [line.lstrip("#") for line in (text if path == "knobs.md" else target.read_text()).splitlines()
                    if line.startswith("#")]
        assert not anchor or anchor in {slug(h) for h in headings}, f"docs/knobs.md links {path}#{anchor}: no such heading"
