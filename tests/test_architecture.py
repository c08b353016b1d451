"""The package's shape, read from its source: the import graph has no cycle, and the CPU
acceleration package (``minipaged.cpu``) is reached from the serving core only through the engine.

The graph is built from every ``import`` / ``from ... import`` statement in a module, wherever
it sits (a lazy import inside a function counts: it runs, and a cycle through it is still a
cycle); only imports under ``if TYPE_CHECKING:`` are left out, since they never run. An edge goes
to the module named: ``from .x import y`` depends on ``minipaged.x.y`` when that is a module,
else on ``minipaged.x``; ``import minipaged.x.y`` depends on ``minipaged.x.y`` (not on the
package ``minipaged.x``, so a package ``__init__`` that re-exports its submodules is no cycle).
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PKG = "minipaged"
ROOT = Path(__file__).resolve().parents[1] / PKG


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py")) if "__pycache__" not in p.parts}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all of them, except the bodies of ``if TYPE_CHECKING:``."""
    found: list = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package's modules that ``name`` imports at run time -> the line of the first such import."""
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]  # the package relative imports start from
    out: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        # the longest prefix of ``target`` that is one of the package's modules
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.setdefault(target, line)

    for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PKG or alias.name.startswith(PKG + "."):
                    add(alias.name, node.lineno)
            continue
        if node.level:
            base = here
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
            if base != PKG and not base.startswith(PKG + "."):
                continue
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            add(sub if sub in modules else base, node.lineno)
    return out


@functools.lru_cache(maxsize=1)
def import_graph() -> dict[str, dict[str, int]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan; the graph is small, recursion is fine
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strong(v)

    cycles = []
    for comp in comps:
        members = set(comp)
        if len(comp) == 1 and comp[0] not in graph.get(comp[0], {}):
            continue
        # a shortest path back to the start, inside the component: the cycle to report
        start = min(comp)
        prev: dict[str, str] = {}
        frontier, seen, end = [start], {start}, None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w == start:
                        end = v
                        break
                    if w in members and w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [end]
        while path[-1] != start:
            path.append(prev[path[-1]])
        cycles.append(list(reversed(path)) + [start])
    return cycles


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    modules = package_modules()
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        rel = modules[a].relative_to(ROOT.parent)
        hops.append(f"{a} -> {b} ({rel}:{graph[a][b]})")
    return " ; ".join(hops)


# -- the tests ---------------------------------------------------------------------------
def test_the_graph_builder_sees_lazy_imports_and_skips_type_only_ones():
    graph = import_graph()
    assert "minipaged.parts" in graph and "minipaged.attention" in graph
    # engine.py imports the trace inside __init__, and the model inside LLM.__init__
    assert "minipaged.trace" in graph["minipaged.engine"]
    # interfaces.py names the data types only for annotations (under TYPE_CHECKING) or imports the data module
    assert "minipaged.scheduler" not in graph["minipaged.interfaces"]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import minipaged.engine\n"
                     "def f():\n    from . import parts\n")
    assert [type(n).__name__ for n in _runtime_imports(tree)] == ["ImportFrom", "ImportFrom"]


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in minipaged (lazy imports count):\n" + "\n".join(
        "  " + " -> ".join(c) + "\n    " + describe(c, graph) for c in cycles
    )


def test_the_seam_layer_is_the_floor():
    """The data module imports nothing of the package; the contracts import only the data module;
    the config imports no implementation (the engine resolves the default parts)."""
    graph = import_graph()
    assert set(graph["minipaged.data"]) == set(), graph["minipaged.data"]
    assert set(graph["minipaged.interfaces"]) <= {"minipaged.data"}, graph["minipaged.interfaces"]
    assert set(graph["minipaged.config"]) <= {"minipaged.data", "minipaged.interfaces"}, graph["minipaged.config"]


