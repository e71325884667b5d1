"""Memory resources: RMM's ``rmm.mr`` names. This module only re-exports."""

from dask_rmm.mr.base import (
    DeviceMemoryResource,
    OutOfMemoryError,
    ReservedMemoryInfo,
    UpstreamResourceAdaptor,
)
from dask_rmm.mr.cuda import SystemMemoryResource

__all__ = sorted(
    [
        "DeviceMemoryResource",
        "OutOfMemoryError",
        "ReservedMemoryInfo",
        "SystemMemoryResource",
        "UpstreamResourceAdaptor",
    ]
)
