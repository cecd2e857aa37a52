"""The code's layout, read from its source with `ast` (nothing is imported): no import circle
within a package (module-level and function-level imports alike), a models/ folder that stays
a handful of files beside its subpackages, and no file or function too long to read at once.

The import graph has an edge from a module to every module of its own top-level package that it
imports, relative imports resolved, and to the packages (__init__.py) such an import runs first,
except its own (already running). Imports under `if TYPE_CHECKING:` never run and are left out;
importlib's lazy imports (models/__init__.py's public names) are not seen.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# top-level package -> its folder
PACKAGES = {"models": ROOT / "models", "bench": ROOT / "bench",
            "sifar_jax": ROOT / "src" / "sifar_jax"}
SIZED = (ROOT / "src", ROOT / "models", ROOT / "bench")  # the file and function sizes checked
SKIPPED = (ROOT / "bench" / "results",)
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_MODELS_FILES = 500, 80, 15


def _python_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in folder.rglob("*.py")
                  if "__pycache__" not in p.parts and not any(s in p.parents for s in SKIPPED))


def _module_names(package: str, folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package (a package by its name)."""
    out = {}
    for path in _python_files(folder):
        parts = [package, *path.relative_to(folder).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.stmt]:
    """Every import statement, at any depth (functions, methods, branches), except those under
    `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _targets(node: ast.stmt, name: str, is_package: bool,
             modules: dict) -> Iterator[str]:
    """The modules of `modules` that import statement `node` of module `name` names."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        yield sub if sub in modules else target


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (and the packages those imports run)."""
    modules = _module_names(package, PACKAGES[package])
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        own = set(_ancestors(name)) | {name}
        for node in _imports(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, name, is_package, modules):
                for m in [*_ancestors(target), target]:
                    if m in modules and m not in own:
                        graph[name].add(m)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One import circle of `graph` (its modules in order, the first again at the end), or
    None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> Optional[list[str]]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_graph_sees_relative_function_level_and_package_imports():
    """The reader itself, on models/: a function-level import is an edge, a relative import is
    resolved (to the module when a name is one), and importing a package's module runs the
    package first."""
    graph = import_graph("models")
    assert "models.decoder.step_choice" in graph["models.decoder.decoder"]  # from .step_choice
    assert "models.llama.step" in graph["models.llama.model"]
    assert {"models.weights", "models.weights.fp8_load"} <= graph["models.family"]
    assert "models.decoder.capacity" in graph["models.generate"]  # a function's import
    assert "models.llama" not in graph["models.llama.model"]  # its own package: already running
    cyclic = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(cyclic) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_circle(package):
    cycle = find_cycle(import_graph(package))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_models_holds_a_handful_of_files_beside_its_packages():
    files = sorted(p.name for p in PACKAGES["models"].iterdir()
                   if p.is_file() and p.name != ".DS_Store")
    assert len(files) <= MAX_MODELS_FILES, files


def _sized_files() -> list:
    out = []
    for folder in SIZED:
        for path in _python_files(folder):
            rel = path.relative_to(ROOT).as_posix()
            out.append(pytest.param(path, id=rel))
    return out


@pytest.mark.parametrize("path", _sized_files())
def test_no_file_or_function_too_long(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_FILE_LINES, f"{path.relative_to(ROOT)}: {lines} lines"
    long = {f"{node.name} (line {node.lineno})": node.end_lineno - node.lineno + 1
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert not long, f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: {long}"
