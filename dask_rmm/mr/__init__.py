"""Memory resources under RMM's ``rmm.mr`` names. This module only re-exports (lazily, so that
``import dask_rmm.mr`` stays cheap); each name lives in the module the table names.
``dask_rmm.mr.experimental`` holds RMM's experimental resources."""

from __future__ import annotations

import importlib

_EXPORTS = {
    # interface
    "DeviceMemoryResource": "dask_rmm.mr.base",
    "UpstreamResourceAdaptor": "dask_rmm.mr.base",
    "OutOfMemoryError": "dask_rmm.mr.base",
    "CUDAAllocationError": "dask_rmm.mr.base",
    "ReservedMemoryInfo": "dask_rmm.mr.base",
    # base resources
    "CudaMemoryResource": "dask_rmm.mr.cuda",
    "ManagedMemoryResource": "dask_rmm.mr.cuda",
    "CudaAsyncMemoryResource": "dask_rmm.mr.cuda",
    "CudaAsyncViewMemoryResource": "dask_rmm.mr.cuda",
    "PinnedHostMemoryResource": "dask_rmm.mr.cuda",
    "SamHeadroomMemoryResource": "dask_rmm.mr.cuda",
    "SystemMemoryResource": "dask_rmm.mr.cuda",
    # suballocators
    "PoolMemoryResource": "dask_rmm.mr.pool",
    "ArenaMemoryResource": "dask_rmm.mr.arena",
    "BinningMemoryResource": "dask_rmm.mr.binning",
    "FixedSizeMemoryResource": "dask_rmm.mr.fixed_size",
    # adaptors
    "StatisticsResourceAdaptor": "dask_rmm.mr.statistics_adaptor",
    "TrackingResourceAdaptor": "dask_rmm.mr.tracking_adaptor",
    "LoggingResourceAdaptor": "dask_rmm.mr.logging_adaptor",
    "LimitingResourceAdaptor": "dask_rmm.mr.limiting_adaptor",
    "FailureCallbackResourceAdaptor": "dask_rmm.mr.failure_callback_adaptor",
    "PrefetchResourceAdaptor": "dask_rmm.mr.prefetch_adaptor",
    "CallbackMemoryResource": "dask_rmm.mr.callback",
    # RMM's experimental resources (the subpackage itself)
    "experimental": "dask_rmm.mr.experimental",
    # event logging of the registered resources (RMM has these in rmm.mr too)
    "disable_logging": "dask_rmm.initialize",
    "enable_logging": "dask_rmm.initialize",
    "get_log_filenames": "dask_rmm.initialize",
    # per-device registry
    "available_device_memory": "dask_rmm.mr.registry",
    "get_current_device_resource": "dask_rmm.mr.registry",
    "get_current_device_resource_type": "dask_rmm.mr.registry",
    "get_per_device_resource": "dask_rmm.mr.registry",
    "get_per_device_resource_type": "dask_rmm.mr.registry",
    "is_initialized": "dask_rmm.mr.registry",
    "registered_devices": "dask_rmm.mr.registry",
    "reset_current_device_resource": "dask_rmm.mr.registry",
    "reset_per_device_resource": "dask_rmm.mr.registry",
    "set_current_device_resource": "dask_rmm.mr.registry",
    "set_per_device_resource": "dask_rmm.mr.registry",
    # giving pooled memory back to the upstream
    "TrimResult": "dask_rmm.mr.trim",
    "trim_pools": "dask_rmm.mr.trim",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dask_rmm.mr' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module.rsplit(".", 1)[-1] == name else getattr(imported, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
