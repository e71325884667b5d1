"""Memory resources under RMM's ``rmm.mr`` names, imported eagerly as RMM's are; each lives in
the module it is imported from. ``dask_rmm.mr.experimental`` holds RMM's experimental resources.
Nothing here imports cuda-python, numpy or Dask."""

from dask_rmm.mr import experimental
from dask_rmm.mr.arena import ArenaMemoryResource
from dask_rmm.mr.base import (
    CUDAAllocationError,
    DeviceMemoryResource,
    OutOfMemoryError,
    ReservedMemoryInfo,
    UpstreamResourceAdaptor,
)
from dask_rmm.mr.binning import BinningMemoryResource
from dask_rmm.mr.callback import CallbackMemoryResource
from dask_rmm.mr.cuda import (
    CudaAsyncMemoryResource,
    CudaAsyncViewMemoryResource,
    CudaMemoryResource,
    ManagedMemoryResource,
    PinnedHostMemoryResource,
    SamHeadroomMemoryResource,
    SystemMemoryResource,
)
from dask_rmm.mr.failure_callback_adaptor import FailureCallbackResourceAdaptor
from dask_rmm.mr.fixed_size import FixedSizeMemoryResource
from dask_rmm.mr.limiting_adaptor import LimitingResourceAdaptor
from dask_rmm.mr.logging_adaptor import (
    LoggingResourceAdaptor,
    disable_logging,
    enable_logging,
    get_log_filenames,
)
from dask_rmm.mr.pool import PoolMemoryResource
from dask_rmm.mr.prefetch_adaptor import PrefetchResourceAdaptor
from dask_rmm.mr.registry import (
    available_device_memory,
    get_current_device_resource,
    get_per_device_resource,
    is_initialized,
    registered_devices,
    reset_current_device_resource,
    reset_per_device_resource,
    set_current_device_resource,
    set_per_device_resource,
)
from dask_rmm.mr.statistics_adaptor import StatisticsResourceAdaptor
from dask_rmm.mr.tracking_adaptor import TrackingResourceAdaptor
from dask_rmm.mr.trim import TrimResult, trim_pools

__all__ = [
    "ArenaMemoryResource",
    "BinningMemoryResource",
    "CUDAAllocationError",
    "CallbackMemoryResource",
    "CudaAsyncMemoryResource",
    "CudaAsyncViewMemoryResource",
    "CudaMemoryResource",
    "DeviceMemoryResource",
    "FailureCallbackResourceAdaptor",
    "FixedSizeMemoryResource",
    "LimitingResourceAdaptor",
    "LoggingResourceAdaptor",
    "ManagedMemoryResource",
    "OutOfMemoryError",
    "PinnedHostMemoryResource",
    "PoolMemoryResource",
    "PrefetchResourceAdaptor",
    "ReservedMemoryInfo",
    "SamHeadroomMemoryResource",
    "StatisticsResourceAdaptor",
    "SystemMemoryResource",
    "TrackingResourceAdaptor",
    "TrimResult",
    "UpstreamResourceAdaptor",
    "available_device_memory",
    "disable_logging",
    "enable_logging",
    "experimental",
    "get_current_device_resource",
    "get_log_filenames",
    "get_per_device_resource",
    "is_initialized",
    "registered_devices",
    "reset_current_device_resource",
    "reset_per_device_resource",
    "set_current_device_resource",
    "set_per_device_resource",
    "trim_pools",
]
