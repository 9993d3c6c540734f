"""The floors of the tree run one way (STYLE.md): protos/ and what both services share at the
bottom, the two services side by side, client/ on top. Checked on the source with `ast`, every
import counted (inside functions and `if TYPE_CHECKING:` too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "scheduler_service", "executor_service", "client")
TESTS = ROOT / "tests"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "_pb2" not in path.name
    }


def _imports(path: Path, name: str, known) -> set[str]:
    """The modules `path` imports, resolved to modules of `known` (a name, or its package)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
                break
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = _imports(path, name, modules)
        # A submodule naming its own package's __init__ (the package is imported first anyway).
        graph[name] = {t for t in edges if not name.startswith(t + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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


def _package(module: str) -> str:
    return module.split(".")[0]


def test_no_service_imports_the_client():
    graph = import_graph()
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _package(m) in ("scheduler_service", "executor_service", "protos")
        for t in targets
        if _package(t) == "client"
    )
    assert not bad


def test_the_scheduler_imports_nothing_of_the_executor():
    graph = import_graph()
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _package(m) in ("scheduler_service", "protos")
        for t in targets
        if _package(t) == "executor_service"
    )
    assert not bad


def test_protos_imports_neither_service():
    graph = import_graph()
    bad = sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        if _package(m) == "protos"
        for t in ts
        if _package(t) != "protos"
    )
    assert not bad


def test_no_import_circles():
    assert _cycles(import_graph()) == []


def test_no_test_module_imports_another():
    test_modules = {p.stem for p in TESTS.glob("test_*.py")}
    bad = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names if not node.module]
            else:
                continue
            bad += [f"{path.name} -> {n}" for n in names if n.split(".")[-1] in test_modules]
    assert not bad


def test_the_checker_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
