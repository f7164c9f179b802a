"""No new import cycles among infhip's modules. Every import counts as an edge, function-local and
`if TYPE_CHECKING:` ones too (tests/_import_graph.py). The cycles left from before this check are
listed in KNOWN_CYCLES, each to be broken; the test fails on any other cycle, and on a listed one that
is gone or has changed (so the list only shrinks). Which layer may import which is
tests/test_layers.py's."""

from __future__ import annotations

from tests._import_graph import cycles, import_graph

KNOWN_CYCLES: set[frozenset[str]] = set()  # none left: every cycle of 9f956b3 is broken


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
