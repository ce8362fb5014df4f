"""The package's import structure: no import cycle between modules, no import from a lower layer to a higher one.

Every module under src/rlfactory is parsed with ``ast`` (imports at module level and inside functions, and
``TYPE_CHECKING`` blocks); ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``. Imports by string (``importlib.import_module``, how ``stages.get_stage`` loads a stage) are not seen.
A module's layer is its top-level subpackage (or root module), so new modules of a subpackage fit without
editing the order.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "rlfactory"

# lowest first; a module may import from its own layer and any layer before it. "__init__" is the package
# itself (rlfactory/__init__.py), "__main__" is `python -m rlfactory`.
LAYERS: list[tuple[str, ...]] = [
    ("__init__", "errors", "plugins", "usercode"),
    ("config",),
    ("render", "data"),
    ("algos",),
    ("model",),
    ("rewards",),
    ("tasks", "tools", "envs"),
    ("rollout",),
    ("engine",),
    ("stages",),
    ("use",),
    ("cli", "launch", "webui", "__main__"),
]

Graph = dict[str, list[tuple[str, int]]]  # module -> [(imported module, line)]


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The known modules one import statement reaches (``from pkg import submodule`` -> the submodule)."""
    if isinstance(node, ast.Import):
        return [_known_prefix(alias.name, known) for alias in node.names if _known_prefix(alias.name, known)]
    base = node.module or ""
    if node.level:  # relative: from the importing module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    targets = []
    for alias in node.names:
        target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else _known_prefix(base, known)
        if target:
            targets.append(target)
    return targets


def _known_prefix(name: str, known: set[str]) -> str:
    """The longest known module ``name`` starts with ('' if none: a third-party or stdlib import)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return ""


def import_graph(src: Path, package: str = PACKAGE) -> Graph:
    """Every module of ``src/package`` -> the package modules it imports (anywhere in its body), with the line."""
    files = {module_name(p, src): p for p in sorted((src / package).rglob("*.py"))}
    known = set(files)
    graph: Graph = {}
    for module, path in files.items():
        edges = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                is_package = path.name == "__init__.py"
                edges += [(t, node.lineno) for t in _imported(node, module, is_package, known) if t != module]
        graph[module] = sorted(set(edges), key=lambda e: (e[1], e[0]))
    return graph


def find_cycles(graph: Graph) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for target, _ in graph.get(node, []):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(sorted(group), graph) for group in groups if len(group) > 1]


def _cycle_in(group: list[str], graph: Graph) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target, _ in graph.get(node, []):
                if target == start:
                    return paths[node] + [start]
                if target in members and target not in paths:
                    paths[target] = paths[node] + [target]
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a strongly connected group always has one


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int:
    top = _top(module)
    for rank, names in enumerate(layers):
        if top in names:
            return rank
    raise AssertionError(f"{module}: '{top}' is in no layer of tests/test_layers.py LAYERS; add it there")


def upward_imports(graph: Graph, layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """``module (line N) imports target: the rule`` for every import from a lower layer to a higher one."""
    problems = []
    for module, edges in sorted(graph.items()):
        for target, line in edges:
            rank = layer_of(module, layers)
            if layer_of(target, layers) > rank:
                allowed = ", ".join(name for names in layers[: rank + 1] for name in names)
                problems.append(
                    f"{module} (line {line}) imports {target}: layer '{_top(module)}' is below '{_top(target)}' "
                    f"and may import only {allowed}"
                )
    return problems


def check(graph: Graph, layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """Every problem of an import graph, one line each (empty: the structure is sound)."""
    cycles = [f"import cycle: {' -> '.join(cycle)}" for cycle in find_cycles(graph)]
    return cycles + upward_imports(graph, layers)


def test_the_package_has_no_import_cycle_and_no_upward_import():
    graph = import_graph(SRC)
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100  # the parser found the package's imports
    problems = check(graph)
    order = " < ".join(", ".join(names) for names in LAYERS)
    assert not problems, "\n".join(problems) + f"\nlayers, lowest first: {order}"


def test_the_checker_names_a_cycle():
    graph: Graph = {
        "rlfactory.envs.base": [("rlfactory.envs.arith_feedback", 70)],
        "rlfactory.envs.arith_feedback": [("rlfactory.envs.base", 12), ("rlfactory.tasks.arith", 13)],
        "rlfactory.tasks.arith": [],
    }
    assert check(graph) == ["import cycle: rlfactory.envs.arith_feedback -> rlfactory.envs.base -> "
                            "rlfactory.envs.arith_feedback"]
    graph["rlfactory.envs.base"] = []
    assert check(graph) == []


def test_the_checker_names_an_upward_import():
    graph: Graph = {"rlfactory.config.check": [("rlfactory.stages", 14)], "rlfactory.stages": []}
    [problem] = check(graph)
    assert problem == (
        "rlfactory.config.check (line 14) imports rlfactory.stages: layer 'config' is below 'stages' and may "
        "import only __init__, errors, plugins, usercode, config"
    )
    assert check({"rlfactory.stages": [("rlfactory.config.check", 3)], "rlfactory.config.check": []}) == []


def test_the_parser_sees_function_level_and_submodule_imports(tmp_path: Path):
    pkg = tmp_path / "pkg"
    for folder in (pkg, pkg / "low", pkg / "high"):
        folder.mkdir(exist_ok=True)
        (folder / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from pkg.high import b\n")
    (pkg / "high" / "b.py").write_text("from ..low import a\nimport pkg.low.a as alias\nfrom pkg.low import f\n")
    (pkg / "high" / "c.py").write_text("import os\nfrom . import b\nfrom pkg import high\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.low.a"] == [("pkg.high.b", 2)]  # inside a function; the submodule, not the package
    assert graph["pkg.high.b"] == [("pkg.low.a", 1), ("pkg.low.a", 2), ("pkg.low", 3)]
    assert graph["pkg.high.c"] == [("pkg.high.b", 2), ("pkg.high", 3)]
    layers = [("low",), ("high",)]
    assert check(graph, layers) == [
        "import cycle: pkg.high.b -> pkg.low.a -> pkg.high.b",
        "pkg.low.a (line 2) imports pkg.high.b: layer 'low' is below 'high' and may import only low",
    ]
