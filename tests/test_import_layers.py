"""The import contract of docs/design.md's code map: no import cycles among the modules of
``zeropp`` and ``zeropp_tools`` (imports inside functions included, ``TYPE_CHECKING`` ones
not), the library never imports the tools, and importing it imports no trainer framework
(those are optional extras, imported by ``zeropp.integrations`` modules only)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zeropp", "zeropp_tools")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports. An edge to one's own package is left
    out: Python runs a package's ``__init__`` before any of its modules anyway."""
    paths = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for statement in _imports(ast.parse(path.read_text())):
            for target in _targets(statement, name, path.name == "__init__.py"):
                while target and target not in paths:  # a name imported from a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    targets.add(target)
        graph[name] = targets
    return graph


def _imports(tree: ast.AST):
    """Import statements anywhere in ``tree`` except under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (statement for child in node.orelse for statement in _imports(ast.Module([child], [])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _targets(statement, module: str, is_package: bool) -> list[str]:
    if isinstance(statement, ast.Import):
        return [alias.name for alias in statement.names]
    base = module.split(".") if is_package else module.split(".")[:-1]
    if statement.level:
        base = base[:len(base) - statement.level + 1]
        package = ".".join(base + ([statement.module] if statement.module else []))
    else:
        package = statement.module
    return [package, *(f"{package}.{alias.name}" for alias in statement.names)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert len(graph) > 100 and "zeropp.accounting" in graph["zeropp.auto.step_model"]
    assert cycles(graph) == []


def test_a_cycle_introduced_is_found():
    graph = import_graph()
    assert "zeropp.topology" in graph["zeropp.engine.sharded_model"]
    graph["zeropp.topology"].add("zeropp.engine.sharded_model")  # as if topology.py imported the engine
    found = cycles(graph)
    assert len(found) == 1 and {"zeropp.topology", "zeropp.engine.sharded_model"} <= set(found[0])


def test_the_library_never_imports_the_tools():
    graph = import_graph()
    offending = {name: sorted(t for t in targets if t.startswith("zeropp_tools"))
                 for name, targets in graph.items() if name.startswith("zeropp.")}
    assert not {name: targets for name, targets in offending.items() if targets}


def test_importing_the_library_imports_no_trainer_framework():
    code = ("import sys, zeropp, zeropp.engine, zeropp.checkpoint, zeropp.hf; "
            "print(sorted({'transformers', 'accelerate', 'trl', 'peft', 'lightning'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
