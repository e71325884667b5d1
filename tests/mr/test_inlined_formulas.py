"""The fast paths of the pool and the arena inline a few formulas of mr/size_classes.py (a table
lookup by ``(nbytes + 255) >> 8``, an align-up ``(nbytes + 255) & -256``, a class lookup with
its fallback) and compare stream handles with the per-thread default stream's. These tests read
every inlined copy out of the sources, check its constants, evaluate it against the reference
function, and fail on an inlined copy of the class formula itself, so that no copy can drift.
Also: mr/ modules share only public names."""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
from pathlib import Path
from typing import Any

import pytest

import dask_rmm.mr
from dask_rmm.mr import size_classes as sc
from dask_rmm.sizes import ALIGNMENT, align_up
from dask_rmm.stream import PER_THREAD_DEFAULT_STREAM, PER_THREAD_HANDLE

TABLES = {"SEARCH_CLASS": sc.search_class, "INSERT_CLASS": sc.insert_class}
MR_DIR = Path(dask_rmm.mr.__file__).parent


def _mr_modules() -> list[str]:
    return sorted(
        f"dask_rmm.mr.{m.name}" for m in pkgutil.iter_modules([str(MR_DIR)]) if not m.ispkg
    )


def _tree(module: str) -> ast.Module:
    path = MR_DIR / (module.rsplit(".", 1)[-1] + ".py")
    return ast.parse(path.read_text(), filename=str(path))


def _compile(node: ast.expr, module: str) -> tuple[Any, str]:
    """``(function of the expression's one free variable, that variable's name)``."""
    namespace = vars(importlib.import_module(module))
    free = sorted(
        {
            n.id
            for n in ast.walk(node)
            if isinstance(n, ast.Name) and n.id not in namespace and n.id not in vars(builtins)
        }
    )
    assert len(free) == 1, f"{module}: {ast.unparse(node)} has free variables {free}"
    fn = ast.Expression(
        ast.Lambda(
            ast.arguments(
                posonlyargs=[], args=[ast.arg(free[0])], kwonlyargs=[], kw_defaults=[], defaults=[]
            ),
            node,
        )
    )
    ast.fix_missing_locations(fn)
    return eval(compile(fn, module, "eval"), dict(namespace)), free[0]


def _int_constants(node: ast.expr) -> set[int]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and type(n.value) is int}


def _byte_sizes_to_check() -> list[int]:
    """Every unit's first and last byte size below the tables' limit: where a rounding slip shows."""
    sizes = []
    for u in range(1, sc.TABLE_UNITS):
        sizes += [(u << sc.UNIT_SHIFT) - ALIGNMENT + 1, u << sc.UNIT_SHIFT]
    return [n for n in sizes if n <= sc.CACHED_LIMIT]


def _table_lookups_by_bytes(module: str) -> list[ast.Subscript]:
    """Table lookups indexed by an expression of a byte size (not by a unit count)."""
    return [
        node
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("SEARCH_CLASS", "INSERT_CLASS", "ROUNDED_BYTES")
        and not isinstance(node.slice, ast.Name)
    ]


def _units(nbytes: int) -> int:
    """The reference for every inlined ``(nbytes + 255) >> 8``: bytes in units, rounded up."""
    return -(-nbytes // ALIGNMENT)


def _unit_roundings(module: str) -> list[ast.BinOp]:
    """Every ``(x + c) >> k``: a byte size rounded up to units, inlined."""
    return [
        node
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.RShift)
        and isinstance(node.left, ast.BinOp)
        and isinstance(node.left.op, ast.Add)
    ]


def _align_ups(module: str) -> list[ast.BinOp]:
    return [
        node
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.BitAnd)
        and isinstance(node.right, ast.UnaryOp)
        and isinstance(node.right.op, ast.USub)
    ]


def _class_lookups_with_fallback(module: str) -> list[ast.IfExp]:
    return [
        node
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.IfExp)
        and isinstance(node.body, ast.Subscript)
        and isinstance(node.body.value, ast.Name)
        and node.body.value.id in TABLES
    ]


def test_size_class_tables_agree_with_the_class_functions():
    # The tables are built one class (a run of equal entries) at a time, for import speed.
    for u in range(sc.TABLE_UNITS):
        search = sc.search_class(u)
        assert sc.INSERT_CLASS[u] == sc.insert_class(u)
        assert sc.SEARCH_CLASS[u] == search
        assert sc.ROUNDED_BYTES[u] == sc.class_floor(search) << sc.UNIT_SHIFT
    assert len(sc.INSERT_CLASS) == len(sc.SEARCH_CLASS) == len(sc.ROUNDED_BYTES) == sc.TABLE_UNITS


def test_the_class_functions_make_16_classes_per_octave_above_the_exact_ones():
    exact = 1 << sc.EXACT_BITS
    assert [sc.class_floor(c) for c in range(exact)] == list(range(exact))
    per_octave = 1 << sc.SUBCLASS_BITS
    for c in range(exact, sc.insert_class(1 << 40)):
        assert sc.class_floor(c + per_octave) == 2 * sc.class_floor(c)
    for u in list(range(1, 1 << 14)) + [(1 << 40) + d for d in (-1, 0, 1)]:
        ins, search = sc.insert_class(u), sc.search_class(u)
        assert sc.class_floor(ins) <= u < sc.class_floor(ins + 1)
        assert sc.class_floor(search) >= u and (search == 0 or sc.class_floor(search - 1) < u)
    assert _units(1) == 1 and _units(ALIGNMENT) == 1 and _units(ALIGNMENT + 1) == 2
    assert sc.CACHED_LIMIT == (sc.TABLE_UNITS - 1) * ALIGNMENT


