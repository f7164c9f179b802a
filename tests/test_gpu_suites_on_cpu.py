"""Every GPU suite's Python entry points on the CPU at tiny sizes: a suite that cannot start on the
GPU because of our own Python fails here instead of costing a device call.

The `python3 -m MODULE ARGS` commands are read from benchmarks/gpu/suites/SUITE.sh itself (line
continuations joined, the suite's own NAME=value assignments and $OUT expanded, "$@" dropped), so
the flags tested are the flags the suite passes. Each command then runs in a fresh process with:
- the module's tiny flags from TINY appended (argparse keeps the last value: `--smoke` makes the
  benchmark a tiny random engine on the CPU, benchmarks/speed/tiny.py);
- `--device cuda` read as `--device cpu`, and paths under /tmp moved into the test's folder;
- `infhip.builder.cli --model M` built from M's tiny config instead (the same builder flags).
It must exit 0 and every JSON it writes under $OUT must hold finite numbers, some positive, and no
"error". A module missing from TINY fails the test: a new suite line needs its tiny mode.
window.sh and quality.sh (the quality tools) are covered by their own tests.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "benchmarks" / "gpu" / "suites"
ELSEWHERE = {"window", "quality"}  # their own tests (the quality tools)

# module -> (flags appended to the suite's, env overrides). "--smoke": the shared tiny mode.
SMOKE = (["--smoke"], {})
TINY: dict[str, tuple[list[str], dict]] = {
    "benchmarks.speed.bench_token_drop": SMOKE,
    "benchmarks.speed.bench_decode_e2e": SMOKE,
    "benchmarks.speed.bench_prefix_cache": (["--smoke", "--follow-ups", "2", "--in-place-follow-ups", "1"], {}),
    "benchmarks.speed.ttft_breakdown": (["--smoke", "--weights", "fp8"], {}),  # bf16: tests/test_ttft_breakdown.py
    "benchmarks.speed.bench_offload": SMOKE,
    "benchmarks.speed.bench_cold_start": SMOKE,  # 2 infhip-build and 2 LLM processes: ~19 s CPU
    "benchmarks.speed.bench_infinitehip": SMOKE,  # one layer, 4 q / 2 kv heads: every step type, variant, prefill
    "benchmarks.speed.bench_dense_llama8b": SMOKE,  # beside transformers; no graph replay / profile / split sweep
    # NOT_RUN below (argparse only)
    "benchmarks.speed.token_drop_ttft": SMOKE,
    "benchmarks.peers.bench_vs_vllm": SMOKE,
    "benchmarks.speed.bench_constants": SMOKE,  # torch references: interpreted, its kernels take ~60 s CPU
    # checks each GEMV launch configuration: the interpreter on the CPU (asserted by its --smoke)
    "benchmarks.speed.bench_fp8_weights": (["--smoke"], {"TRITON_INTERPRET": "1"}),
    # take the engine the suite built before them (tiny here): only fewer tokens
    "benchmarks.speed.bench_sampling": (["--tokens", "4", "--repeats", "1"], {}),
    "benchmarks.speed.bench_structured_decode": (["--tokens", "4", "--repeats", "1"], {}),
    "benchmarks.speed.bench_serving": (["--clients", "2", "--prompt-tokens", "16", "--max-tokens", "4"], {}),
    "benchmarks.gpu.smoke": (["--smoke", "--only", "3k-flash-fp8"], {}),  # 1 of its 7 cases: sparse, fp8, sampling
    "infhip.builder.cli": ([], {}),
    "benchmarks.parity.infinitehip": ([], {}),  # NOT_RUN here
}
# --smoke runs the same work whatever else the suite passes (bench_fp8_weights: the GEMV sweep): a
# full run in the suite named, argparse only in the others
ONCE = {"benchmarks.speed.bench_fp8_weights": "fp8-decode"}
# (suite, module) -> why that command does not run here
# Those get only the import and the suite's flags through their argparse parser (parse_only).
NOT_RUN = {
    ("token-drop-qwen", "benchmarks.parity.infinitehip"): "the parity harness: tested with the quality tools",
    ("token-drop-qwen", "benchmarks.speed.token_drop_ttft"): "needs the staged Qwen engine and RULER data",
    ("vllm", "benchmarks.peers.bench_vs_vllm"): "needs vLLM; its --dry-run (our side only) takes 43 s CPU",
}

_ASSIGN = re.compile(r'^\s*(?:export\s+)?([A-Za-z_]\w*)=("[^"]*"|[^\s;]*)', re.M)
COMPUTED = "600"  # a NAME=$(...) of a suite (its deadlines, in seconds): the device call's limit
_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")
_STOP = {"2>&1", "|", ">", ";", "&&", "||", "&", "2>", ">>"}


def entry_points(suite: Path, out: Path) -> list[tuple[str, list[str]]]:
    """(module, argv) of every `python3 -m` command of the suite, in order, variables expanded."""
    text = re.sub(r"\\\n\s*", " ", suite.read_text())
    text = re.sub(r"<<'EOF'.*?^EOF$", "", text, flags=re.S | re.M)  # inline Python, run by its suite
    env = {name: COMPUTED if value.startswith("$(") else value.strip('"') for name, value in _ASSIGN.findall(text)}
    env.update(OUT=str(out))
    every: dict[str, list[str]] = {}
    for name, value in re.findall(r'(?:^|[\s)])([A-Za-z_]\w*)=("[^"]*"|[^\s;]*)', text):  # `case` arms too
        every.setdefault(name, []).append(value.strip('"'))

    def expand(s: str, depth: int = 0) -> str:
        def one(m):
            name = m.group(1) or m.group(3)
            default = m.group(2) if m.group(2) is not None else ("1" if name.isdigit() else "")  # a function's $1
            value = env.get(name, default)
            return expand(value, depth + 1) if depth < 5 else value
        return _VAR.sub(one, s)

    cmds = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(r'python3 -m ("?\$?[\w.]+"?)(.*)', line):
            module = m.group(1).strip('"')
            if module in ("pip", "pytest", "zipfile", "infhip.eval.stage"):
                continue  # the installs, the GPU-marked tests, the staging: not our entry points
            words = shlex.split(expand(m.group(2).replace('"$@"', "")), comments=True)
            argv = []
            for w in words:
                if w in _STOP or w.startswith((">", "2>")):
                    break
                argv.append(w)
            # `python3 -m "$module"`: every module the suite assigns to that name (bench.sh's case)
            for name in every.get(module[1:], []) if module.startswith("$") else [module]:
                cmds.append((name, argv))
    return cmds


def inline_python(suite: Path) -> list[tuple[str, list[str]]]:
    """(code, argv) of each `python3 - ARGS <<'EOF' ... EOF` of the suite (its summaries); argv as
    in entry_points ($OUT is the only variable they take)."""
    return [(m.group(2), shlex.split(m.group(1)))
            for m in re.finditer(r"^python3 - (.*?) <<'EOF'\n(.*?)^EOF$", suite.read_text(), flags=re.S | re.M)]


def localize(module: str, argv: list[str], tmp: Path) -> list[str]:
    """The suite's argv for this machine: --device cpu, /tmp paths in tmp, tiny builder inputs."""
    out = []
    for i, w in enumerate(argv):
        if i and argv[i - 1] == "--device" and w == "cuda":
            w = "cpu"
        elif w.startswith("/tmp/") and not w.startswith(str(tmp)):
            w = str(tmp / w[len("/tmp/"):])
        out.append(w)
    if module == "infhip.builder.cli" and "--model" in out:  # its architecture, tiny, with a tokenizer
        from infhip.builder.tiny_checkpoint import write_tiny_hf_checkpoint
        i = out.index("--model")
        arch = next(a for p, a in (("qwen", "qwen2"), ("llama", "llama"), ("gemma", "gemma3"), ("mistral", "mistral"))
                    if out[i + 1].startswith(p))
        write_tiny_hf_checkpoint(tmp / f"tiny-{arch}", arch, tokenizer=True)
        out[i:i + 2] = ["--checkpoint", str(tmp / f"tiny-{arch}"), "--dtype", "float32"]
    return out


