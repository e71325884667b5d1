"""Memory resources under RMM's ``rmm.mr`` names. This module only re-exports; each name lives
in the module the table names. ``dask_rmm.mr.experimental`` holds RMM's experimental resources.

At run time the names are imported on first use: ``dask_rmm.initialize`` (``enable_logging``)
imports ``dask_rmm.mr``, so an eager import here would be a circle. Type checkers and IDEs read
the ``TYPE_CHECKING`` block instead, which imports the same names eagerly (tests/mr/test_mr_exports.py
keeps the two lists equal)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs (``X as X``: re-exported)
    from dask_rmm.initialize import disable_logging as disable_logging
    from dask_rmm.initialize import enable_logging as enable_logging
    from dask_rmm.initialize import get_log_filenames as get_log_filenames
    from dask_rmm.mr import experimental as experimental
    from dask_rmm.mr.arena import ArenaMemoryResource as ArenaMemoryResource
    from dask_rmm.mr.base import CUDAAllocationError as CUDAAllocationError
    from dask_rmm.mr.base import DeviceMemoryResource as DeviceMemoryResource
    from dask_rmm.mr.base import OutOfMemoryError as OutOfMemoryError
    from dask_rmm.mr.base import ReservedMemoryInfo as ReservedMemoryInfo
    from dask_rmm.mr.base import UpstreamResourceAdaptor as UpstreamResourceAdaptor
    from dask_rmm.mr.binning import BinningMemoryResource as BinningMemoryResource
    from dask_rmm.mr.callback import CallbackMemoryResource as CallbackMemoryResource
    from dask_rmm.mr.cuda import CudaAsyncMemoryResource as CudaAsyncMemoryResource
    from dask_rmm.mr.cuda import CudaAsyncViewMemoryResource as CudaAsyncViewMemoryResource
    from dask_rmm.mr.cuda import CudaMemoryResource as CudaMemoryResource
    from dask_rmm.mr.cuda import ManagedMemoryResource as ManagedMemoryResource
    from dask_rmm.mr.cuda import PinnedHostMemoryResource as PinnedHostMemoryResource
    from dask_rmm.mr.cuda import SamHeadroomMemoryResource as SamHeadroomMemoryResource
    from dask_rmm.mr.cuda import SystemMemoryResource as SystemMemoryResource
    from dask_rmm.mr.failure_callback_adaptor import (
        FailureCallbackResourceAdaptor as FailureCallbackResourceAdaptor,
    )
    from dask_rmm.mr.fixed_size import FixedSizeMemoryResource as FixedSizeMemoryResource
    from dask_rmm.mr.limiting_adaptor import LimitingResourceAdaptor as LimitingResourceAdaptor
    from dask_rmm.mr.logging_adaptor import LoggingResourceAdaptor as LoggingResourceAdaptor
    from dask_rmm.mr.pool import PoolMemoryResource as PoolMemoryResource
    from dask_rmm.mr.prefetch_adaptor import PrefetchResourceAdaptor as PrefetchResourceAdaptor
    from dask_rmm.mr.registry import available_device_memory as available_device_memory
    from dask_rmm.mr.registry import get_current_device_resource as get_current_device_resource
    from dask_rmm.mr.registry import (
        get_current_device_resource_type as get_current_device_resource_type,
    )
    from dask_rmm.mr.registry import get_per_device_resource as get_per_device_resource
    from dask_rmm.mr.registry import get_per_device_resource_type as get_per_device_resource_type
    from dask_rmm.mr.registry import is_initialized as is_initialized
    from dask_rmm.mr.registry import registered_devices as registered_devices
    from dask_rmm.mr.registry import reset_current_device_resource as reset_current_device_resource
    from dask_rmm.mr.registry import reset_per_device_resource as reset_per_device_resource
    from dask_rmm.mr.registry import set_current_device_resource as set_current_device_resource
    from dask_rmm.mr.registry import set_per_device_resource as set_per_device_resource
    from dask_rmm.mr.statistics_adaptor import (
        StatisticsResourceAdaptor as StatisticsResourceAdaptor,
    )
    from dask_rmm.mr.tracking_adaptor import TrackingResourceAdaptor as TrackingResourceAdaptor
    from dask_rmm.mr.trim import TrimResult as TrimResult
    from dask_rmm.mr.trim import trim_pools as trim_pools


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
