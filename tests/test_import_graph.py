"""The import graph of atlas_vlm / mm_token_pipeline / mm_kv_cache_management: no circle, and
every floor imports only downward.

Built from the source with ``ast``: an edge ``a -> b`` for every ``import`` of ``b`` anywhere in
``a``, function-level imports included (a lazy import that closes a circle still ties the two
modules together: ``loader`` <-> ``hub`` <-> ``quantization`` did, until ``atlas_vlm.checkpoint``
took what they share). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module,
else to ``pkg``. A ``"module:attr"`` string naming a module of ours (the model registry's
classes, imported on demand by ``import_named``) is an edge too: the code it names runs as if
imported, so it counts for circles and floors alike. An import under ``if TYPE_CHECKING:`` is no
edge (it never runs): the decoders name ``ModelArch`` in annotations only, while
``ModelArch.from_hf_config`` reads the registry that names the decoders.

The floors (``FLOORS``): ``mm_kv_cache_management`` and ``mm_token_pipeline`` import nothing of
``atlas_vlm``; ``atlas_vlm.kernels`` no ``layers`` or ``models``; ``atlas_vlm.layers`` no
``models``; ``atlas_vlm.models`` no ``engine``, ``worker`` or ``entrypoints``; ``atlas_vlm.inputs`` (the
contracts the families implement) none of those nor ``models``. No module takes
a private name (leading underscore) from another package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.text

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("atlas_vlm", "mm_token_pipeline", "mm_kv_cache_management")
# known lazy pairs, each a function-level import that breaks the circle at run time; the list
# only shrinks: params.validate_structured_outputs calls the backend to check a grammar
KNOWN = {frozenset({"atlas_vlm.structured_output.backend", "atlas_vlm.structured_output.params"})}
# (importer prefix, forbidden prefixes): a module under the first may import none under the second
FLOORS = (
    ("mm_kv_cache_management", ("atlas_vlm",)),
    ("mm_token_pipeline", ("atlas_vlm",)),
    ("atlas_vlm.kernels", ("atlas_vlm.layers", "atlas_vlm.models")),
    ("atlas_vlm.layers", ("atlas_vlm.models",)),
    ("atlas_vlm.models", ("atlas_vlm.engine", "atlas_vlm.worker", "atlas_vlm.entrypoints")),
    ("atlas_vlm.inputs", ("atlas_vlm.models", "atlas_vlm.engine", "atlas_vlm.worker", "atlas_vlm.entrypoints")),
)
NAMED = re.compile(r"^([A-Za-z_][\w.]*):[A-Za-z_]\w*$")  # "module:attr"


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
    for node in (_walk(tree) if function_level else tree.body):
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
    out |= _named_modules(tree, mods)
    return {m for m in out if m in mods and m != name}


def _walk(tree: ast.AST):
    """``ast.walk`` less the bodies of ``if TYPE_CHECKING:``: an import there never runs."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _named_modules(tree: ast.Module, mods: dict[str, Path]) -> set[str]:
    """Modules named by ``"module:attr"`` strings in ``tree``; an f-string's ``{NAME}`` parts are
    filled from the module's top-level string constants (the registry's ``f"{_Q2}.vision:..."``)."""
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.JoinedStr)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    consts[target.id] = node.value
    out = set()
    for node in ast.walk(tree):
        text = _string_value(node, consts)
        if text is not None and (m := NAMED.match(text)) and m.group(1) in mods:
            out.add(m.group(1))
    return out


def _string_value(node, consts: dict) -> str | None:
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if not isinstance(node, ast.JoinedStr):
        return None
    parts = []
    for value in node.values:
        if isinstance(value, ast.FormattedValue):
            if not (isinstance(value.value, ast.Name) and value.value.id in consts):
                return None
            value = consts[value.value.id]
        text = _string_value(value, consts)
        if text is None:
            return None
        parts.append(text)
    return "".join(parts)


def _private_imports(name: str, path: Path, mods: dict[str, Path]) -> list[str]:
    """``from other.package import _name`` in ``name`` (anywhere in the file): ``module._name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        if base not in mods:
            continue
        home = base if mods[base].name == "__init__.py" else base.rpartition(".")[0]
        found += [f"{base}.{a.name}" for a in node.names
                  if a.name.startswith("_") and not a.name.startswith("__") and home != package]
    return found


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


def test_registry_strings_are_edges():
    graph = _graph(function_level=True)
    assert "atlas_vlm.models.qwen2_vl.vision" in graph["atlas_vlm.models.registry"]
    assert "atlas_vlm.models.decoder" in graph["atlas_vlm.models.registry"]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_every_floor_imports_only_downward():
    graph = _graph(function_level=True)
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets
                    for low, banned in FLOORS if _under(m, low) and any(_under(t, b) for b in banned))
    assert upward == []


def test_no_module_takes_a_private_name_from_another_package():
    mods = _modules()
    found = sorted(f"{m}: {p}" for m, path in mods.items() for p in _private_imports(m, path, mods))
    assert found == []


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
