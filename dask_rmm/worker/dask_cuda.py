"""dask-cuda's RMM settings on a worker (``dask cuda worker --rmm-pool-size ...``), taken from its
waiting ``RMMSetup`` plugin as dask-rmm options, and switched off so that no second pool is made.
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = [
    "DASK_CUDA_OPTIONS",
    "DaskCudaSetupError",
    "find_rmm_setup",
    "options_from_rmm_setup",
    "switch_off",
]

#: dask-cuda's ``RMMSetup`` attribute -> (RMMPlugin option, dask-cuda's flag).
DASK_CUDA_OPTIONS = {
    "initial_pool_size": ("pool_size", "--rmm-pool-size"),
    "maximum_pool_size": ("maximum_pool_size", "--rmm-maximum-pool-size"),
    "managed_memory": ("managed_memory", "--rmm-managed-memory"),
    "async_alloc": ("async_alloc", "--rmm-async"),
    "release_threshold": ("release_threshold", "--rmm-release-threshold"),
    "log_directory": ("log_directory", "--rmm-log-directory"),
    "rmm_track_allocations": ("track_allocations", "--rmm-track-allocations"),
    "external_lib_list": ("allocators", "--set-rmm-allocator-for-libs"),
}


class DaskCudaSetupError(RuntimeError):
    """dask-cuda's RMM settings cannot become dask-rmm's (already applied, or unreadable)."""


def _is_rmm_setup(plugin: Any) -> bool:
    cls = type(plugin)
    return cls.__name__ == "RMMSetup" and cls.__module__.startswith("dask_cuda")


def find_rmm_setup(worker: Any) -> Any | None:
    """dask-cuda's ``RMMSetup`` plugin given to ``worker``, or None; :class:`DaskCudaSetupError`
    when it ran already (compiled RMM's pool exists)."""
    for plugin in worker.plugins.values():
        if _is_rmm_setup(plugin) and any(getattr(plugin, a, None) for a in DASK_CUDA_OPTIONS):
            raise DaskCudaSetupError(
                "dask-cuda's RMMSetup plugin ran before dask_rmm.preload, so compiled RMM's "
                "pool is made already; start the worker with --preload dask_rmm.preload (or "
                "LocalCUDACluster(preload=['dask_rmm.preload'])) so that dask-rmm sets the "
                "worker up first"
            )
    # a worker's start plugins wait here until its preloads ran (no public accessor)
    pending = getattr(worker, "_pending_plugins", None) or ()
    found = [p for p in pending if _is_rmm_setup(p)]
    return found[0] if found else None


def options_from_rmm_setup(setup: Any) -> dict[str, tuple[Any, str]]:
    """``{RMMPlugin option: (value, dask-cuda flag)}`` for the settings dask-cuda was given,
    sizes as typed; switches only when on (False cannot be told from "not given")."""
    out: dict[str, tuple[Any, str]] = {}
    for attr, (option, flag) in DASK_CUDA_OPTIONS.items():
        value = getattr(setup, attr, None)
        if value is None or value is False:
            continue
        if option == "allocators":
            value = [value] if isinstance(value, str) else list(value)
            if not value:
                continue
        out[option] = (value, flag)
    return out


def switch_off(setup: Any) -> None:
    """Clear ``setup``'s settings (False or None) so that its ``setup`` changes nothing in
    compiled RMM (no ``rmm.reinitialize``, no adaptor, no library pointed at it)."""
    for attr in [*DASK_CUDA_OPTIONS, "logging"]:
        setattr(setup, attr, False if isinstance(getattr(setup, attr, None), bool) else None)


def compiled_rmm_installed() -> bool:
    """Whether the compiled ``rmm`` package is installed (cuDF, cuML allocate through it)."""
    try:
        return importlib.util.find_spec("rmm") is not None
    except (ImportError, ValueError):
        return False
