"""infhip's import graph, read from the source: every import is an edge, function-local and
`if TYPE_CHECKING:` ones too (such an import hides a dependency from Python, not from whoever has
to change one module without the other). Used by tests/test_import_cycles.py (no cycles) and
tests/test_layers.py (which layer may import which)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_folders() -> dict[str, Path]:
    """package -> its folder, for every package pyproject.toml installs (`packages`, each placed by
    the longest `package-dir` prefix that maps it, the rest of its name as sub-folders)."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setup["package-dir"]
    packages = setup["packages"] if isinstance(setup.get("packages"), list) else list(dirs)
    out = {}
    for package in packages:
        base = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        out[package] = ROOT / dirs[base] / package[len(base):].lstrip(".").replace(".", "/")
    return out


def modules() -> dict[str, Path]:
    """module name -> file, for every module of every package pyproject.toml installs."""
    out = {}
    for package, folder in package_folders().items():
        for path in sorted(folder.glob("*.py")):
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


def edges(graph: dict[str, set[str]], src: str, dst: str) -> list[tuple[str, str]]:
    """(importer, imported) for each import from package `src` (or its submodules) into `dst`."""
    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return sorted((a, b) for a, deps in graph.items() if within(a, src) for b in deps if within(b, dst))
