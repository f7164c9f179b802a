"""The shared layer holds: what the builder, the runtime and their clients all read stays torch-free
and imports neither side.

The rule. The shared layer is the package root `infhip/__init__.py`, every module directly in
`infhip/` and every module in `infhip/methods/`, a method's folder included except its `runtime/`
subfolder, the method's runtime side (found from the tree, so a new module there is under the rule
at once; `infhip/eval/` is a client of the runtime, not shared). Importing any of them, and
loading the plan methods' registry (`infhip.methods.methods()`), in a fresh interpreter loads none of
`torch`, `triton`, `numpy`, `infhip.runtime`, `infhip.builder`, `infhip.plugins`, `infhip.eval`.
And no shared module imports those anywhere in its code, function bodies included, except the
deferred imports listed in DEFERRED with why (a listed one that is gone fails too: the list only
shrinks).
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("torch", "triton", "numpy", "infhip.runtime", "infhip.builder", "infhip.plugins", "infhip.eval")

# (shared module, what it imports inside a function): the one place each is allowed, and why.
DEFERRED = {
    ("infhip", "infhip.runtime"): "the package root's public API (`from infhip import LLM`), resolved on first use",
    ("infhip.knobs_doc", "infhip.runtime"): "docs/knobs.md's load-option table reads runtime/options.py's flags",
}


def shared_modules() -> dict[str, Path]:
    out = {"infhip": ROOT / "infhip" / "__init__.py"}
    methods = ROOT / "infhip" / "methods"
    folders = [(ROOT / "infhip", "infhip"), (methods, "infhip.methods")]
    folders += [(d, f"infhip.methods.{d.name}") for d in sorted(methods.iterdir()) if (d / "__init__.py").is_file()]
    for folder, package in folders:
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _forbidden(name: str) -> str | None:
    return next((f for f in FORBIDDEN if name == f or name.startswith(f + ".")), None)


def imports_of(module: str, path: Path) -> set[tuple[str, str]]:
    """(module, forbidden package) for each import of one, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {(module, f) for n in names if (f := _forbidden(n))}
    return out


def test_the_shared_layer_is_what_the_rule_says():
    found = shared_modules()
    assert {"infhip", "infhip.config", "infhip.methods", "infhip.methods.method", "infhip.knobs_doc",
            "infhip.methods.infinitehip", "infhip.methods.token_drop.knobs"} <= set(found)
    assert not any(m.startswith("infhip.eval") or ".runtime" in m for m in found)


def test_no_shared_module_imports_torch_or_a_side():
    found = set().union(*(imports_of(m, p) for m, p in shared_modules().items()))
    assert found <= set(DEFERRED), f"shared modules importing {sorted(found - set(DEFERRED))}: move the code to its side"
    assert set(DEFERRED) <= found, f"{sorted(set(DEFERRED) - found)} no longer imported: take them out of DEFERRED"


# Run in a fresh interpreter: argv[1] the modules, argv[2] the forbidden packages (JSON lists).
IMPORT_EACH = """
import importlib, json, sys
modules, forbidden = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def bad():  # the forbidden packages loaded so far, by their top name ("torch")
    return {f for m in list(sys.modules) for f in forbidden if m == f or m.startswith(f + ".")}
loaded = {}
for name in modules + ["infhip.methods.methods()"]:
    before = bad()
    if name.endswith("()"):
        importlib.import_module("infhip.methods").methods()
    else:
        importlib.import_module(name)
    loaded[name] = sorted(bad() - before)
print(json.dumps(loaded))
"""


def test_importing_the_shared_layer_loads_no_torch_and_no_side():
    """One interpreter imports every shared module in turn and reports what each newly loaded."""
    args = [json.dumps(sorted(shared_modules())), json.dumps(FORBIDDEN)]
    out = subprocess.run([sys.executable, "-c", IMPORT_EACH, *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert set(loaded) > set(shared_modules()), loaded
    assert not {k: v for k, v in loaded.items() if v}, f"importing the shared layer loaded {loaded}"
