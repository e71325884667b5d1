"""dask-rmm: RMM's Python API in pure Python on cuda-python, and the Dask layer around it.

``import dask_rmm`` never imports distributed and never touches CUDA: the names that need
distributed or numpy (``_LAZY``) are imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.resources

from dask_rmm import allocators, mr, statistics
from dask_rmm._cuda import CUDAError
from dask_rmm.initialize import (
    RMMError,
    disable_logging,
    enable_logging,
    get_log_filenames,
    is_initialized,
    register_reinitialize_hook,
    reinitialize,
    unregister_reinitialize_hook,
)
from dask_rmm.logger import (
    flush_logger,
    flush_on,
    get_flush_level,
    get_logging_level,
    level_enum,
    set_flush_level,
    set_logging_level,
    should_log,
)
from dask_rmm.sizes import parse_device_bytes
from dask_rmm.stream import (
    DEFAULT_STREAM,
    LEGACY_DEFAULT_STREAM,
    PER_THREAD_DEFAULT_STREAM,
    CudaStreamPool,
    Stream,
)

__version__ = "0.1.0"


try:  # the commit a built distribution was made from (as RMM's); none in a source checkout
    __git_commit__ = importlib.resources.files(__name__).joinpath("GIT_COMMIT").read_text().strip()
except OSError:
    __git_commit__ = ""

# name -> its module, which imports distributed or numpy
_LAZY = {
    "DeviceBuffer": "dask_rmm.device_buffer",
    "copy_device_to_ptr": "dask_rmm.device_buffer",
    "copy_host_to_ptr": "dask_rmm.device_buffer",
    "copy_ptr_to_host": "dask_rmm.device_buffer",
    "to_device": "dask_rmm.device_buffer",
    "RMMPlugin": "dask_rmm.plugin",
    "RMMSetupError": "dask_rmm.plugin",
    "cluster_report": "dask_rmm.client.fetch",
    "ClusterMemoryReport": "dask_rmm.report.memory_report",
    "GPUMemorySampler": "dask_rmm.client.sampler",
    "performance_report": "dask_rmm.client.performance",
    "release_unused": "dask_rmm.worker.trim",
}

__all__ = [
    *_LAZY,
    "CUDAError",
    "CudaStreamPool",
    "DEFAULT_STREAM",
    "LEGACY_DEFAULT_STREAM",
    "PER_THREAD_DEFAULT_STREAM",
    "RMMError",
    "Stream",
    "allocators",
    "disable_logging",
    "enable_logging",
    "flush_logger",
    "flush_on",
    "get_flush_level",
    "get_log_filenames",
    "get_logging_level",
    "is_initialized",
    "level_enum",
    "mr",
    "parse_device_bytes",
    "register_reinitialize_hook",
    "reinitialize",
    "set_flush_level",
    "set_logging_level",
    "should_log",
    "statistics",
    "unregister_reinitialize_hook",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dask_rmm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
