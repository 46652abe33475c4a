"""The package's import graph: its layers (docs/contributing.md states them in one sentence), no cycles, and the core
never imports transformers or accelerate, not even inside a function.

What is counted: every ``import`` / ``from ... import`` statement in ``hf_efficient/**/*.py`` (read with ``ast``, so
nothing is imported here), relative ones resolved. ``from pkg import name`` is an edge to ``pkg.name`` where that is a
module of the package, else to ``pkg``. A statement is *module level* when it runs as the module is imported (at the
top, or inside ``if`` / ``try`` / a class body), *function level* when it sits in a ``def`` or ``lambda`` (it runs when
called: a lazy import). The parent packages Python imports implicitly are not edges (every module would otherwise
loop through ``hf_efficient/__init__``), nor are imports by name at run time (``importlib.import_module``: the
start-up hook's patching of transformers, by design).

Cycles are refused in both graphs: the module-level one (an import-time circle fails or half-initialises a module),
and the one with the function-level imports added (a lazy import is still a dependency; a circle hidden behind one is
a circle between concerns all the same). The layers and the transformers / accelerate rule count both kinds too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "hf_efficient"
# may import transformers / accelerate (docs/contributing.md: the integrations are the only code that touches them,
# and the console script); every other module is the core, importable with torch alone
OUTSIDE_CORE = ("hf_efficient.integrations", "hf_efficient.cli", "hf_efficient.cli_commands")
# the layers, lowest first: a module imports only from its own layer and those before it (docs/contributing.md)
LAYERS = (("hf_efficient.options", "hf_efficient.optional", "hf_efficient.param_groups"), ("hf_efficient.optim",),
          ("hf_efficient",), OUTSIDE_CORE)


def layer(module: str) -> int:
    """The layer of ``module``: that of the longest prefix it has (``hf_efficient.optim.x`` is optim's)."""
    return max((len(p), i) for i, prefixes in enumerate(LAYERS) for p in prefixes
               if module == p or module.startswith(p + "."))[1]


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, list[tuple[str, int, bool]]]:
    """Module -> [(imported module, line, module level?)], external modules included (by their full name)."""
    files = {_module(p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, list[tuple[str, int, bool]]] = {m: [] for m in files}
    for mod, path in files.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]

        def visit(node: ast.AST, top: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    graph[mod] += [(a.name, child.lineno, top) for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        base = ".".join(package[:len(package) - child.level + 1] + ([base] if base else []))
                    for a in child.names:
                        sub = f"{base}.{a.name}"
                        graph[mod].append((sub if sub in files else base, child.lineno, top))
                visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(), str(path)), True)
    return graph


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first search meets (each closed by a back edge), as [a, b, ..., a]."""
    cycles, state = [], {}

    def dfs(node: str, path: list[str]) -> None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                dfs(nxt, path)
        path.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            dfs(node, [])
    return cycles


def _internal(graph, with_function_level: bool) -> dict[str, set[str]]:
    return {m: {t for t, _, top in deps if t in graph and t != m and (top or with_function_level)}
            for m, deps in graph.items()}


def _explain(graph, cycles) -> str:
    def where(a, b):
        lines = {f"line {line}{'' if top else ' (in a function)'}" for t, line, top in graph[a] if t == b}
        return ", ".join(sorted(lines))

    return "\n".join(" -> ".join(c) + "\n    " + "; ".join(f"{a} imports {b} at {where(a, b)}" for a, b in
                                                          zip(c, c[1:])) for c in cycles)


def test_the_graph_is_read():  # not vacuous: known edges of both kinds are found, and a planted cycle is named
    graph = import_graph()
    assert ("hf_efficient.registry", True) in {(t, top) for t, _, top in graph["hf_efficient.factory"]}
    assert ("transformers", False) in {(t, top) for t, _, top in graph["hf_efficient.integrations.transformers"]}
    assert ("hf_efficient.integrations.transformers", False) in {
        (t, top) for t, _, top in graph["hf_efficient.cli_commands"]}
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert [layer(m) for m in ("hf_efficient.options", "hf_efficient.optim.facts", "hf_efficient.optim",
                               "hf_efficient.registry", "hf_efficient", "hf_efficient.cli",
                               "hf_efficient.integrations.plugin")] == [0, 1, 1, 2, 2, 3, 3]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_cycles_between_module_level_imports():
    graph = import_graph()
    cycles = find_cycles(_internal(graph, with_function_level=False))
    assert not cycles, "import cycles between modules of hf_efficient:\n" + _explain(graph, cycles)


def test_no_cycles_with_function_level_imports():
    graph = import_graph()
    cycles = find_cycles(_internal(graph, with_function_level=True))
    assert not cycles, ("import cycles between modules of hf_efficient, lazy imports counted (move the shared code "
                        "into a module both import):\n" + _explain(graph, cycles))


def test_the_core_imports_neither_transformers_nor_accelerate():
    """Not at module level, nor inside a function: code that needs them belongs to hf_efficient/integrations."""
    found = [f"{m} imports {t} at line {line}{'' if top else ' (in a function)'}" for m, deps in import_graph().items()
             if not m.startswith(OUTSIDE_CORE) for t, line, top in deps if t.split(".")[0] in ("transformers",
                                                                                               "accelerate")]
    assert not found, ("the core must work with torch alone (docs/contributing.md); move the code that needs these "
                       "to hf_efficient/integrations:\n" + "\n".join(found))


def test_each_module_imports_only_its_layer_and_those_before_it():
    """``options``, ``optional`` and ``param_groups`` import nothing of the package; ``optim/`` imports only them and
    itself; the rest of the core imports those and itself; ``integrations/`` and the CLI import the core (lazy
    imports counted)."""
    graph = import_graph()
    assert {layer(m) for m in graph} == set(range(len(LAYERS)))  # every layer has modules: the prefixes are right
    outward = [f"{m} imports {t} at line {line}{'' if top else ' (in a function)'}" for m, deps in graph.items()
               for t, line, top in deps if t in graph and layer(t) > layer(m)]
    assert not outward, "imports against the layers (move the shared code down a layer):\n" + "\n".join(outward)