CPU = "minipaged.cpu"
# The serving core: of these, only the engine may reach the acceleration package.
CORE = ("engine", "scheduler", "runner", "model", "attention", "kv_cache", "sequence", "sampling", "detokenizer",
        "prefix_cache", "block_allocator", "block_table", "interfaces", "parts", "config", "data")


def _in(name: str, top: str) -> bool:
    full = f"{PKG}.{top}"
    return name == full or name.startswith(full + ".")


def _imports_cpu(targets: dict[str, int]) -> list[str]:
    return [t for t in targets if _in(t, "cpu")]


def test_the_model_attention_and_kv_cache_import_nothing_from_the_cpu_package():
    graph = import_graph()
    below = {n: t for n, t in graph.items() if _in(n, "model") or _in(n, "attention") or n == f"{PKG}.kv_cache"}
    assert f"{PKG}.kv_cache" in below and f"{PKG}.model.llama" in below and f"{PKG}.attention" in below
    bad = {n: _imports_cpu(t) for n, t in below.items() if _imports_cpu(t)}
    assert not bad, f"these import the acceleration package {CPU} (only the engine may): {bad}"


def test_only_the_engine_imports_the_cpu_package_in_the_serving_core():
    graph = import_graph()
    core = {n: t for n, t in graph.items() if any(_in(n, c) for c in CORE)}
    bad = {n: _imports_cpu(t) for n, t in core.items() if _imports_cpu(t) and n != f"{PKG}.engine"}
    assert not bad, f"in the serving core only minipaged.engine imports {CPU}; these do too: {bad}"


def test_a_cycle_is_found_and_reported_as_a_path():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 5}}
    cycles = sorted(find_cycles(graph))
    assert cycles == [["a", "b", "c", "a"], ["e", "e"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


# -- the same, one level up: packages --------------------------------------------------------------
def package_graph(graph: dict[str, dict[str, str]], package: str) -> dict[str, dict[str, str]]:
    """The import graph among ``package``'s children, each subpackage taken as one node (all of
    its modules together): child -> child -> ``"module -> module (line)"``, the first import that
    makes the edge."""
    def child(name: str) -> str | None:
        if not name.startswith(package + "."):
            return None
        return f"{package}.{name[len(package) + 1:].split('.')[0]}"

    out: dict[str, dict[str, str]] = {}
    for a, targets in sorted(graph.items()):
        ca = child(a)
        if ca is None:
            continue
        out.setdefault(ca, {})
        for b, line in sorted(targets.items()):
            cb = child(b)
            if cb is not None and cb != ca:
                out[ca].setdefault(cb, f"{a} -> {b} (line {line})")
    return out


def test_no_package_imports_another_that_imports_it_back():
    """Within every package (minipaged itself, bench, bench.gpu, server, ...), its modules and
    subpackages, a subpackage counted as one, import each other without a loop: e.g. bench must
    not reach the server while the server (or the command line it plugs into) reaches the bench."""
    graph = import_graph()
    modules = package_modules()
    packages = sorted(n for n, p in modules.items() if p.name == "__init__.py")
    assert PKG in packages and f"{PKG}.bench" in packages and f"{PKG}.bench.gpu" in packages
    found = []
    for package in packages:
        pg = package_graph(graph, package)
        for cycle in find_cycles(pg):
            found.append(" -> ".join(cycle) + "\n    " + " ; ".join(pg[a][b] for a, b in zip(cycle, cycle[1:])))
    assert not found, "package-level import loops (lazy imports count):\n  " + "\n  ".join(found)


def test_a_package_loop_is_seen_through_its_modules():
    graph = {"p.a.x": {"p.b.y": 3}, "p.b.y": {"p.b.z": 1}, "p.b.z": {"p.a.w": 7}, "p.a.w": {}}
    pg = package_graph(graph, "p")
    assert find_cycles(pg) == [["p.a", "p.b", "p.a"]] and pg["p.b"]["p.a"] == "p.b.z -> p.a.w (line 7)"
    assert find_cycles(package_graph(graph, "p.b")) == []  # inside b: y -> z only
