"""The package's shape: no import cycles (function-level imports included), each module imports
alone in a fresh interpreter, and the Dask-free parts stay free of distributed."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dask_rmm"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _has_lazy_table(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)


def _string_import(node: ast.AST) -> str | None:
    """``"m"`` of ``importlib.import_module("m")`` or ``__import__("m")``."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        func = ast.unparse(node.func)
        if func.endswith("import_module") or func == "__import__":
            return str(node.args[0].value)
    return None


def _imports(tree: ast.AST, lazy: bool | None = None) -> set[str]:
    """What ``tree`` imports, however late: import statements, string imports and, in a module
    with a ``__getattr__``, every string of its lazy table (TYPE_CHECKING blocks aside)."""
    if lazy is None:
        lazy = isinstance(tree, ast.Module) and _has_lazy_table(tree)
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" for a in node.names)
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif (target := _string_import(node)) is not None:
            found.add(target)
        elif lazy and isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
        found |= _imports(node, lazy)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere (TYPE_CHECKING blocks aside), without
    a package's own submodules (a package re-exporting its parts is not a cycle)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = _imports(ast.parse(path.read_text()))
        graph[name] = {
            t
            for t in targets
            if t in modules
            and t != name
            and not t.startswith(name + ".")
            and not name.startswith(t + ".")
        }
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return path[path.index(v) :] + [v]
            if v not in state and (cycle := visit(v)):
                return cycle
        path.pop()
        state[u] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_lazy_tables_and_string_imports_are_imports():
    lazy = "_T = {'X': 'dask_rmm.b'}\ndef __getattr__(name):\n    return _T[name]\n"
    assert "dask_rmm.b" in _imports(ast.parse(lazy))
    assert "dask_rmm.b" not in _imports(ast.parse("_T = {'X': 'dask_rmm.b'}\n"))
    late = "def f():\n    return importlib.import_module('dask_rmm.c')\n"
    assert "dask_rmm.c" in _imports(ast.parse(late))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None


