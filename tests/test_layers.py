"""The layers hold: which part of infhip may import which, read from the source (every import counts,
function-local and `if TYPE_CHECKING:` ones too: tests/_import_graph.py).

    shared (infhip/)  <-  plugins/  <-  builder/, runtime/  <-  eval/

- The shared layer is the folder `infhip/`: the package root (the public API, resolved lazily), the
  engine format (`config.py`, `model_config.py`), the plan methods' registry (`methods/`) and the
  small things both sides read. It imports no torch, triton or numpy and no other layer, anywhere in
  its code, except the deferred imports listed in DEFERRED with why (a listed one that is gone fails
  too: the list only shrinks); importing any of its modules, and loading the methods' registry, in a
  fresh interpreter loads none of them.
- The builder and the runtime meet only at the engine format and the plugins: neither imports the
  other.
- Eval (`infhip-eval`, the references the tests hold the engine to) is a client of the runtime: it
  may import the runtime, and no other layer imports it.
A module's folder decides its layer, and its import name says the same (`eval/` is `infhip.eval`).
A plan method's folder (`infhip/methods/<name>/`) is shared but for its `runtime/` sub-folder, the
method's runtime side (`infhip.methods.<name>.runtime`), which belongs to the runtime layer
(docs/design/adding.md, "A method is a folder").
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests._import_graph import edges, import_graph, modules

ROOT = Path(__file__).resolve().parent.parent

# layer (its import name) -> (its folder, the layers it may import). "infhip" is the shared layer:
# the root package, less the sub-packages that are layers of their own.
LAYERS = {
    "infhip": ("infhip", set()),
    "infhip.plugins": ("plugins", {"infhip"}),
    "infhip.builder": ("builder", {"infhip", "infhip.plugins"}),
    "infhip.runtime": ("runtime", {"infhip", "infhip.plugins"}),
    "infhip.eval": ("eval", {"infhip", "infhip.plugins", "infhip.runtime"}),
}
THIRD_PARTY = ("torch", "triton", "numpy")  # what the shared layer never imports either

# (shared module, what it imports inside a function): the one place each is allowed, and why.
DEFERRED = {
    ("infhip", "infhip.runtime"): "the package root's public API (`from infhip import LLM`), resolved on first use",
    ("infhip.knobs_doc", "infhip.runtime"): "docs/knobs.md's load-option table reads runtime/options.py's flags",
}


def method_runtime(module: str) -> bool:
    """Whether an import name is (in) a plan method's runtime side, infhip.methods.<name>.runtime."""
    parts = module.split(".")
    return parts[:2] == ["infhip", "methods"] and len(parts) > 3 and parts[3] == "runtime"


def layer_of(module: str) -> str:
    """The layer an import name belongs to: the longest layer name it starts with (a method's
    runtime side: the runtime's)."""
    if method_runtime(module):
        return "infhip.runtime"
    return max((l for l in LAYERS if module == l or module.startswith(l + ".")), key=len)


def folder_of(module: str, path: Path) -> str:
    """The layer folder a module's file sits in: the first part of its path, or a method's runtime
    side's folder (infhip/methods/<name>/runtime)."""
    rel = path.relative_to(ROOT).parts
    return "runtime" if rel[:2] == ("infhip", "methods") and len(rel) > 4 and rel[3] == "runtime" else rel[0]


def shared_modules() -> dict[str, Path]:
    return {m: p for m, p in modules().items() if layer_of(m) == "infhip"}


def _forbidden(name: str) -> str | None:
    banned = THIRD_PARTY + tuple(l for l in LAYERS if l != "infhip")
    return next((f for f in banned if name == f or name.startswith(f + ".")), None)


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


def test_a_modules_folder_decides_its_layer():
    """Every module sits in its layer's folder, and every .py file of a layer's folder is a module
    pyproject installs (none escapes the rules by not being mapped)."""
    found = modules()
    misplaced = {m: str(p.relative_to(ROOT)) for m, p in found.items() if folder_of(m, p) != LAYERS[layer_of(m)][0]}
    assert not misplaced, f"modules outside their layer's folder: {misplaced}"
    files = {p for folder, _ in LAYERS.values() for p in (ROOT / folder).rglob("*.py")}
    assert not files - set(found.values()), f"not installed, so under no rule: {sorted(files - set(found.values()))}"
    shared = shared_modules()
    assert {"infhip", "infhip.config", "infhip.methods", "infhip.methods.method", "infhip.knobs_doc"} <= set(shared)
    assert "infhip.eval.forcing" in found and "infhip.eval.forcing" not in shared
    sides = {m for m in found if method_runtime(m)}  # the methods' runtime sides: the runtime's layer
    assert {"infhip.methods.infinitehip.runtime.backend", "infhip.methods.token_drop.runtime.transform"} <= sides
    assert {"infhip.methods.infinitehip", "infhip.methods.token_drop.knobs"} <= set(shared) and not sides & set(shared)


def test_no_shared_module_imports_torch_or_another_layer():
    found = set().union(*(imports_of(m, p) for m, p in shared_modules().items()))
    assert found <= set(DEFERRED), f"shared modules importing {sorted(found - set(DEFERRED))}: move the code to its side"
    assert set(DEFERRED) <= found, f"{sorted(set(DEFERRED) - found)} no longer imported: take them out of DEFERRED"


def test_each_layer_imports_only_the_layers_below_it():
    """Builder and runtime never import each other; plugins import neither; nothing imports eval."""
    graph = import_graph()
    assert edges(graph, "infhip.eval", "infhip.runtime"), "the graph should see eval using the runtime"
    bad = [e for src, (_, allowed) in LAYERS.items() if src != "infhip"
           for dst in LAYERS if dst not in allowed | {src}
           for e in edges(graph, src, dst) if layer_of(e[0]) == src and layer_of(e[1]) == dst]
    assert not bad, f"imports against the layering (importer, imported): {bad}"


def test_a_methods_runtime_side_is_held_as_the_runtime():
    """A method's runtime/ sub-folder imports only what the runtime may, and only a layer that may
    import the runtime imports it (the method's shared modules do not)."""
    graph = import_graph()
    runtime, allowed = "infhip.runtime", LAYERS["infhip.runtime"][1] | {"infhip.runtime"}
    sides = [m for m in graph if method_runtime(m)]
    assert sides, "no method runtime side found"
    out = [(a, b) for a in sides for b in graph[a] if layer_of(b) not in allowed]
    into = [(a, b) for a, deps in graph.items() for b in deps
            if method_runtime(b) and runtime not in LAYERS[layer_of(a)][1] | {layer_of(a)}]
    assert not out and not into, f"imports against the layering (importer, imported): {out + into}"


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


def test_importing_the_shared_layer_loads_no_torch_and_no_other_layer():
    """One interpreter imports every shared module in turn and reports what each newly loaded."""
    forbidden = list(THIRD_PARTY) + [l for l in LAYERS if l != "infhip"]
    args = [json.dumps(sorted(shared_modules())), json.dumps(forbidden)]
    out = subprocess.run([sys.executable, "-c", IMPORT_EACH, *args], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert set(loaded) > set(shared_modules()), loaded
    assert not {k: v for k, v in loaded.items() if v}, f"importing the shared layer loaded {loaded}"
