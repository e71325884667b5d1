"""dask-rmm: RMM's Python API in pure Python on cuda-python, and the Dask layer around it.

``import dask_rmm`` never imports distributed and never touches CUDA; the Dask parts
(RMMPlugin, cluster_report) are imported on first use.
"""

from __future__ import annotations

import importlib

from dask_rmm import mr
from dask_rmm.stream import (
    DEFAULT_STREAM,
    LEGACY_DEFAULT_STREAM,
    PER_THREAD_DEFAULT_STREAM,
    CudaStreamPool,
    Stream,
)

__version__ = "0.1.0"

# name -> module holding it; imported when first asked for.
_LAZY = {
    "RMMPlugin": "dask_rmm.plugin",
    "cluster_report": "dask_rmm.cluster",
    "ClusterMemoryReport": "dask_rmm.cluster",
}

__all__ = sorted(
    [
        "DEFAULT_STREAM",
        "LEGACY_DEFAULT_STREAM",
        "PER_THREAD_DEFAULT_STREAM",
        "CudaStreamPool",
        "Stream",
        "mr",
        *_LAZY,
    ]
)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dask_rmm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
