"""``dask_rmm.mr`` imports its names eagerly, as RMM's does, and stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dask_rmm
import dask_rmm.mr

ROOT = Path(__file__).resolve().parents[2]


def test_importing_mr_loads_no_cuda_python_numpy_or_dask():
    code = (
        "import sys, dask_rmm.mr\n"
        "assert all(hasattr(dask_rmm.mr, n) for n in dask_rmm.mr.__all__)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'cuda', 'dask', 'distributed', 'numpy'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


def test_logging_functions_live_in_mr_and_keep_their_top_level_paths():
    for name in ("enable_logging", "disable_logging", "get_log_filenames"):
        func = getattr(dask_rmm.mr, name)
        assert func.__module__ == "dask_rmm.mr.logging_adaptor"
        assert getattr(dask_rmm, name) is func is getattr(dask_rmm.initialize, name)


def test_removed_rmm_names_are_gone():
    # RMM 26.08 removed them; rmm_compat runs RMM's own suite, which no longer calls them
    assert not hasattr(dask_rmm.mr, "get_current_device_resource_type")
    assert not hasattr(dask_rmm.mr, "get_per_device_resource_type")
