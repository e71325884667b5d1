"""dask-rmm: RMM's Python API in pure Python on cuda-python, and the Dask layer around it.

``import dask_rmm`` never imports distributed and never touches CUDA; every public name is
imported on first use from the module the table names.
"""

from __future__ import annotations

import importlib
import sys

__version__ = "0.1.0"


def _read_git_commit() -> str:
    """The commit a built distribution was made from (its ``GIT_COMMIT`` file, as RMM's);
    empty in a source checkout."""
    from importlib.resources import files

    try:
        return files(__name__).joinpath("GIT_COMMIT").read_text().strip()
    except (FileNotFoundError, OSError):
        return ""


__git_commit__ = _read_git_commit()

# public name -> module holding it. A name that is the module's own last component
# (``statistics``) is the module itself.
_EXPORTS = {
    "mr": "dask_rmm.mr",
    "statistics": "dask_rmm.statistics",
    "allocators": "dask_rmm.allocators",
    "Stream": "dask_rmm.stream",
    "CudaStreamPool": "dask_rmm.stream",
    "DEFAULT_STREAM": "dask_rmm.stream",
    "LEGACY_DEFAULT_STREAM": "dask_rmm.stream",
    "PER_THREAD_DEFAULT_STREAM": "dask_rmm.stream",
    "CUDAError": "dask_rmm._cuda",
    "DeviceBuffer": "dask_rmm.device_buffer",
    "copy_ptr_to_host": "dask_rmm.device_buffer",
    "copy_host_to_ptr": "dask_rmm.device_buffer",
    "copy_device_to_ptr": "dask_rmm.device_buffer",
    "to_device": "dask_rmm.device_buffer",
    "parse_device_bytes": "dask_rmm.config",
    "RMMError": "dask_rmm.initialize",
    "reinitialize": "dask_rmm.initialize",
    "is_initialized": "dask_rmm.initialize",
    "register_reinitialize_hook": "dask_rmm.initialize",
    "unregister_reinitialize_hook": "dask_rmm.initialize",
    "enable_logging": "dask_rmm.initialize",
    "disable_logging": "dask_rmm.initialize",
    "get_log_filenames": "dask_rmm.initialize",
    "set_logging_level": "dask_rmm.logger",
    "get_logging_level": "dask_rmm.logger",
    "set_flush_level": "dask_rmm.logger",
    "get_flush_level": "dask_rmm.logger",
    "flush_on": "dask_rmm.logger",
    "should_log": "dask_rmm.logger",
    "flush_logger": "dask_rmm.logger",
    "level_enum": "dask_rmm.logger",
    "RMMPlugin": "dask_rmm.plugin",
    "cluster_report": "dask_rmm.cluster",
    "ClusterMemoryReport": "dask_rmm.cluster",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dask_rmm' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if module.rsplit(".", 1)[-1] == name else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__


def _register_dask_serializers() -> None:
    """Make distributed import ``dask_rmm.serialize`` the first time it (de)serializes an object
    of a dask_rmm type (distributed's own lazy registration, keyed on the top-level package)."""
    from distributed.protocol import (
        cuda_deserialize,
        cuda_serialize,
        dask_deserialize,
        dask_serialize,
    )

    def register() -> None:
        importlib.import_module("dask_rmm.serialize")

    for dispatch in (cuda_serialize, cuda_deserialize, dask_serialize, dask_deserialize):
        dispatch.register_lazy("dask_rmm", register)


# Only when distributed is already loaded (always so in workers): importing dask_rmm never
# imports distributed itself.
if "distributed.protocol" in sys.modules:
    _register_dask_serializers()