@pytest.mark.parametrize("module", ["dask_rmm.mr.pool", "dask_rmm.mr.arena"])
def test_every_table_lookup_by_byte_size_rounds_as_units_does(module):
    lookups = _table_lookups_by_bytes(module)
    assert lookups, f"{module} has no inlined table lookup left: drop it from this test"
    sizes = _byte_sizes_to_check()
    for node in lookups:
        assert _int_constants(node.slice) == {ALIGNMENT - 1, sc.UNIT_SHIFT}, ast.unparse(node)
        inlined, _ = _compile(node, module)
        table = node.value.id
        if table == "ROUNDED_BYTES":
            want = [sc.class_floor(sc.search_class(_units(n))) << sc.UNIT_SHIFT for n in sizes]
        else:
            want = [TABLES[table](_units(n)) for n in sizes]
        assert [inlined(n) for n in sizes] == want, f"{module}: {ast.unparse(node)}"


@pytest.mark.parametrize("module", ["dask_rmm.mr.pool", "dask_rmm.mr.arena"])
def test_every_inlined_rounding_to_units_is_units(module):
    copies = _unit_roundings(module)
    assert copies, f"{module} has no inlined rounding to units left: drop it from this test"
    sizes = _byte_sizes_to_check()
    for node in copies:
        assert _int_constants(node) == {ALIGNMENT - 1, sc.UNIT_SHIFT}, ast.unparse(node)
        inlined, _ = _compile(node, module)
        assert [inlined(n) for n in sizes] == [_units(n) for n in sizes], ast.unparse(node)


@pytest.mark.parametrize("module", ["dask_rmm.mr.pool", "dask_rmm.mr.arena"])
def test_every_inlined_align_up_is_align_up(module):
    copies = _align_ups(module)
    assert copies, f"{module} has no inlined align-up left: drop it from this test"
    sizes = list(range(1, 4 * ALIGNMENT)) + [(1 << 30) + d for d in range(-300, 300)]
    for node in copies:
        assert _int_constants(node) == {ALIGNMENT - 1, ALIGNMENT}, ast.unparse(node)
        inlined, _ = _compile(node, module)
        assert [inlined(n) for n in sizes] == [align_up(n) for n in sizes], ast.unparse(node)


def test_every_class_lookup_with_a_fallback_is_the_class_function():
    copies = _class_lookups_with_fallback("dask_rmm.mr.free_list")
    assert len(copies) >= 3  # take, insert, remove
    units = list(range(2 * sc.TABLE_UNITS)) + [(1 << 40) + d for d in range(-40, 40)]
    for node in copies:
        inlined, _ = _compile(node, "dask_rmm.mr.free_list")
        reference = TABLES[node.body.value.id]
        assert [inlined(u) for u in units] == [reference(u) for u in units], ast.unparse(node)


@pytest.mark.parametrize("module", _mr_modules())
def test_no_module_but_size_classes_holds_a_copy_of_the_class_formula(module):
    """The formula (``u.bit_length() - EXACT_BITS`` ...) lives in size_classes.py; a fast path
    that needs it inlined must be added to the checks above."""
    if module == "dask_rmm.mr.size_classes":
        return
    copies = [
        ast.unparse(node)
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.Attribute) and node.attr == "bit_length"
    ]
    assert copies == [], f"{module} inlines the size-class formula: {copies}"


@pytest.mark.parametrize("module", _mr_modules())
def test_no_module_compares_a_stream_handle_with_the_per_thread_handle_spelled_as_a_number(module):
    bare = []
    for node in ast.walk(_tree(module)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = {
            n.id if isinstance(n, ast.Name) else n.attr
            for n in sides
            if isinstance(n, (ast.Name, ast.Attribute))
        }
        numbers = [n for n in sides if isinstance(n, ast.Constant) and n.value == PER_THREAD_HANDLE]
        if numbers and names & {"key", "handle"}:
            bare.append(ast.unparse(node))
    assert bare == [], f"{module}: name the handle (dask_rmm.stream.PER_THREAD_HANDLE): {bare}"


def test_the_per_thread_handle_is_cudas():
    assert PER_THREAD_DEFAULT_STREAM.handle == PER_THREAD_HANDLE
    runtime = pytest.importorskip("cuda.bindings.runtime", reason="cuda-python is not installed")
    assert int(runtime.cudaStreamPerThread) == PER_THREAD_HANDLE


@pytest.mark.parametrize("module", _mr_modules())
def test_no_mr_module_imports_a_private_name_of_another_module(module):
    """Neighbours share public names (size_classes.SEARCH_CLASS, not pool._SRCH); ``_cuda`` is
    the package's one binding layer and is imported as a module."""
    private = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(_tree(module))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dask_rmm")
        for alias in node.names
        if alias.name.startswith("_") and (node.module, alias.name) != ("dask_rmm", "_cuda")
    ]
    assert private == [], f"{module} imports private names: {private}"
