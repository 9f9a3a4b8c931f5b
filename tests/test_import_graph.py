"""The import graph of atlas_vlm / mm_token_pipeline / mm_kv_cache_management has no circle.

Built from the source with ``ast`` (nothing is imported): an edge ``a -> b`` for every
``import`` of ``b`` anywhere in ``a``, function-level imports included (a lazy import that
closes a circle still ties the two modules together: ``loader`` <-> ``hub`` <-> ``quantization``
did, until ``atlas_vlm.checkpoint`` took what they share). ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.text

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("atlas_vlm", "mm_token_pipeline", "mm_kv_cache_management")
# known lazy pairs, each a function-level import that breaks the circle at run time; the list
# only shrinks: params.validate_structured_outputs calls the backend to check a grammar
KNOWN = {frozenset({"atlas_vlm.structured_output.backend", "atlas_vlm.structured_output.params"})}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _edges(name: str, path: Path, mods: dict[str, Path], function_level: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in (ast.walk(tree) if function_level else tree.body):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in mods else base)
    return {m for m in out if m in mods and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def _graph(function_level: bool) -> dict[str, set[str]]:
    mods = _modules()
    return {m: _edges(m, p, mods, function_level) for m, p in mods.items()}


def test_module_level_imports_have_no_circle():
    assert _circles(_graph(function_level=False)) == []


def test_no_circle_even_through_function_level_imports():
    graph = _graph(function_level=True)
    assert "atlas_vlm.checkpoint" in graph["atlas_vlm.hub"]  # the graph sees lazy imports
    assert [c for c in _circles(graph) if frozenset(c) not in KNOWN] == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
