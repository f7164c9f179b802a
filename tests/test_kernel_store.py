"""The runtime's kernel store (runtime/kernel_store.py) on CPU: an engine's kernels/ folder is
verified at load (target, Triton version, SM count, every file's sha256) with one-line errors,
the JIT policy refuses / warns / allows a variant the engine does not hold, and Triton's cache
lookups of an engine's variant are served from the engine folder. (Launching from the store is
checked on the GPU: tests/test_gpu_aot.py.)"""

from __future__ import annotations

import json
import logging
import shutil
import types

import pytest
import torch
import triton

from infhip.builder.kernels import INDEX_FORMAT, compile_variants
from infhip.config import EngineFormatError
from infhip.plugins.aot import Target, record
from infhip.plugins.rms_norm import rms_norm
from infhip.runtime import kernel_store
from infhip.runtime.kernel_store import EngineKernelCache, JitForbidden, open_store


def _record_norm(n: int, residual: bool):
    x = torch.empty(3, n, dtype=torch.bfloat16, device="meta")
    w = torch.empty(n, dtype=torch.float32, device="meta")
    with record(Target()) as rec:
        rms_norm(x, w, 1e-6, residual=x if residual else None)
    [(variant, packed)] = rec.packed.items()
    return variant, packed


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An engine folder whose kernels/ holds one compiled rms_norm variant (sm_90)."""
    engine = tmp_path_factory.mktemp("store")
    variant, packed = _record_norm(256, residual=False)
    [entry] = compile_variants([variant], Target(), engine / "kernels", jobs=1)
    index = {"format": INDEX_FORMAT, "target": "sm_90", "num_sms": 132, "triton": triton.__version__,
             "kernels": [entry]}
    (engine / "kernels" / "index.json").write_text(json.dumps(index))
    return engine, variant, packed


@pytest.fixture
def engine(built, tmp_path):
    root = tmp_path / "engine"
    shutil.copytree(built[0], root)
    return root


def _hook_args(packed):
    """What Triton's pre-compile hook receives for a variant (JITFunction._call_hook)."""
    jit, signature, constexprs, attrs, options = packed
    return types.SimpleNamespace(jit_function=jit), dict(
        signature=signature, constants=constexprs, configs=[attrs], num_warps=options.num_warps,
        num_stages=options.num_stages, num_ctas=options.num_ctas)


class Owner:
    pass


def test_store_serves_its_variant_and_forbids_others(engine, built):
    owner = Owner()
    store = open_store(engine, "sm_90", "forbid", owner, num_sms=132)
    assert store.num_files >= 2 and store.num_bytes > 0
    _, other = _record_norm(512, residual=True)
    with kernel_store.serving(store):
        kernel_store._check_variant(*_hook_args(built[2]))  # the engine's own variant: no error
        with pytest.raises(JitForbidden, match="_rms_norm_kernel.*BLOCK_N=512.*rebuild"):
            kernel_store._check_variant(*_hook_args(other))
    kernel_store._check_variant(*_hook_args(other))  # outside the engine's steps: Triton's usual JIT
    # Triton's cache lookup of the engine's hash comes from the engine folder
    folder = next(p for p in (engine / "kernels").iterdir() if p.is_dir())
    group = EngineKernelCache(folder.name).get_group("_rms_norm_kernel.json")
    assert group and all(str(folder) in path for path in group.values())
    assert any(name.endswith(".cubin") for name in group)
    del owner  # the store goes with its engine: Triton no longer looks there
    assert EngineKernelCache(folder.name)._engine_dir is None


def test_warn_mode_logs_once(engine, caplog):
    owner = Owner()
    store = open_store(engine, "sm_90", "warn", owner, num_sms=132)
    _, other = _record_norm(1024, residual=True)
    kernel_store._warned.discard("infhip.plugins.rms_norm:_rms_norm_kernel")
    with caplog.at_level(logging.WARNING, logger="infhip.kernels"), kernel_store.serving(store):
        kernel_store._check_variant(*_hook_args(other))
        kernel_store._check_variant(*_hook_args(other))
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "compiling _rms_norm_kernel while serving" in caplog.records[0].message


