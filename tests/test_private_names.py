"""Every private name of another project that dask_rmm uses is in docs/internals.md's table of
private names, and each row names a test that exists.

What counts, found in dask_rmm's source by its syntax tree:

- an import of a ``_private`` module or name of distributed, dask, numba, torch, bokeh,
  tornado or click;
- an attribute ``x._name`` (or ``getattr``/``hasattr``/``setattr`` of ``"_name"``) that dask_rmm
  does not define itself, on anything but ``self``/``cls``: another project's private name;
- a write (assignment, augmented assignment, ``del``) through an attribute of a distributed
  ``Worker``, ``Scheduler``, ``Nanny`` or ``Preload`` (named ``worker``/``dask_worker``,
  ``scheduler``/``dask_scheduler``, ``nanny``, ``preload``): ``worker.plugins[...] = ...``.

A finding is listed when its key (``_name``, or ``Worker.plugins`` for a write; ``worker.state``
is ``WorkerState``) appears in the first column of a row of the table, or its class and
``.attribute`` do.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOREIGN = {"distributed", "dask", "numba", "torch", "bokeh", "tornado", "click"}
HOSTS = {
    "worker": "Worker",
    "dask_worker": "Worker",
    "scheduler": "Scheduler",
    "dask_scheduler": "Scheduler",
    "nanny": "Nanny",
    "preload": "Preload",
}
#: Documented despite the underscore.
PUBLIC = {"_exit"}  # os._exit


def _trees() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(ROOT)): ast.parse(p.read_text())
        for p in sorted((ROOT / "dask_rmm").rglob("*.py"))
    }


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """Names dask_rmm defines: functions, classes, variables, parameters, attributes of
    ``self``/``cls``, keywords and import aliases."""
    own: set[str] = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    own.add(n.attr)
            elif isinstance(n, ast.arg):
                own.add(n.arg)
            elif isinstance(n, ast.keyword) and n.arg:
                own.add(n.arg)
            elif isinstance(n, ast.alias) and n.asname:
                own.add(n.asname)
    return own


def _root(node: ast.AST) -> tuple[str | None, list[str]]:
    """The name an attribute/subscript chain starts from, and the attributes on the way."""
    attrs: list[str] = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def private_uses() -> dict[str, list[str]]:
    """``{key: ["path:line", ...]}`` for every use described in the module docstring."""
    trees = _trees()
    own = _own_names(trees)
    found: dict[str, list[str]] = {}

    def add(key: str, path: str, node: ast.AST) -> None:
        found.setdefault(key, []).append(f"{path}:{node.lineno}")

    for path, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module]
                for module in filter(None, modules):
                    parts = module.split(".")
                    if parts[0] in FOREIGN:
                        for part in parts:
                            if part.startswith("_"):
                                add(part, path, n)
                if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in FOREIGN:
                    for a in n.names:
                        if a.name.startswith("_"):
                            add(a.name, path, n)
            elif isinstance(n, ast.Attribute) or (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and n.func.id in ("getattr", "hasattr", "setattr")
                and len(n.args) >= 2
                and isinstance(n.args[1], ast.Constant)
                and isinstance(n.args[1].value, str)
            ):
                name = n.attr if isinstance(n, ast.Attribute) else n.args[1].value  # type: ignore[union-attr]
                target = n.value if isinstance(n, ast.Attribute) else n.args[0]  # type: ignore[union-attr]
                if (
                    name.startswith("_")
                    and not name.startswith("__")
                    and name not in own
                    and name not in PUBLIC
                    and _root(target)[0] not in ("self", "cls")
                ):
                    add(name, path, n)
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else [n.target]
                for target in targets:
                    elts = target.elts if isinstance(target, ast.Tuple) else [target]
                    for t in elts:
                        name, attrs = _root(t)
                        if name in HOSTS and attrs:
                            host = HOSTS[name]
                            if host == "Worker" and attrs[0] == "state" and len(attrs) > 1:
                                host, attrs = "WorkerState", attrs[1:]  # worker.state
                            add(".".join([host, *attrs]), path, n)
    return found


def _table() -> list[list[str]]:
    text = (ROOT / "docs" / "internals.md").read_text()
    section = text.split("## Private names of other projects", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def _listed(key: str, cells: list[str]) -> bool:
    """``key`` in a row's name, or its class and ``.attribute`` in one row (`WorkerState.a`,
    `.b`, ...)."""
    host, _, attr = key.rpartition(".")
    cls = host.split(".")[0]
    return any(key in c or (cls and cls in c and f"`.{attr}`" in c) for c in cells)


def test_every_private_name_of_another_project_is_in_the_table():
    cells = [row[0] for row in _table()]
    missing = {k: where for k, where in private_uses().items() if not _listed(k, cells)}
    assert not missing, (
        "private names of other projects used by dask_rmm but not in docs/internals.md's "
        f"private-names table (add a row naming the test that fails when it moves): {missing}"
    )


def test_each_row_names_a_test_that_exists():
    for row in _table():
        tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)", row[-1])
        assert tests, f"the row {row[0]} names no test"
        for path, name in tests:
            source = (ROOT / path).read_text() if (ROOT / path).exists() else ""
            assert re.search(rf"def {name}\b", source), f"{row[0]}: no {path}::{name}"


def test_the_search_finds_each_kind_of_use(tmp_path, monkeypatch):
    """The three kinds in the docstring are found in code written for the purpose."""
    (tmp_path / "dask_rmm").mkdir()
    (tmp_path / "dask_rmm" / "m.py").write_text(
        "from distributed.utils import _hidden\n"
        "import torch._C\n"
        "def f(worker, thing):\n"
        "    worker.plugins['x'] = 1\n"
        "    worker.memory_manager.data = worker.state.data = {}\n"
        "    return thing._secret, getattr(thing, '_pending')\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert set(private_uses()) == {
        "_hidden",
        "_C",
        "_secret",
        "_pending",
        "Worker.plugins",
        "Worker.memory_manager.data",
        "WorkerState.data",
    }
