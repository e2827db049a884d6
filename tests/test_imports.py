"""Import structure: every tf_dp module imports on its own (no import circle), and the packages
form the DAG of DESIGN's layers. (``test_import_isolation.py`` imports each module alone.)

The module graph is read from the source with ``ast``: every ``import`` statement counts, also
those inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tf_dp"

#: subpackage -> the subpackages it may import. Where DESIGN.md's layer list says (each folder
#: imports only folders below it: dp_query, ledger, accounting, data, gradients, engine, keras,
#: cli; "ledger only dp_query", "accounting only ledger/dp_query"), from it; auditing, which DESIGN
#: does not place, from the code as it is (its estimators use the accountants; audit_dp_sgd trains
#: through tf_dp.keras on tf_dp.data samplers; the CLI reads audit report files).
ALLOWED = {
    "dp_query": set(),
    "correlated": {"dp_query"},
    "ledger": {"dp_query"},
    "accounting": {"dp_query", "ledger"},
    "data": {"dp_query", "ledger", "accounting"},
    "gradients": {"dp_query", "ledger", "accounting", "data"},
    "engine": {"dp_query", "ledger", "accounting", "data", "gradients"},
    "keras": {"dp_query", "ledger", "accounting", "data", "gradients", "engine", "correlated"},
    "auditing": {"accounting", "data", "keras"},
    "cli": {"dp_query", "ledger", "accounting", "data", "auditing"},
}
#: the top-level modules every subpackage may use (leaves: they import no other tf_dp module)
LEAVES = {"tf_dp._backend", "tf_dp._compat", "tf_dp._progress"}


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set[str]:
    """The tf_dp modules ``name`` imports anywhere in its source (``from pkg import sub`` counts as
    ``pkg.sub`` when that is a module, else as ``pkg``)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_tf_dp_modules():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_sees_a_lazy_circle():
    # a circle closed by an import inside a function is still a circle
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_subpackages_form_the_design_dag():
    subpackages = {_subpackage(m) for m in MODULES if m.count(".") >= 1} - LEAVES
    assert subpackages <= set(ALLOWED), f"declare the layer of {subpackages - set(ALLOWED)}"
    broken = sorted(
        (module, target)
        for module, targets in GRAPH.items()
        if module != "tf_dp" and module not in LEAVES
        for target in targets
        if target not in LEAVES
        and _subpackage(target) != _subpackage(module)
        and _subpackage(target) not in ALLOWED[_subpackage(module)]
    )
    assert broken == [], "imports against DESIGN's layer DAG: " + repr(broken)


def test_registries_are_leaves():
    # the query registry needs only the DPQuery protocol; the ghost rule registry needs no rule
    assert GRAPH["tf_dp.dp_query.serialization"] == {"tf_dp.dp_query.dp_query"}
    assert GRAPH["tf_dp.gradients.ghost.registry"] == set()
    assert GRAPH["tf_dp._backend"] == set()
    assert GRAPH["tf_dp._compat"] == set()
    # each layer family's rule module reaches the registry, never the default registry's module
    families = ("dense", "conv", "embeddings", "normalization", "recurrent", "lora", "activations")
    for family in families:
        assert "tf_dp.gradients.ghost.rules" not in GRAPH[f"tf_dp.gradients.ghost.{family}"]


def test_in_tree_modules_are_not_loaded_through_importlib():
    """A tf_dp module loaded by name would hide an edge from the layer graph above. importlib may
    only load optional modules outside the tree (keras-hub's layer classes, found by name so that
    a keras-hub release without one still imports): no dotted ``tf_dp.`` path string in a module
    that uses it."""
    import re

    users = {m: p.read_text() for m, p in MODULES.items() if "importlib" in p.read_text()}
    assert set(users) <= {"tf_dp.gradients.ghost.keras_hub_rules"}, sorted(users)
    for module, text in users.items():
        assert not re.search(r"[\"']tf_dp\.", text), module
        assert re.search(r"[\"']keras_hub\.", text), module
