"""Frontends reach the engine through its one interface (docs/design/engine_interface.md):
`EngineLoop` (runtime/engine_loop.py) for the HTTP server, the Triton model and `infhip-run`,
and `LLM`'s public surface where they load an engine. An AST check over their modules: no
attribute access named like the engine's internals (``.runner``, ``.kv``, ``.scheduler``,
``.core``) and no import of an internal module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRONTENDS = sorted([*(ROOT / "runtime" / "serving").rglob("*.py"), ROOT / "runtime" / "server.py",
                    ROOT / "runtime" / "cli.py"])
INTERNAL_ATTRS = {"runner", "kv", "scheduler", "core"}
INTERNAL_MODULES = {f"infhip.runtime.{m}" for m in ("engine_core", "model_runner", "scheduler", "kv_cache",
                                                    "prefix_cache", "forward_context", "step_sampling",
                                                    "sampler", "engine", "load")}


def reaches_past(source: str) -> list[str]:
    """'line N: what' for each reach into the engine's internals in a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in INTERNAL_ATTRS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in INTERNAL_MODULES:
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name in INTERNAL_MODULES]
    return found


@pytest.mark.parametrize("path", FRONTENDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_frontend_reaches_only_the_engine_interface(path):
    found = reaches_past(path.read_text())
    assert not found, (f"{path.relative_to(ROOT)} reaches past the engine interface (EngineLoop, "
                       f"docs/design/engine_interface.md): {found}")


def test_the_check_sees_a_reach():
    """The check itself can fail: each kind of reach is found."""
    assert reaches_past("x = llm.runner.kv") == ["line 1: .kv", "line 1: .runner"]
    assert reaches_past("loop.core.step()") == ["line 1: .core"]
    assert reaches_past("def f():\n    from infhip.runtime.scheduler import Scheduler") == [
        "line 2: from infhip.runtime.scheduler import ..."]
    assert reaches_past("loop.submit(p, None, params)\nloop.stats().num_running") == []
