"""No new import cycles among infhip's modules. Every import counts as an edge, function-local and
`if TYPE_CHECKING:` ones too: such an import hides a cycle from Python, not from whoever has to
change one module without the other. The cycles left from before this check are listed in
KNOWN_CYCLES, each to be broken; the test fails on any other cycle, and on a listed one that is gone
or has changed (so the list only shrinks)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KNOWN_CYCLES: set[frozenset[str]] = set()  # none left: every cycle of 9f956b3 is broken


def modules() -> dict[str, Path]:
    """module name -> file, for every package pyproject.toml maps (package-dir)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for package, folder in dirs.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def _targets(name: str, is_package: bool, node: ast.AST, known: dict) -> list[str]:
    """The infhip modules an import statement reaches (a name imported from a package is its
    submodule when there is one, else the package)."""
    def longest(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    if isinstance(node, ast.Import):
        return [m for m in (longest(a.name) for a in node.names) if m]
    base = node.module or ""
    if node.level:
        parent = name if is_package else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            parent = parent.rpartition(".")[0]
        base = f"{parent}.{base}" if base else parent
    return [m for m in (f"{base}.{a.name}" if f"{base}.{a.name}" in known else longest(base) for a in node.names) if m]


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_targets(name, path.stem == "__init__", node, known))
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], set(), 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.add(frozenset(comp))
    return found


def test_the_graph_sees_function_local_and_type_checking_imports():
    graph = import_graph()
    assert "infhip.runtime.kv_cache" in graph and "infhip.plugins.rms_norm" in graph
    assert "infhip.plugins.paged_kv" in graph["infhip.plugins.kv_offload"]  # under TYPE_CHECKING
    assert "infhip.methods" in graph["infhip.plugins.aot_engine"]  # inside a function
    toy = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(toy) == {frozenset("abc")}


def test_no_new_import_cycles():
    found = cycles(import_graph())
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not new, f"new import cycle(s): {new}: move what both sides need into a module of its own"
    assert not gone, f"cycle(s) {gone} are broken or changed: take them out of KNOWN_CYCLES"


# The engine format and what both sides share: torch-free, importing neither the builder nor the runtime
# (a method folder's runtime/ subpackage is its runtime side: RUNTIME_SIDE).
SHARED = ("infhip.config", "infhip.model_config", "infhip.methods", "infhip.registry", "infhip.cli_args",
          "infhip.errors", "infhip.output_dir", "infhip.tensor_parallel")


def runtime_side(module: str) -> bool:
    """A method folder's runtime side (infhip/methods/<name>/runtime/)."""
    parts = module.split(".")
    return parts[:2] == ["infhip", "methods"] and len(parts) > 3 and parts[3] == "runtime"


def test_builder_and_runtime_meet_only_at_the_engine_format_and_the_plugins():
    graph = import_graph()

    def edges(src: str, dst: str) -> list[tuple[str, str]]:
        return sorted((a, b) for a, deps in graph.items() if (a == src or a.startswith(src + ".")) and not runtime_side(a)
                      for b in deps if b == dst or b.startswith(dst + "."))

    assert not edges("infhip.builder", "infhip.runtime"), edges("infhip.builder", "infhip.runtime")
    runtime_sides = [m for m in graph if runtime_side(m)]
    assert not [(m, b) for m in runtime_sides for b in graph[m] if b.startswith("infhip.builder")]
    assert not [(a, b) for a, deps in graph.items() if a.startswith("infhip.builder") for b in deps if runtime_side(b)]
    assert not edges("infhip.runtime", "infhip.builder"), edges("infhip.runtime", "infhip.builder")
    for module in SHARED:
        for side in ("infhip.builder", "infhip.runtime", "infhip.plugins"):
            assert not edges(module, side), edges(module, side)


def test_the_engine_format_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in SHARED) +
            "from infhip.methods import methods\nmethods()\nassert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
