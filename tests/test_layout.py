"""The package's shape: no import cycles (function-level imports included), each module imports
alone in a fresh interpreter, and the Dask-free parts stay free of distributed."""

from __future__ import annotations

import ast
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


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" for a in node.names)
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        found |= _imports(node)
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


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None


DASK_FREE = ["dask_rmm", "dask_rmm.wire", "dask_rmm.report", "dask_rmm.logs", "dask_rmm.cli"]
SCHEDULER_AND_CLIENT = [
    "dask_rmm.scheduler",
    "dask_rmm.scheduler.timeline",
    "dask_rmm.scheduler.http",
    "dask_rmm.scheduler.prometheus",
    "dask_rmm.client",
    "dask_rmm.worker_metrics",
    "dask_rmm.logs.replay",
    "dask_rmm.logs.summary",
    "dask_rmm.logs.timeline",
    "dask_rmm._plot",
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
