"""``dask_rmm.mr`` for type checkers: the names it imports on first use are the names its
``TYPE_CHECKING`` block imports, so that mypy and IDEs see the real classes, not ``Any``."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dask_rmm.mr

ROOT = Path(__file__).resolve().parents[2]
MR_INIT = ROOT / "dask_rmm" / "mr" / "__init__.py"


def _type_checking_imports() -> dict[str, str]:
    """Name -> module it is imported from, in the ``if TYPE_CHECKING:`` block (a submodule
    imported from its package counts as its own module, as in ``_EXPORTS``)."""
    tree = ast.parse(MR_INIT.read_text())
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    found = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name}: re-export it as itself"
            submodule = f"{node.module}.{alias.name}"
            is_module = (
                importlib.util.find_spec(submodule) is not None
                if node.module == "dask_rmm.mr"
                else False
            )
            found[alias.name] = submodule if is_module else node.module
    return found


def test_type_checking_block_imports_exactly_the_lazy_names():
    assert _type_checking_imports() == dask_rmm.mr._EXPORTS


def test_every_lazy_name_resolves_to_what_the_block_names():
    for name, module in dask_rmm.mr._EXPORTS.items():
        value = getattr(dask_rmm.mr, name)
        owner = value.__name__ if module.endswith("." + name) else value.__module__
        assert owner == module, name


def test_every_name_imports_without_cuda_python_or_dask():
    # the TYPE_CHECKING block is not run; the names, imported for real, stay light
    code = (
        "import sys, dask_rmm.mr\n"
        "for name in dask_rmm.mr.__all__: getattr(dask_rmm.mr, name)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'cuda', 'dask', 'distributed', 'numpy'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


def test_mypy_sees_the_real_classes(tmp_path):
    pytest.importorskip("mypy")
    snippet = tmp_path / "use_mr.py"
    snippet.write_text(
        "import dask_rmm.mr\n"
        "reveal_type(dask_rmm.mr.PoolMemoryResource)\n"
        "reveal_type(dask_rmm.mr.get_current_device_resource())\n"
    )
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-incremental",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--no-strict-optional",
            str(snippet),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    revealed = [line for line in out.stdout.splitlines() if "Revealed type" in line]
    assert len(revealed) == 2, out.stdout + out.stderr
    assert "-> dask_rmm.mr.pool.PoolMemoryResource" in revealed[0]
    assert revealed[1].endswith('"dask_rmm.mr.base.DeviceMemoryResource"')
