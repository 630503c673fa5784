"""The import direction of simpletuner (``simpletuner/layers.py``): every import in the package, at
module level or inside a function, runs down the layers or through a listed door beside them; no
two modules import each other at module level, directly or round a longer loop; and the GH200
layer never imports training or the entry points above it."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from simpletuner import layers

PACKAGE = Path(__file__).resolve().parent.parent / "simpletuner"
ROOT = "__init__"  # the name simpletuner/layers.py gives the package itself


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or ROOT


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # the simpletuner module imported (its name below ``simpletuner``)
    name: str  # what is imported: the module itself, or ``module.attribute``
    at_module_level: bool  # runs when the importing module is imported (not inside a function)
    type_only: bool = False  # under ``if TYPE_CHECKING:``: for annotations, never run


def _strip(dotted: str) -> str | None:
    """``simpletuner.a.b`` -> ``a.b``; ``simpletuner`` -> ROOT; anything else -> None."""
    if dotted == "simpletuner":
        return ROOT
    return dotted[len("simpletuner.") :] if dotted.startswith("simpletuner.") else None


def _absolute(importer: str, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    package = importer.split(".") if MODULES[importer].name == "__init__.py" else importer.split(".")[:-1]
    if importer == ROOT:
        package = []
    package = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join(["simpletuner", *package, *([node.module] if node.module else [])])


def _targets(importer: str, node: ast.AST) -> list[tuple[str, str]]:
    """``(module, name)`` of each simpletuner thing an import statement brings in."""
    found = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            module = _strip(alias.name)
            if module is not None:
                found.append((module, module))
    elif isinstance(node, ast.ImportFrom):
        base = _strip(_absolute(importer, node) or "")
        if base is None:
            return []
        for alias in node.names:
            sub = alias.name if base == ROOT else f"{base}.{alias.name}"
            if sub in MODULES:
                found.append((sub, sub))
            else:
                found.append((base, sub if base != ROOT else alias.name))
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str) -> list[Import]:
    """Every simpletuner import statement of ``module``, and each string naming a simpletuner
    module (what ``importlib.import_module`` is given)."""
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, in_function, True)
            for child in node.orelse:
                visit(child, in_function, type_only)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.extend(Import(node.lineno, m, n, not in_function, type_only) for m, n in _targets(module, node))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = _strip(node.value)
            if named in MODULES and named != ROOT:
                found.append(Import(node.lineno, named, named, False, type_only))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inside, type_only)

    visit(ast.parse(MODULES[module].read_text(), str(MODULES[module])), False, False)
    return found


ALL_IMPORTS: dict[str, list[Import]] = {module: imports_of(module) for module in MODULES}
#: The imports that run (annotation-only imports under ``if TYPE_CHECKING:`` are not arrows).
IMPORTS: dict[str, list[Import]] = {m: [i for i in found if not i.type_only] for m, found in ALL_IMPORTS.items()}


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}"


def test_every_module_is_in_a_layer():
    assert not [m for m in MODULES if layers.part_of(m) is None], "add them to LAYERS in simpletuner/layers.py"


def test_the_table_is_consistent():
    parts = [p for layer in layers.LAYERS for p in layer]
    assert len(parts) == len(set(parts)), "a part is listed twice"
    assert all(p in MODULES for p in parts), [p for p in parts if p not in MODULES]
    # Folders show the layers: a part is a top-level package or module, never a module inside a package, so
    # the package-to-package import graph is the one this table orders.
    assert not [p for p in parts if "." in p], "a part inside a package: move the module to the folder of its layer"
    for (source, target), allowed in layers.BESIDE.items():
        assert layers.layer_of(source) == layers.layer_of(target), f"BESIDE {source} -> {target}: not one layer"
        for name in allowed or ():  # each door names something that exists
            module, _, attribute = name.rpartition(".")
            tree = ast.parse(MODULES[module].read_text())
            defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            assert attribute in defined, f"BESIDE names {name}, which {module} does not define"


def test_the_rule_refuses_arrows_up_and_through_a_door_too_wide():
    assert layers.arrow_problem("training.trainer", "models.adapters", "models.adapters.trainable_state") is None
    assert layers.arrow_problem("models.spec", "models.adapters.lycoris", "models.adapters.lycoris") is None
    assert layers.arrow_problem("models.spec", "training.trainer", "training.trainer.Trainer") == (
        "layer models may not import layer training (training is above it)"
    )
    assert "gh200 may not import layer caching" in layers.arrow_problem("gh200.wiring", "caching", "caching.x")
    assert "memory may not import layer training (training is beside it)" in layers.arrow_problem(
        "memory.estimator", "training.launch", "training.launch.make_accelerator"
    )
    assert layers.arrow_problem("training.trainer", "memory.oom", "memory.oom.explain_out_of_memory") is None
    assert layers.arrow_problem("training.trainer", "memory.estimator", "memory.estimator.estimate_memory") == (
        "training may import only memory.oom.explain_out_of_memory, memory.preflight.check_run_memory from memory"
    )
    assert layers.arrow_problem("cli", "nowhere.module", "nowhere.module") == (
        "nowhere.module is in no layer of simpletuner/layers.py"
    )


def test_every_import_runs_down_the_layers():
    bad = []
    for module, found in IMPORTS.items():
        for imp in found:
            problem = layers.arrow_problem(module, imp.module, imp.name)
            if problem:
                bad.append(f"{_where(module, imp.line)} imports {imp.name} ({problem})")
    assert not bad, "imports against simpletuner/layers.py:\n" + "\n".join(bad)


def _module_level_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported module: line}, for imports that run when the importer is imported,
    with the packages each import loads on the way (except the importer's own packages)."""
    graph: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for module, found in IMPORTS.items():
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)} | {module, ROOT}
        for imp in found:
            if not imp.at_module_level:
                continue
            pieces = imp.module.split(".")
            loaded = {".".join(pieces[:i]) for i in range(1, len(pieces))} - own
            explicit = {imp.module} - ({module} if imp.module == module else set())
            for target in loaded | explicit:
                graph[module].setdefault(target, imp.line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    loops = []
    for component in components:  # one loop through the component, found breadth-first
        members, start = set(component), min(component)
        paths = {start: [start]}
        queue = [start]
        while queue:
            node = queue.pop(0)
            for nxt in sorted(graph[node]):
                if nxt == start:
                    loops.append(paths[node] + [start])
                    queue = []
                    break
                if nxt in members and nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    queue.append(nxt)
    return loops


def test_no_import_cycle_at_module_level():
    graph = _module_level_graph()
    described = [
        " -> ".join(f"{a} ({_where(a, graph[a][b])})" for a, b in zip(loop, loop[1:])) + f" -> {loop[-1]}"
        for loop in _cycles(graph)
    ]
    assert not described, "module-level import cycles:\n" + "\n".join(described)


def test_the_cycle_finder_finds_a_loop():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("path", sorted((PACKAGE / "gh200").glob("*.py")), ids=lambda p: p.name)
def test_gh200_never_imports_the_layers_above_it(path):
    """The GH200 layer sits beside data_backend and caching, below training: it never imports
    simpletuner.training (nor the entry points above it), at module level or inside a function."""
    above = ("training", "train", "cli", "demo")
    module = _module_name(path)
    bad = [
        f"{path.name}:{imp.line} imports {imp.name}"
        for imp in ALL_IMPORTS[module]  # annotation-only imports too
        if any(imp.module == top or imp.module.startswith(top + ".") for top in above)
    ]
    assert not bad, "simpletuner/gh200 must not import training or the entry points: " + "; ".join(bad)