@pytest.mark.parametrize("damage, message", [
    ("corrupt", "is corrupt \\(sha256 mismatch\\); rebuild"),
    ("missing", "is missing; rebuild"),
    ("triton", "compiled by Triton 0.0.1 but this is Triton"),
    ("sms", "enumerated for a 132-SM sm_90, this GPU has 114 SMs"),
    ("target", "is for sm_80 but config.json says sm_90"),
    ("index", "index.json cannot be read"),
])
def test_damaged_store_is_one_line_error(engine, damage, message):
    index_path = engine / "kernels" / "index.json"
    index = json.loads(index_path.read_text())
    cubin = next((engine / "kernels").glob("*/*.cubin"))
    num_sms = 114 if damage == "sms" else 132
    if damage == "corrupt":
        data = bytearray(cubin.read_bytes())
        data[len(data) // 2] ^= 0xFF
        cubin.write_bytes(bytes(data))
    elif damage == "missing":
        cubin.unlink()
    elif damage == "triton":
        index["triton"] = "0.0.1"
    elif damage == "target":
        index["target"] = "sm_80"
    elif damage == "index":
        index_path.write_text("{")
    if damage in ("triton", "target"):
        index_path.write_text(json.dumps(index))
    with pytest.raises(EngineFormatError, match=message) as err:
        open_store(engine, "sm_90", "forbid", Owner(), num_sms=num_sms)
    assert "\n" not in str(err.value)


def test_allow_mode_accepts_another_triton(engine):
    index_path = engine / "kernels" / "index.json"
    index = json.loads(index_path.read_text())
    index["triton"] = "0.0.1"
    index_path.write_text(json.dumps(index))
    assert open_store(engine, "sm_90", "allow", Owner(), num_sms=132) is not None


def test_engine_without_kernels(engine, caplog):
    (engine / "kernels" / "index.json").write_text(json.dumps({"target": "sm_90", "kernels": []}))
    with pytest.raises(EngineFormatError, match="holds no compiled kernels"):
        open_store(engine, "sm_90", "forbid", Owner(), num_sms=132)
    with caplog.at_level(logging.WARNING, logger="infhip.kernels"):
        assert open_store(engine, "sm_90", "warn", Owner(), num_sms=132) is None
    assert "compile on first use" in caplog.text


def test_jit_mode_from_env(monkeypatch):
    monkeypatch.setenv("INFHIP_JIT", "forbid")
    assert kernel_store.jit_mode(None) == "forbid" and kernel_store.jit_mode("allow") == "allow"
    with pytest.raises(ValueError, match="jit must be one of forbid, warn, allow"):
        kernel_store.jit_mode("never")


_ROUND_TRIP = '''
import torch
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.compiler import ASTSource, make_backend
from triton.runtime.cache import get_cache_key
from infhip.plugins import aot
from infhip.plugins.rms_norm import rms_norm
target = aot.Target()
x = torch.empty(5, 4096, dtype=torch.bfloat16, device="meta")
w = torch.empty(4096, dtype=torch.float32, device="meta")
with aot.record(target) as rec:
    rms_norm(x, w, 1e-6)
    rms_norm(x[:, :2048], w[:2048], 1e-6, residual=x[:, :2048])
backend = make_backend(target.gpu_target())
for variant, packed in rec.packed.items():
    keys = {get_cache_key(ASTSource(fn, sig, ce, at), backend, backend.parse_options(op.__dict__),
                          get_cache_invalidating_env_vars())
            for fn, sig, ce, at, op in (packed, aot._unpack(variant, target))}
    assert len(keys) == 1, variant.describe()
print("OK", len(rec.packed))
'''


def test_variant_round_trips_to_tritons_cache_key():
    """A variant rebuilt from its index text (what the builder's worker processes compile) gets
    the cache key Triton computes for the launch itself: the engine's binary is found, not
    recompiled. (Triton hashes the attrs dict as text: order and empty entries matter.)"""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _ROUND_TRIP], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK 2" in proc.stdout, proc.stdout + proc.stderr[-3000:]