def folder_of(module: str) -> str:
    """The package folder a module lives in (``dask_rmm.report.plot`` -> ``dask_rmm.report``);
    a top-level module (``dask_rmm.wire``) is its own node."""
    parts = module.split(".")
    return ".".join(parts[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between folders: ``a -> b`` when any module of folder ``a`` imports one
    of folder ``b``."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        node = folder_of(module)
        out.setdefault(node, set())
        for target in targets:
            if folder_of(target) != node:
                out[node].add(folder_of(target))
                out.setdefault(folder_of(target), set())
    return out


def test_folder_graph_finds_a_cycle_between_folders():
    # modules without a cycle, folders with one: report.model <- scheduler.x <- report.fetch
    graph = {
        "dask_rmm.report.model": set(),
        "dask_rmm.scheduler.x": {"dask_rmm.report.model"},
        "dask_rmm.report.fetch": {"dask_rmm.scheduler.x"},
    }
    assert find_cycle(graph) is None
    assert find_cycle(folder_graph(graph)) in (
        ["dask_rmm.report", "dask_rmm.scheduler", "dask_rmm.report"],
        ["dask_rmm.scheduler", "dask_rmm.report", "dask_rmm.scheduler"],
    )


def test_no_import_cycles_between_folders():
    assert find_cycle(folder_graph(import_graph())) is None


DASK_FREE = [
    "dask_rmm",
    "dask_rmm.wire",
    "dask_rmm.stack",
    "dask_rmm.report",
    "dask_rmm.plotting",
    "dask_rmm.logs",
    "dask_rmm.cli",
]
SCHEDULER_AND_CLIENT = [
    "dask_rmm.scheduler",
    "dask_rmm.scheduler.timeline",
    "dask_rmm.scheduler.http",
    "dask_rmm.scheduler.prometheus",
    "dask_rmm.client.fetch",
    "dask_rmm.client.sampler",
    "dask_rmm.client.performance",
    "dask_rmm.worker.metrics",
    "dask_rmm.worker.trim",
    "dask_rmm.logs.replay",
    "dask_rmm.logs.summary",
    "dask_rmm.logs.timeline",
    "dask_rmm.report.plot",
]


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("module", DASK_FREE)
def test_dask_free_modules_import_alone_without_distributed(module):
    assert _run(f"import sys, {module}; print('distributed' in sys.modules)") == "False"


def test_scheduler_and_client_modules_import_alone():
    # One interpreter, each module first in a forgotten-modules state: a circular import fails.
    code = (
        "import sys\n"
        f"for m in {SCHEDULER_AND_CLIENT!r}:\n"
        "    for k in [k for k in sys.modules if k.startswith('dask_rmm')]: del sys.modules[k]\n"
        "    __import__(m)\n"
        "print('ok')"
    )
    assert _run(code) == "ok"


# -- layers: the tree is the architecture ----------------------------------------------------------

#: The RMM API (top-level modules, no Dask), memory resources, library allocators and the stack
#: builder: the bottom of the package.
LOWER_LAYERS = ("dask_rmm.mr", "dask_rmm.allocators", "dask_rmm.stack")
RMM_API = (
    "dask_rmm",
    "dask_rmm._cuda",
    "dask_rmm.stream",
    "dask_rmm.device_buffer",
    "dask_rmm.statistics",
    "dask_rmm.logger",
    "dask_rmm.initialize",
    "dask_rmm.sizes",
    "dask_rmm.config",
    "dask_rmm.wire",
)
#: What the lower layers must never import, however late (function-level imports included).
UPPER_LAYERS = (
    "dask_rmm.plugin",
    "dask_rmm.preload",
    "dask_rmm.worker",
    "dask_rmm.pressure",
    "dask_rmm.scheduler",
    "dask_rmm.report",
    "dask_rmm.client",
    "dask_rmm.cli",
)


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for each lower-layer module ``a`` that imports an upper-layer module ``b``."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module in RMM_API or _in(module, LOWER_LAYERS)
        for target in targets
        if _in(target, UPPER_LAYERS)
    )


def test_layer_violations_are_found():
    graph = {"dask_rmm.mr.pool": {"dask_rmm.worker.stacks"}, "dask_rmm.plugin": {"dask_rmm.mr"}}
    assert layer_violations(graph) == ["dask_rmm.mr.pool -> dask_rmm.worker.stacks"]


def test_the_rmm_api_and_mr_never_import_the_worker_scheduler_or_report_layers():
    assert layer_violations(import_graph()) == []


def test_every_module_belongs_to_a_layer():
    # a new top-level module must be placed on purpose: in the RMM API, or in a layer's folder
    top_level = {m for m in _modules() if m.count(".") == 1}
    known = set(RMM_API) | {"dask_rmm._output"} | set(UPPER_LAYERS) | set(LOWER_LAYERS)
    known |= {"dask_rmm.logs", "dask_rmm.plotting"}
    assert top_level - known == set()


def test_import_dask_rmm_loads_no_dask_and_no_worker_module():
    loaded = _run(
        "import sys, dask_rmm; print(' '.join(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('dask', 'distributed') or m.startswith(('dask_rmm.worker', "
        "'dask_rmm.plugin', 'dask_rmm.scheduler', 'dask_rmm.report', 'dask_rmm.client', "
        "'dask_rmm.pressure')))))"
    )
    assert loaded == ""


# -- every documented import path works -----------------------------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FROM_IMPORT = re.compile(r"from (dask_rmm[\w.]*) import \(?([\w, ]+)")
_DOTTED = re.compile(r"`(dask_rmm(?:\.\w+)+)")


def documented_paths() -> set[str]:
    """``module:name`` for each ``from dask_rmm... import name`` in README.md and docs/, and each
    dotted ``dask_rmm.x.y`` they cite in backquotes."""
    paths: set[str] = set()
    for doc in DOCS:
        text = doc.read_text()
        for module, names in _FROM_IMPORT.findall(text):
            paths.update(f"{module}:{n.strip()}" for n in names.split(",") if n.strip())
        paths.update(_DOTTED.findall(text))
    return paths


def _resolves(path: str) -> bool:
    module, _, name = path.partition(":")
    if not name:  # dotted: the longest importable prefix, then attributes
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                return False
            return True
        return False
    return hasattr(importlib.import_module(module), name)


def test_documented_paths_are_found():
    found = documented_paths()
    assert "dask_rmm:RMMPlugin" in found and "dask_rmm.stack.build_stack" in found
    assert _resolves("dask_rmm.mr:PoolMemoryResource")
    assert not _resolves("dask_rmm.mr.no_such_module")
    assert not _resolves("dask_rmm:no_such_name")


def test_every_documented_import_path_works():
    broken = sorted(p for p in documented_paths() if not _resolves(p))
    assert broken == []


def cuda_importers(modules: dict[str, Path]) -> list[str]:
    """The modules that import cuda-python (``cuda`` or any ``cuda.*``), anywhere in the file."""
    return sorted(
        name
        for name, path in modules.items()
        if any(t == "cuda" or t.startswith("cuda.") for t in _imports(ast.parse(path.read_text())))
    )


def test_only_the_cuda_module_imports_cuda_python(tmp_path):
    other = tmp_path / "other.py"
    other.write_text("def f():\n    from cuda.bindings import runtime\n")
    assert cuda_importers({"dask_rmm.other": other}) == ["dask_rmm.other"]
    # and numba's allocator, for the driver types Numba's MemoryPointer and IpcHandle take
    # (cuda.bindings' public CUdeviceptr/CUipcMemHandle instead of a private name of Numba's)
    assert cuda_importers(_modules()) == ["dask_rmm._cuda", "dask_rmm.allocators.numba"]