def _child_cpu_s() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class _Parsed(Exception):
    """Raised once the module's parser accepted argv: the run stops before any work."""


def parse_only(module: str, argv: list[str]) -> None:
    """Import the module and put argv through its argparse parser (unknown flags and bad values
    fail as they would on the GPU machine), then stop."""
    import argparse
    import runpy
    from unittest import mock
    full = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        full(self, args, namespace)
        raise _Parsed

    with mock.patch.object(sys, "argv", [module, *argv]), \
            mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
        except _Parsed:
            return
        except SystemExit as e:
            pytest.fail(f"{module} {shlex.join(argv)}: its parser exited {e.code}")
    pytest.fail(f"{module} never parsed its arguments")


def _numbers(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            assert k not in ("error", "load_error") or not v, f"{path}/{k}: {str(v)[:800]}"
            yield from _numbers(v, f"{path}/{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, x


def _json_stamps(out: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in out.rglob("*.json")}


def check_json(out: Path) -> int:
    """Every JSON under out: finite numbers, some positive, no error. Returns how many files."""
    files = sorted(out.rglob("*.json"))
    for f in files:
        nums = list(_numbers(json.loads(f.read_text()), f.name))
        bad = [(p, v) for p, v in nums if not math.isfinite(v)]
        assert not bad, f"{f}: not finite: {bad[:5]}"
        assert any(v > 0 for _, v in nums), f"{f}: no positive number"
    return len(files)


SUITE_NAMES = sorted(p.stem for p in SUITES.glob("*.sh") if p.stem not in ELSEWHERE)


def test_every_suite_is_read():
    """The parser finds the entry points (a suite edit that hides them fails here, not silently)."""
    found = {s: [m for m, _ in entry_points(SUITES / f"{s}.sh", Path("/o"))] for s in SUITE_NAMES}
    assert found["headline"].count("benchmarks.speed.bench_infinitehip") == 2
    assert "benchmarks.speed.bench_serving" in found["strict"] and "infhip.builder.cli" in found["strict"]
    missing = {s: m for s, ms in found.items() for m in ms if m not in TINY}
    assert not missing, f"entry points without a tiny mode in TINY: {missing}"
    empty = [s for s, ms in found.items() if not ms]
    assert not empty, f"suites with no python3 -m entry point found: {empty}"


def _env(**over: str) -> dict:
    # "0": the plugins' torch references; one thread: CI's two workers share two cores
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", **over}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


@pytest.fixture(scope="module")
def runner():
    """tests/_fork_runner.py: the entry points forked from one process with torch and infhip imported."""
    proc = subprocess.Popen([sys.executable, "-m", "tests._fork_runner"], cwd=ROOT, env=_env(), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


def run_entry(runner, module: str, args: list[str], env_over: dict, cwd: Path, log: Path) -> tuple[int, float]:
    """(exit status, CPU seconds) of `python -m module args`, its output in log."""
    if env_over:  # an env the runner's imports did not see: a process of its own
        cpu = _child_cpu_s()
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=_env(**env_over), stdout=f,
                                stderr=subprocess.STDOUT, timeout=300).returncode
        return rc, _child_cpu_s() - cpu
    runner.stdin.write(json.dumps(dict(module=module, argv=args, env={}, cwd=str(cwd), log=str(log))) + "\n")
    runner.stdin.flush()
    ready, _, _ = select.select([runner.stdout], [], [], 300)
    if not ready:
        runner.kill()
        pytest.fail(f"python -m {module} {shlex.join(args)}: no end after 300 s")
    reply = json.loads(runner.stdout.readline())
    return reply["rc"], reply["cpu_s"]


@pytest.mark.parametrize("suite", SUITE_NAMES)
def test_suite_entry_points_on_cpu(suite, tmp_path, runner):
    out = tmp_path / "out"
    out.mkdir()
    ran, parsed = 0, 0
    for module, argv in entry_points(SUITES / f"{suite}.sh", out):
        if (suite, module) in NOT_RUN or ONCE.get(module, suite) != suite:
            parse_only(module, localize(module, argv, tmp_path))
            parsed += 1
            continue
        flags, env_over = TINY[module]
        args = localize(module, argv, tmp_path) + flags
        log = tmp_path / f"{ran + parsed}-{module}.log"
        t, before = time.perf_counter(), _json_stamps(out)
        rc, cpu = run_entry(runner, module, args, env_over, tmp_path, log)
        assert rc == 0, f"{suite}: python -m {module} {shlex.join(args)} exited {rc}\n{log.read_text()[-5000:]}"
        print(f"{suite}: {module} {time.perf_counter() - t:.1f} s wall, {cpu:.1f} s CPU")  # pytest -s
        if module != "infhip.builder.cli":  # (the builder writes an engine, no results)
            assert _json_stamps(out) != before, f"{suite}: python -m {module} {shlex.join(args)} wrote no JSON"
        ran += 1
    for i, (code, argv) in enumerate(inline_python(SUITES / f"{suite}.sh")):  # the summaries, on what ran
        script, log = tmp_path / f"inline{i}.py", tmp_path / f"inline{i}.log"
        script.write_text(code)
        args = [str(out) if a in ('"$OUT"', "$OUT") else a for a in argv]
        runner.stdin.write(json.dumps(dict(module="", path=str(script), argv=args, env={}, cwd=str(ROOT),
                                           log=str(log))) + "\n")
        runner.stdin.flush()
        reply = json.loads(runner.stdout.readline())
        assert reply["rc"] == 0, (f"{suite}: its inline python3 - {shlex.join(args)} exited {reply['rc']}\n"
                                  f"{log.read_text()[-5000:]}")
        print(f"{suite}: inline python {reply['cpu_s']} s CPU\n{log.read_text()[-1500:]}")
        ran += 1
    assert ran or parsed, f"{suite}: no entry point"
    if ran:
        check_json(out)
